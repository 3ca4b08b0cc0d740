package replication_test

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay/replication"
)

func TestParseServerDuration(t *testing.T) {
	tests := []struct {
		in   string
		want time.Duration
	}{
		{"1min", time.Minute},
		{"60s", time.Minute},
		{"500ms", 500 * time.Millisecond},
		{"2500", 2500 * time.Millisecond},
		{"1h", time.Hour},
		{"0", 0},
		{"-1", 0},
	}
	for _, tt := range tests {
		got, err := replication.ParseServerDuration(tt.in)
		if err != nil || got != tt.want {
			t.Errorf("ParseServerDuration(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
	for _, bad := range []string{"", "min", "5 fortnights", "1.5s"} {
		if _, err := replication.ParseServerDuration(bad); err == nil {
			t.Errorf("ParseServerDuration(%q) succeeded", bad)
		}
	}
}

func TestParseTimestamptz(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want time.Time
	}{
		{"microseconds", "2026-12-02 16:17:36.123456+00", time.Date(2026, 12, 2, 16, 17, 36, 123456000, time.UTC)},
		{"trimmed fraction", "2026-12-02 16:17:36.1+00", time.Date(2026, 12, 2, 16, 17, 36, 100000000, time.UTC)},
		{"whole seconds", "2026-12-02 16:17:36+00", time.Date(2026, 12, 2, 16, 17, 36, 0, time.UTC)},
		{"offset with minutes", "2026-12-02 16:17:36.5+05:30", time.Date(2026, 12, 2, 10, 47, 36, 500000000, time.UTC)},
		{"offset with seconds", "1900-01-01 00:00:00+00:09:21", time.Date(1899, 12, 31, 23, 50, 39, 0, time.UTC)},
		{"-infinity", "-infinity", time.Time{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := replication.ParseTimestamptz(tt.in)
			if err != nil || !got.Equal(tt.want) || got.Location() != time.UTC {
				t.Errorf("ParseTimestamptz(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
			}
		})
	}
	if got, err := replication.ParseTimestamptz("infinity"); err != nil || got.Year() != 9999 {
		t.Errorf("infinity = %v, %v", got, err)
	}
	for _, bad := range []string{"", "2026-12-02", "12/02/2026 16:17:36 UTC", "2026-12-02 16:17:36+00 BC"} {
		if _, err := replication.ParseTimestamptz(bad); err == nil {
			t.Errorf("ParseTimestamptz(%q) succeeded", bad)
		}
	}
}
