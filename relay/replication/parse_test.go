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
		// PostgreSQL prints years past 9999 with more digits and years
		// before 1 AD with " BC" (1 BC is year 0); such rows once stopped
		// the stream (found by FuzzDecodeInsert).
		{"five-digit year", "10000-01-01 00:00:00+00", time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)},
		{"last timestamptz", "294276-12-31 23:59:59.999999+00", time.Date(294276, 12, 31, 23, 59, 59, 999999000, time.UTC)},
		{"BC", "0044-03-15 12:00:00.5+00 BC", time.Date(-43, 3, 15, 12, 0, 0, 500000000, time.UTC)},
		{"1 BC is year 0", "0001-02-29 00:00:00+00 BC", time.Date(0, 2, 29, 0, 0, 0, 0, time.UTC)},
		{"first timestamptz", "4713-11-24 00:00:00+00 BC", time.Date(-4712, 11, 24, 0, 0, 0, 0, time.UTC)},
		{"BC with an offset in seconds", "0044-03-15 12:19:32+00:19:32 BC", time.Date(-43, 3, 15, 12, 0, 0, 0, time.UTC)},
		{"five-digit year, offset with minutes", "10000-02-29 05:30:00+05:30", time.Date(10000, 2, 29, 0, 0, 0, 0, time.UTC)},
		// time.Parse takes an offset of -1 s for none, its sentinel, and
		// returned 1969-12-31 23:59:59.000021 UTC (found by FuzzDecodeInsert).
		{"offset of minus one second", "1969-12-31 23:59:59.000021-00:00:01", time.Date(1970, 1, 1, 0, 0, 0, 21000, time.UTC)},
		{"offset of minus one second, five-digit year", "10001-02-28 23:59:59-00:00:01", time.Date(10001, 3, 1, 0, 0, 0, 0, time.UTC)},
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
	for _, bad := range []string{"", "2026-12-02", "12/02/2026 16:17:36 UTC", "2026-12-02 16:17:36+00 AD",
		"0000-01-01 00:00:00+00 BC", "-0044-03-15 12:00:00+00", "+10000-01-01 00:00:00+00", "10000-01-01", " BC", "-01-01 00:00:00+00 BC", "0002-02-29 00:00:00+00 BC"} {
		if _, err := replication.ParseTimestamptz(bad); err == nil {
			t.Errorf("ParseTimestamptz(%q) succeeded", bad)
		}
	}
}
