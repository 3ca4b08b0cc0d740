package main

// The seams between sessions, terms, modes and processes: at each, the
// relay first writes what it delivered (one delivered ledger row per event
// and sink, docs/operations.md, "what the relay writes back"), then lets the
// next session, path or process take over. Each test here reproduces a
// repeat that an in-memory record of delivery caused at one of them.

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestSeam_GracefulStopRepeatsNothing: two events are in flight at the
// webhook (answers after 400 and 420 ms) when the relay is told to stop.
// It finishes them and records them before it exits, so the next start,
// which streams them again from the slot, sends neither a second time.
// Before, the second 2xx arrived during the drain and its record waited in
// memory: the next start sent it again.
func TestSeam_GracefulStopRepeatsNothing(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	var arrived atomic.Int32
	s.hook.setReply(func(d delivery) int {
		switch d.EventKey {
		case "stop-1":
			arrived.Add(1)
			time.Sleep(400 * time.Millisecond)
		case "stop-2":
			arrived.Add(1)
			time.Sleep(420 * time.Millisecond)
		}
		return 204
	})
	cfg := s.configFile(t, "")
	stop := s.startInProcess(t, cfg)
	s.waitStreaming(t)
	ctx := context.Background()
	if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		VALUES ('order.placed', 'order', 'a', 'stop-1', '{}'), ('order.placed', 'order', 'b', 'stop-2', '{}')`); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "both events in flight at the webhook", func() bool { return arrived.Load() == 2 })
	stop() // SIGTERM: stop taking, finish what is in flight, record it

	for _, key := range []string{"stop-1", "stop-2"} {
		if n := s.scalar(t, `SELECT count(*) FROM integration_idempotency WHERE event_key = $1 AND state = 'delivered'`, key); n != 2 {
			t.Errorf("%s: %d delivered ledger rows after the stop, want 2 (nats and hook)", key, n)
		}
	}
	s.startInProcess(t, cfg)
	s.waitStreaming(t)
	if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		VALUES ('order.placed', 'order', 'c', 'after-stop', '{}')`); err != nil {
		t.Fatal(err)
	}
	s.waitDelivered(t, "after", 1, 30*time.Second)
	// A repeat of a stop- event would have arrived before the later
	// event; its answer takes 400 ms.
	time.Sleep(time.Second)
	if n := arrived.Load(); n != 2 {
		t.Errorf("the two events arrived %d times at the webhook, want 2", n)
	}
	for key, ds := range byKey(s.hook.deliveries()) {
		if strings.HasPrefix(key, "stop-") && len(ds) != 1 {
			t.Errorf("%s reached the webhook %d times across a graceful stop, want once", key, len(ds))
		}
	}
	s.waitDone(t, "event_key LIKE 'stop-%'", 2)
}

// TestStatus_CountsTheStreamsDeliveries: after events the stream delivered,
// status counts them per sink from the ledger — the record of delivery on
// both paths. Before, the stream wrote no ledger row for them and status
// said "delivered (1h): n8n 0, nats 0" after 22 streamed events.
func TestStatus_CountsTheStreamsDeliveries(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfg := s.configFile(t, "")
	s.startInProcess(t, cfg)
	s.waitStreaming(t)
	if _, err := s.pool.Exec(context.Background(), `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'order.placed', 'order', 'a' || g, 'streamed-' || g, '{}' FROM generate_series(1, 22) g`); err != nil {
		t.Fatal(err)
	}
	s.waitDelivered(t, "streamed", 22, 30*time.Second)
	s.waitDone(t, "event_key LIKE 'streamed-%'", 22)
	code, out, errOut := execute(t, "status", "--config", cfg)
	if code != exitOK {
		t.Fatalf("status: exit %d\n%s%s", code, out, errOut)
	}
	if !strings.Contains(out, "hook 22, nats 22") {
		t.Fatalf("status does not count the stream's 22 deliveries per sink:\n%s", out)
	}
}
