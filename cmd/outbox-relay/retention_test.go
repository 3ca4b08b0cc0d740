package main

import (
	"context"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

func TestRunRetention(t *testing.T) {
	d := newOpsDB(t)
	old := d.insert(t, "old", "order.created", "done", "")
	oldFailed := d.insert(t, "old-failed", "order.created", "failed", "x")
	d.exec(t, "UPDATE integration_outbox SET created_at = now() - interval '30 days', processed_at = now() - interval '8 days'")
	cfg, err := config.Load(config.Options{Path: d.config, Environ: []string{}})
	if err != nil {
		t.Fatal(err)
	}
	tables := cfg.Tables()

	// Disabled: returns at once, prunes nothing.
	cfg.Retention.Enabled = false
	if err := runRetention(context.Background(), d.pool, nil, tables, cfg, zerolog.Nop()); err != nil {
		t.Fatal(err)
	}
	if s, _ := d.status(t, old); s != "done" {
		t.Fatal("disabled retention pruned a row")
	}

	// Enabled (the default): the first pass prunes the old done row only.
	cfg.Retention.Enabled = true
	cfg.Retention.Interval = config.Duration(time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- runRetention(ctx, d.pool, nil, tables, cfg, zerolog.Nop()) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		d.pool.QueryRow(ctx, "SELECT count(*) FROM integration_outbox WHERE id = $1", old).Scan(&n)
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the old done row was not pruned")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("runRetention after cancel: %v", err)
	}
	if s, _ := d.status(t, oldFailed); s != "failed" {
		t.Fatal("retention touched a failed row")
	}
}

// TestExampleConfigRetention keeps the retention section of
// deploy/relay.example.yaml equal to the defaults it documents.
func TestExampleConfigRetention(t *testing.T) {
	cfg, err := config.Load(config.Options{Path: "../../deploy/relay.example.yaml", Environ: []string{}, LookupEnv: func(string) (string, bool) { return "", false }})
	if err != nil {
		t.Fatal(err)
	}
	if def := config.Default(); cfg.Retention != def.Retention {
		t.Fatalf("example retention %+v, defaults %+v", cfg.Retention, def.Retention)
	}
}
