package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
)

func TestReplayCommand(t *testing.T) {
	d := newOpsDB(t)
	done := d.insert(t, "k-done", "order.created", "done", "")
	failed := d.insert(t, "k-failed", "order.created", "failed", "HTTP 422")
	pending := d.insert(t, "k-pending", "order.created", "pending", "")
	d.ledger(t, "k-done", "nats", "delivered")
	d.ledger(t, "k-done", "n8n", "delivered")
	// In flight: delivered to n8n, not yet to nats. (A pending row the
	// ledger shows delivered to every sink is done, its status not marked
	// yet, and replay takes it.)
	d.ledger(t, "k-pending", "n8n", "delivered")

	// --sink nats: only nats's ledger row goes, so the claim path
	// re-delivers to NATS only; n8n stays delivered and is skipped.
	code, out, errOut := executeWithInput(t, "yes\n", "replay", "--config", d.config,
		"--ids", fmt.Sprintf("%d,%d", done, pending), "--sink", "nats")
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	if !strings.Contains(errOut, "Replay 1 events to sink nats? [y/N]") || !strings.Contains(out, "replayed 1 events, cleared 1 ledger rows") ||
		!strings.Contains(out, "1 matching events are pending or processing: they are being delivered and were left alone") {
		t.Fatalf("output:\n%s%s", out, errOut)
	}
	if s, n := d.status(t, done); s != "pending" || n != 1 {
		t.Fatalf("replayed row: status %s, replays %d", s, n)
	}
	if got := d.ledgerStates(t, "k-done"); got != "n8n=delivered" {
		t.Fatalf("ledger after replay to nats: %q", got)
	}
	if got := d.ledgerStates(t, "k-pending"); got != "n8n=delivered" {
		t.Fatalf("ledger of a pending row changed: %q", got)
	}

	// --since, every sink, no prompt: the done row (now pending) is skipped,
	// the failed one replayed.
	code, out, errOut = execute(t, "replay", "--config", d.config, "--since", "1h", "--yes")
	if code != exitOK || !strings.Contains(out, "replayed 1 events\n") {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	if s, n := d.status(t, failed); s != "pending" || n != 1 {
		t.Fatalf("failed row after replay: %s, replays %d", s, n)
	}

	// Replayed again once settled: the count goes up.
	d.exec(t, "UPDATE integration_outbox SET status = 'done' WHERE id = $1", done)
	if code, out, errOut := execute(t, "replay", "--config", d.config, "--ids", fmt.Sprint(done), "--yes"); code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	if _, n := d.status(t, done); n != 2 {
		t.Fatalf("replays = %d, want 2", n)
	}
}

func TestReplayCommand_Usage(t *testing.T) {
	d := newOpsDB(t)
	for _, tt := range []struct {
		args []string
		msg  string
	}{
		{[]string{"replay"}, "say what to replay: --since TIME and/or --ids 1,2,3"},
		{[]string{"replay", "--ids", "1", "--sink", "kafka"}, `--sink "kafka": no such sink`},
		{[]string{"replay", "--since", "last tuesday"}, `--since "last tuesday"`},
	} {
		code, _, errOut := execute(t, append(tt.args, "--config", d.config)...)
		if code != exitUsage || !strings.Contains(errOut, tt.msg) {
			t.Errorf("%v: exit %d, stderr %q", tt.args, code, errOut)
		}
	}
	// Without a config there is no sink, unless embedded_nats adds the
	// embedded sink "nats" (as for run).
	code, out, errOut := execute(t, "replay", "--database-url", d.url, "--ids", "1", "--sink", "nats", "--yes")
	if code != exitUsage || !strings.Contains(errOut, `--sink "nats": no such sink (configured: none)`) {
		t.Fatalf("no sinks: exit %d\n%s%s", code, out, errOut)
	}
	t.Setenv("RELAY_EMBEDDED_NATS", "true")
	var stdout, stderr bytes.Buffer
	code = Execute(context.Background(), []string{"replay", "--database-url", d.url, "--ids", "1", "--sink", "nats", "--yes"}, &stdout, &stderr)
	if code != exitOK || !strings.Contains(stdout.String(), "no events to replay") {
		t.Fatalf("embedded_nats: exit %d\n%s%s", code, stdout.String(), stderr.String())
	}
}
