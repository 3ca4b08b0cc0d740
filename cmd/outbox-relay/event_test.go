package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// TestEventCommand: outbox-relay event KEY answers "what happened to this
// event?" from the database: its row, its state, each sink's routing and
// ledger row; --id and --json; an event that is not there exits 1 with a
// short line naming it, however long its key.
func TestEventCommand(t *testing.T) {
	d := newOpsDB(t) // n8n takes order.*, nats every event
	d.insert(t, "order-122", "order.created", "pending", "")
	id := d.insert(t, "order-123", "order.created", "pending", "sink n8n: HTTP 503: busy\n\x1b[2Jsecond line")
	d.exec(t, `UPDATE integration_outbox SET handoff_at = now(), available_at = now() + interval '1 minute', replays = 1 WHERE id = $1`, id)
	d.ledger(t, "order-123", "nats", "delivered")
	d.exec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, detail) VALUES ('order-123', 'n8n', 'unknown', 2, 'timeout')`)

	code, out, errOut := execute(t, "event", "order-123", "--config", d.config)
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	t.Logf("event:\n%s", out)
	for _, want := range []string{
		fmt.Sprintf(`event %d, key "order-123"`, id),
		"state:         at the claim path: due in ",
		"type:          order.created",
		"aggregate:     order / A1",
		`waits behind:  event 1, key "order-122" (pending)`,
		"attempts:      3\n",
		"replays:       1 (the sinks' idempotency ids end in ~r1)",
		`last error:    sink n8n: HTTP 503: busy\n\x1b[2Jsecond line`,
		"payload:       2 bytes",
		"SINK  ROUTED  DELIVERED  LEDGER     ATTEMPTS",
		"n8n   yes     no         unknown    2",
		"nats  yes     yes        delivered  1         delivered ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if strings.Contains(out, "\x1b") {
		t.Error("output holds a raw escape character from last_error")
	}

	code, out, _ = execute(t, "event", "--id", fmt.Sprint(id), "--json", "--config", d.config)
	var r admin.EventReport
	if err := json.Unmarshal([]byte(out), &r); code != exitOK || err != nil || r.EventKey != "order-123" || r.State != admin.EventAtClaimPath ||
		len(r.Sinks) != 2 || !r.Sinks[1].Delivered || r.Sinks[0].Delivered {
		t.Fatalf("--id --json: exit %d, %v\n%s", code, err, out)
	}

	// A NULL type and aggregate route only to "*".
	bare := d.insert(t, "bare", "x", "pending", "")
	d.exec(t, `UPDATE integration_outbox SET event_type = NULL, aggregate_type = NULL, aggregate_id = NULL, payload = NULL WHERE id = $1`, bare)
	code, out, _ = execute(t, "event", "bare", "--config", d.config)
	for _, want := range []string{"type:        -", "aggregate:   - / - (unordered", "payload:     NULL", "n8n   no ", "nats  yes"} {
		if code != exitOK || !strings.Contains(out, want) {
			t.Errorf("bare row: exit %d, output lacks %q:\n%s", code, want, out)
		}
	}

	for name, key := range map[string]string{"unknown": "order-404", "long": strings.Repeat("k", 100_000), "control": "a\x1b[2Jb"} {
		code, out, errOut = execute(t, "event", key, "--config", d.config)
		if code != exitFailure || out != "" || !strings.Contains(errOut, "no event with key") || len(errOut) > 300 || strings.Contains(errOut, "\x1b") {
			t.Errorf("%s key: exit %d, stdout %q, stderr %q", name, code, out, excerpt(errOut, 200))
		}
	}
	for _, args := range [][]string{{"event"}, {"event", "a", "b"}, {"event", "a", "--id", "1"}, {"event", ""}} {
		if code, _, errOut := execute(t, append(args, "--config", d.config)...); code != exitUsage {
			t.Errorf("%q: exit %d, want %d (%s)", args, code, exitUsage, errOut)
		}
	}
}
