package main

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

// TestExampleConfigLoads keeps deploy/relay.example.yaml, the documented
// list of every key, valid and equal to the defaults it claims.
func TestExampleConfigLoads(t *testing.T) {
	cfg, err := config.Load(config.Options{Path: "../../deploy/relay.example.yaml", Environ: []string{}, LookupEnv: func(string) (string, bool) { return "", false }})
	if err != nil {
		t.Fatalf("example config: %v", err)
	}
	def := config.Default()
	if cfg.Source != def.Source || cfg.HTTP != def.HTTP || cfg.Log != def.Log || cfg.Migrate != def.Migrate || cfg.ShutdownTimeout != def.ShutdownTimeout {
		t.Fatalf("the example's values differ from the defaults:\n%+v\n%+v", cfg.Source, def.Source)
	}
	if len(cfg.Sinks) != 2 || cfg.Sinks[0].Webhook.Concurrency != 8 || cfg.Sinks[1].NATS.MaxPending != 4096 {
		t.Fatalf("sinks: %+v", cfg.Sinks)
	}
}
