package config_test

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

func TestVerify_Defaults(t *testing.T) {
	c := MustLoad(t, "")
	if want := (config.VerifyConfig{Window: sec(15 * time.Minute)}); c.Verify != want {
		t.Fatalf("verify defaults = %+v, want %+v (off)", c.Verify, want)
	}
	c = MustLoad(t, "verify: {interval: 5m}\n", "RELAY_VERIFY_WINDOW=1h")
	if want := (config.VerifyConfig{Interval: sec(5 * time.Minute), Window: sec(time.Hour)}); c.Verify != want {
		t.Fatalf("verify = %+v, want %+v", c.Verify, want)
	}
}

func TestVerify_Invalid(t *testing.T) {
	for _, c := range []struct {
		yaml string
		want []string
	}{
		{"verify: {interval: 10m, window: 5m}\n", []string{"verify.window", "shorter than verify.interval"}},
		{"verify: {interval: -1s}\n", []string{"verify.interval", "must not be negative"}},
		{"verify: {window: 0s}\n", []string{"verify.window", "greater than zero"}},
		{"sinks:\n  - {name: n8n, type: webhook, url: 'http://h/x', receiver_query: 'SELECT event_key FROM t'}\n", []string{"sinks[0].receiver_query", "$1"}},
		{"sinks:\n  - {name: nats, type: nats, receiver_query: 'SELECT $1'}\n", []string{"sinks[0].receiver_query", "not valid for a nats sink"}},
	} {
		_, err := load(t, c.yaml)
		requireErrorContains(t, err, c.want...)
	}
	MustLoad(t, "sinks:\n  - {name: n8n, type: webhook, url: 'http://h/x', receiver_query: 'SELECT event_key FROM t WHERE event_key = ANY($1)'}\n")
}
