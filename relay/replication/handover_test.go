package replication_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// TestSlotRecreatedOnlyAfterConsumerSettled: when the slot is dropped while
// the consumer still holds an event it is delivering, the new slot is
// created (and its pending rows handed to the claim path) only after
// WaitSettled returns, so the claim path does not get that row too and send
// it a second time. Here WaitSettled stands for the engine: it finishes the
// delivery, which marks the row done.
func TestSlotRecreatedOnlyAfterConsumerSettled(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{holdEvents: true}
	claim := &claimRecorder{url: e.url}
	cfg := e.config(t, c, &fakeCheckpoint{}, claim)
	settler := mustConnect(t, e.url) // used by the source's goroutine only
	var waits atomic.Int32
	cfg.WaitSettled = func(ctx context.Context) error {
		waits.Add(1)
		_, err := settler.Exec(ctx, `UPDATE integration_outbox SET status = 'done' WHERE event_key = 'inflight'`)
		return err
	}
	start(t, cfg)
	waitStreaming(t, c, 1)
	e.insert(t, "inflight")
	waitFor(t, 10*time.Second, "the event", func() bool { return c.commitOf("inflight") != 0 })

	ctx := context.Background()
	waitFor(t, 10*time.Second, "the slot dropped", func() bool {
		_, _ = e.conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active`, e.slot)
		_, err := e.conn.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, e.slot)
		return err == nil
	})
	waitStreaming(t, c, 2)
	if snapshots, _ := claim.calls(); len(snapshots) != 2 || waits.Load() < 2 {
		t.Fatalf("%d hand-overs, %d waits: want the slot recreated, after a wait", len(snapshots), waits.Load())
	}
	var handedOff bool
	if err := e.conn.QueryRow(ctx, `SELECT handoff_at IS NOT NULL FROM integration_outbox WHERE event_key = 'inflight'`).Scan(&handedOff); err != nil {
		t.Fatal(err)
	}
	if handedOff {
		t.Fatal("the new slot's hand-over gave the claim path a row the consumer was still delivering")
	}
}
