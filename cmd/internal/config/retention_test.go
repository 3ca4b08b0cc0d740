package config_test

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

func TestRetention_Defaults(t *testing.T) {
	c := MustLoad(t, "")
	want := config.RetentionConfig{
		Enabled:     true,
		DoneAfter:   sec(168 * time.Hour),
		LedgerAfter: sec(720 * time.Hour),
		Interval:    sec(time.Minute),
		Batch:       1000,
	}
	if c.Retention != want {
		t.Fatalf("retention defaults = %+v, want %+v", c.Retention, want)
	}
	if got := c.Retention.DoneAfter.String(); got != "168h" {
		t.Errorf("done_after prints as %q, want 168h", got)
	}
}

func TestRetention_FileAndEnvironment(t *testing.T) {
	c := MustLoad(t, "retention:\n  done_after: 24h\n  ledger_after: 48h\n  interval: 30s\n  batch: 500\n",
		"RELAY_RETENTION_ENABLED=false")
	want := config.RetentionConfig{
		Enabled:     false,
		DoneAfter:   sec(24 * time.Hour),
		LedgerAfter: sec(48 * time.Hour),
		Interval:    sec(30 * time.Second),
		Batch:       500,
	}
	if c.Retention != want {
		t.Fatalf("retention = %+v, want %+v", c.Retention, want)
	}
}

func TestRetention_Invalid(t *testing.T) {
	tests := []struct {
		name string
		yaml string
		want []string
	}{
		{"zero ages and interval", "retention:\n  done_after: 0s\n  ledger_after: -1h\n  interval: 0s\n", []string{
			"relay.yaml:2: retention.done_after: must be greater than zero, got 0s",
			"relay.yaml:3: retention.ledger_after: must be greater than zero, got -1h",
			"relay.yaml:4: retention.interval: must be greater than zero, got 0s",
		}},
		{"ledger pruned before its rows", "retention:\n  done_after: 720h\n  ledger_after: 24h\n", []string{
			"relay.yaml:3: retention.ledger_after: 24h is shorter than retention.done_after (720h)",
		}},
		{"batch too small", "retention:\n  batch: 0\n", []string{"relay.yaml:2: retention.batch: must be between 1 and 100000, got 0"}},
		{"batch too large", "retention:\n  batch: 1000000\n", []string{"relay.yaml:2: retention.batch: must be between 1 and 100000"}},
		{"checked while disabled", "retention:\n  enabled: false\n  batch: -5\n", []string{"retention.batch"}},
		{"unknown key", "retention:\n  done_afer: 1h\n", []string{"unknown key retention.done_afer (did you mean retention.done_after?)"}},
		{"not a bool", "retention:\n  enabled: sometimes\n", []string{`relay.yaml:2: retention.enabled: expected true or false, got "sometimes"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, tt.yaml)
			requireErrorContains(t, err, tt.want...)
		})
	}
}
