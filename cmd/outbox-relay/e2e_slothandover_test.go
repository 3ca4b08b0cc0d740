package main

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestRelay_SlotDroppedWhileDeliveringRepeatsNothing: the slot is dropped
// while the stream still has events in flight and queued for a slow (but
// healthy) webhook. No outcome is ever unknown, so no event may reach the
// webhook twice (docs/guarantees.md, "at most one delivery"): the new slot's hand-over must not give the claim
// path rows the engine is still delivering. Found by the chaos suite's
// "a repeat after a 2xx only follows a crash" check.
func TestRelay_SlotDroppedWhileDeliveringRepeatsNothing(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.hook.setReply(func(delivery) int { time.Sleep(100 * time.Millisecond); return 204 })
	s.startInProcess(t, s.configFileWith(t, "", "source: {poll_interval: 200ms}"))
	s.waitSlot(t)

	// 8 requests in flight at 100 ms each: 400 events take about 5 s, so
	// most are queued in the engine when the slot goes.
	s.publishWriters(t, 4, 100, 10, "inflight")
	ctx := context.Background()
	eventually(t, 10*time.Second, "the first deliveries", func() bool { return len(s.hook.deliveries()) >= 20 })
	eventually(t, 10*time.Second, "the slot dropped", func() bool {
		s.pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active`)
		_, err := s.pool.Exec(ctx, `SELECT pg_drop_replication_slot('outbox_relay')`)
		return err == nil
	})
	inFlight := 400 - len(s.hook.deliveries())
	t.Logf("slot dropped with about %d events not yet delivered to the webhook", inFlight)
	if inFlight < 100 {
		t.Fatalf("only %d events left when the slot was dropped: the test did not catch the engine busy", inFlight)
	}

	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 90*time.Second, keys)
	time.Sleep(time.Second) // a late duplicate from the claim path
	checkOrder(t, "webhook", s.hook.deliveries())
	checkOrder(t, "nats", streamMessages(t, s.nats.URL()))
	repeats := 0
	for key, copies := range byKey(s.hook.deliveries()) {
		if len(copies) > 1 {
			repeats++
			if repeats <= 5 {
				t.Errorf("%s reached the webhook %d times, with no unknown outcome", key, len(copies))
			}
		}
	}
	if repeats > 0 {
		t.Fatalf("%d of %d events reached the webhook more than once after the slot was dropped", repeats, len(keys))
	}
}
