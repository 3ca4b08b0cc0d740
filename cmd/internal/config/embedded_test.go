package config_test

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

// TestEffectiveSinks_EmbeddedNATSIsAChoice: without embedded_nats a
// configuration without sinks has none (run refuses it); with it, a sink
// named nats on the embedded server follows the configured ones, from the
// file or the environment; a configured sink of that name conflicts.
func TestEffectiveSinks_EmbeddedNATSIsAChoice(t *testing.T) {
	if sinks := MustLoad(t, "").EffectiveSinks(); len(sinks) != 0 {
		t.Fatalf("no configuration: %d sinks, want none (the embedded server is never a default)", len(sinks))
	}

	c := MustLoad(t, "embedded_nats: true\nsinks:\n  - {name: n8n, type: webhook, url: 'http://127.0.0.1:5678/webhook/outbox'}\n")
	sinks := c.EffectiveSinks()
	if len(sinks) != 2 || sinks[0].Name != "n8n" || sinks[1].Name != config.EmbeddedNATSSink || sinks[1].Type != config.SinkNATS || sinks[1].URL != "" {
		t.Fatalf("embedded_nats: sinks %+v, want n8n then an embedded nats sink", sinks)
	}
	want := config.DefaultSink(config.SinkNATS)
	if sinks[1].NATS.Stream.Name != want.NATS.Stream.Name || sinks[1].NATS.Subject != want.NATS.Subject {
		t.Errorf("the embedded sink does not have the defaults: %+v", sinks[1])
	}
	if len(c.Sinks) != 1 {
		t.Errorf("EffectiveSinks changed Sinks: %+v", c.Sinks)
	}

	if sinks := MustLoad(t, "", "RELAY_EMBEDDED_NATS=true").EffectiveSinks(); len(sinks) != 1 || sinks[0].Name != "nats" {
		t.Errorf("RELAY_EMBEDDED_NATS=true: sinks %+v", sinks)
	}

	_, err := load(t, "embedded_nats: true\nsinks:\n  - {name: nats, type: nats, url: 'nats://127.0.0.1:4222'}\n")
	requireErrorContains(t, err, "embedded_nats", `"nats"`, "sinks[0]")
}
