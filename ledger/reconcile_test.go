package ledger_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
)

// Reconcile marks for the claim path exactly the rows still pending, not
// diverted, and created more than older-than ago — whatever the ledger
// shows (the claim path skips delivered pairs) — and is safe to repeat;
// older-than 0 is refused. Before it, the alarm's query (Stuck) counts
// those rows and the age of the oldest; after it, none.
func TestReconcile(t *testing.T) {
	db := mustClaimDB(t)
	ctx := context.Background()
	for _, r := range []struct {
		key, status string
		diverted    bool
		age         time.Duration
	}{
		{"old1", "pending", false, time.Hour},
		{"old2", "pending", false, time.Hour},
		{"old-delivered", "pending", false, time.Hour},
		{"old-done", "done", false, time.Hour},
		{"old-failed", "failed", false, time.Hour},
		{"old-marked", "pending", true, time.Hour},
		{"new", "pending", false, time.Minute},
	} {
		db.exec(t, `
			INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, handoff_at,
			                                created_at, available_at)
			VALUES ('order.placed', 'order', 'A', $1, '{}', $2, CASE WHEN $3 THEN now() END,
			        now() - $4::bigint * interval '1 millisecond', now() - $4::bigint * interval '1 millisecond')`,
			r.key, r.status, r.diverted, r.age.Milliseconds())
	}
	db.exec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		VALUES ('old-delivered', 'a', 'delivered', 1, now())`)

	stuck, oldest, err := db.store.Stuck(ctx, 10*time.Minute)
	if err != nil || stuck != 3 || oldest < time.Hour || oldest > time.Hour+time.Minute {
		t.Errorf("Stuck = %d rows, oldest %s, %v; want 3, about 1h", stuck, oldest, err)
	}

	if _, err := db.store.Reconcile(ctx, 0); err == nil {
		t.Error("Reconcile with older-than 0: no error")
	}
	n, err := db.store.Reconcile(ctx, 10*time.Minute)
	if err != nil || n != 3 {
		t.Fatalf("Reconcile = %d, %v; want 3 rows marked", n, err)
	}
	rows, err := db.pool.Query(ctx, `SELECT event_key, handoff_at IS NOT NULL, status FROM integration_outbox`)
	if err != nil {
		t.Fatal(err)
	}
	marked := map[string]bool{}
	status := map[string]string{}
	for rows.Next() {
		var key, st string
		var diverted bool
		if err := rows.Scan(&key, &diverted, &st); err != nil {
			t.Fatal(err)
		}
		marked[key], status[key] = diverted, st
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]bool{"old1": true, "old2": true, "old-delivered": true, "old-marked": true,
		"new": false, "old-done": false, "old-failed": false} {
		if marked[key] != want {
			t.Errorf("%s: diverted %v, want %v", key, marked[key], want)
		}
	}
	for key, st := range status {
		if want := map[string]string{"old-done": "done", "old-failed": "failed"}[key]; want != "" && st != want || want == "" && st != "pending" {
			t.Errorf("%s: status %s changed by Reconcile", key, st)
		}
	}
	if n, err := db.store.Reconcile(ctx, 10*time.Minute); err != nil || n != 0 {
		t.Errorf("second Reconcile = %d, %v; want 0", n, err)
	}
	if stuck, oldest, err := db.store.Stuck(ctx, 10*time.Minute); err != nil || stuck != 0 || oldest != 0 {
		t.Errorf("Stuck after Reconcile = %d rows, oldest %s, %v; want none", stuck, oldest, err)
	}
}

// TestReconcileRefusesWhileAHandOverIsUnfinished: between a slot's
// BeginSlot and its recorded hand-over, the relay delivers the rows
// pending before the slot itself; Reconcile refuses to take any
// (ledger.ErrHandOverUnfinished, naming the slot) and marks nothing. Once
// the hand-over is recorded it marks them.
func TestReconcileRefusesWhileAHandOverIsUnfinished(t *testing.T) {
	db := mustClaimDB(t)
	ctx := context.Background()
	db.exec(t, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, created_at)
		VALUES ('order.placed', 'order', 'A', 'old', '{}', now() - interval '1 hour')`)
	if err := db.store.BeginSlot(ctx, "relay_slot"); err != nil {
		t.Fatal(err)
	}
	n, err := db.store.Reconcile(ctx, 10*time.Minute)
	if !errors.Is(err, ledger.ErrHandOverUnfinished) || !strings.Contains(err.Error(), "relay_slot") || n != 0 {
		t.Fatalf("Reconcile during a hand-over = %d, %v; want ErrHandOverUnfinished naming relay_slot", n, err)
	}
	if marked := db.exec(t, `SELECT FROM integration_outbox WHERE handoff_at IS NOT NULL`); marked != 0 {
		t.Fatalf("%d rows diverted by a refused Reconcile", marked)
	}
	db.exec(t, `UPDATE relay_checkpoint SET handover_lsn = '0/1' WHERE slot_name = 'relay_slot'`) // the hand-over recorded
	if n, err := db.store.Reconcile(ctx, 10*time.Minute); err != nil || n != 1 {
		t.Errorf("Reconcile after the hand-over = %d, %v; want 1 row marked", n, err)
	}
}
