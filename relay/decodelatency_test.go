package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/relay"
)

// decodeLatencyCount returns how many observations
// outbox_relay_decode_latency_seconds holds.
func decodeLatencyCount(t *testing.T) uint64 {
	t.Helper()
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "outbox_relay_decode_latency_seconds" {
			return mf.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	t.Fatal("outbox_relay_decode_latency_seconds is not registered")
	return 0
}

// TestDecodeLatency_CountsEachEventOnce: decode_latency_seconds counts an
// event when it is first decoded in this process. After a PostgreSQL
// restart the slot sends again what it had not confirmed, with commit
// times long past; those events are not counted again (they made the
// metric's tail a restart's downtime). A transaction submitted in several
// batches is counted whole.
func TestDecodeLatency_CountsEachEventOnce(t *testing.T) {
	e := startEngine(t, relay.EngineConfig{Routes: []relay.Route{{Sink: newFakeSink("a", nil)}}, Stream: newFakeStore()})
	c := e.Stream()
	ctx := context.Background()
	// Positions above any other test's: what was counted is the process's.
	base := relay.LSN(1 << 60)
	if err := c.Restart(ctx, 0); err != nil {
		t.Fatal(err)
	}
	txn := func(lsn relay.LSN, ids ...int64) []*relay.Event {
		var out []*relay.Event
		for _, id := range ids {
			ev := event(id, "A")
			ev.CommitLSN, ev.CommitTime = lsn, time.Now().Add(-time.Second)
			out = append(out, ev)
		}
		return out
	}
	before := decodeLatencyCount(t)
	submit(t, c, txn(base+100, 1, 2)...)
	c.Commit(base + 101)
	submit(t, c, txn(base+200, 3)...) // one transaction in two batches
	submit(t, c, txn(base+200, 4)...)
	c.Commit(base + 201)
	if got := decodeLatencyCount(t) - before; got != 4 {
		t.Fatalf("first decoding: %d observations, want 4", got)
	}
	waitSettledAt(t, c, base+201)

	// PostgreSQL restarted: a new session, and the slot sends both again.
	if err := c.Restart(ctx, base+300); err != nil {
		t.Fatal(err)
	}
	submit(t, c, txn(base+100, 1, 2)...)
	c.Commit(base + 101)
	submit(t, c, txn(base+200, 3)...)
	submit(t, c, txn(base+200, 4)...)
	c.Commit(base + 201)
	if got := decodeLatencyCount(t) - before; got != 4 {
		t.Fatalf("after the events were sent again: %d observations, want still 4", got)
	}
	submit(t, c, txn(base+400, 5)...)
	c.Commit(base + 401)
	if got := decodeLatencyCount(t) - before; got != 5 {
		t.Fatalf("a new event after the restart: %d observations, want 5", got)
	}
}
