package claim_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Poll mode on a server without logical decoding: every event reaches
// every sink exactly once, the rows end done and the ledger delivered, and
// the body is the stream's envelope byte for byte.
func TestPollModeDeliversEveryEventOnceToEverySink(t *testing.T) {
	cluster := pgtest.NewCluster(t, pgtest.Options{WALLevel: "replica"})
	ctx := context.Background()
	if err := cluster.CreateDatabase(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	f := MustFixtureAt(t, cluster.URL("relay"))
	var walLevel string
	if err := f.pool.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil || walLevel != "replica" {
		t.Fatalf("wal_level = %q (%v), want replica", walLevel, err)
	}

	const n = 1000
	f.MustInsertMany(t, "evt", n, 100, false)
	f.MustInsert(t, event{Key: "odd", NullType: true, Payload: `{"b": 1.50, "a": ["é", "\"q\""], "c": null}`})
	// A NULL available_at is never "due"; the sweeper repairs it (in every
	// mode now, not only in poll mode).
	f.MustExec(t, `UPDATE integration_outbox SET available_at = NULL WHERE event_key = 'evt-7'`)
	a, b := newFakeSink("a", nil), newFakeSink("b", nil)
	start := time.Now()
	c := MustStart(t, f, options{Routes: []relay.Route{{Sink: a}, {Sink: b, Nudge: true}}, All: true,
		PollInterval: 100 * time.Millisecond})

	waitFor(t, 60*time.Second, "every row done", func() bool { return f.MustStatusCount(t, "done") == n+1 })
	t.Logf("%d events to 2 sinks in %s (claimed %d, delivered %d pairs)", n+1, time.Since(start).Round(time.Millisecond),
		c.Stats.Claimed.Load(), c.Engine.Stats.Delivered.Load())
	for _, s := range []*fakeSink{a, b} {
		got := s.Delivered()
		if len(got) != n+1 {
			t.Errorf("sink %s got %d distinct events, want %d", s.name, len(got), n+1)
		}
		for key, times := range got {
			if times != 1 {
				t.Errorf("sink %s got %s %d times", s.name, key, times)
			}
		}
		for _, call := range s.Calls() {
			if call.Attempt != 1 {
				t.Errorf("sink %s: %s sent with attempt %d, want 1", s.name, call.Key, call.Attempt)
			}
		}
	}
	if got := f.MustInt(t, `SELECT count(*) FROM integration_idempotency WHERE state = 'delivered'`); got != 2*(n+1) {
		t.Errorf("ledger has %d delivered pairs, want %d", got, 2*(n+1))
	}
	if got := c.Engine.Stats.Delivered.Load(); got != 2*(n+1) {
		t.Errorf("Engine.Stats.Delivered = %d, want %d", got, 2*(n+1))
	}

	// The body is the envelope of the row as the stream would decode it.
	var want relay.Event
	var created pgtype.Timestamptz
	err := f.pool.QueryRow(ctx, `SELECT id, event_key, event_type, aggregate_type, aggregate_id, payload::text, created_at
		FROM integration_outbox WHERE event_key = 'odd'`).Scan(&want.ID, &want.EventKey, &want.EventType,
		&want.AggregateType, &want.AggregateID, &want.Payload, &created)
	if err != nil {
		t.Fatal(err)
	}
	want.CreatedAt = created.Time
	for _, call := range a.Calls() {
		if call.Key == "odd" && string(call.Body) != string(want.AppendEnvelope(nil)) {
			t.Errorf("body\n got %s\nwant %s", call.Body, want.AppendEnvelope(nil))
		}
		if call.Key == "odd" {
			t.Logf("envelope: %s", call.Body)
		}
	}
	for _, call := range b.Calls() {
		if call.Key == "odd" && string(call.Body) != string(want.AppendNudge(nil)) {
			t.Errorf("nudge body\n got %s\nwant %s", call.Body, want.AppendNudge(nil))
		}
	}
}

// Replication mode: only rows diverted to the claim path are claimed; the
// stream's rows are left alone, and diverted rows keep their mark.
//
// New with the core: the sweeper makes pending rows with a NULL
// available_at due in every mode, not only in poll mode, so a diverted
// row without one is delivered, and a stream's row without one is given
// one but stays the stream's.
func TestReplicationModeClaimsOnlyDivertedRows(t *testing.T) {
	f := MustFixture(t)
	var events []event
	for i := range 20 {
		// Distinct aggregates: a stream row of the same aggregate with a
		// lower id would (rightly) hold a diverted row back.
		events = append(events, event{Key: fmt.Sprintf("k%02d", i), AggType: "order", AggID: fmt.Sprintf("%d-%d", i%3, i%2), Diverted: i%2 == 1})
	}
	f.MustInsert(t, events...)
	f.MustExec(t, `UPDATE integration_outbox SET available_at = NULL WHERE event_key IN ('k00', 'k01')`)
	a := newFakeSink("a", nil)
	MustStart(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond})

	waitFor(t, 10*time.Second, "diverted rows done", func() bool { return f.MustStatusCount(t, "done") == 10 })
	if n := f.MustInt(t, `SELECT count(*) FROM integration_outbox WHERE available_at IS NULL`); n != 0 {
		t.Errorf("%d rows still have a NULL available_at", n)
	}
	time.Sleep(300 * time.Millisecond) // a few more polls
	for key, r := range f.MustRows(t) {
		switch {
		case r.Diverted && r.Status != "done":
			t.Errorf("%s: diverted, status %s, want done", key, r.Status)
		case !r.Diverted && r.Status != "pending":
			t.Errorf("%s: the stream's row, status %s, want pending", key, r.Status)
		}
	}
	for key := range a.Delivered() {
		if !f.MustRow(t, key).Diverted {
			t.Errorf("the claim path delivered the stream's row %s", key)
		}
	}
	if got := len(a.Delivered()); got != 10 {
		t.Errorf("delivered %d rows, want 10", got)
	}
}

// A permanent error fails the row at once, with the sink and the reason in
// last_error, and releases the ledger claim.
func TestPermanentErrorFailsAtOnce(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t, event{Key: "bad", AggType: "order", AggID: "1", Diverted: true})
	a := newFakeSink("a", func(*relay.Delivery) error {
		return relay.PermanentError(fmt.Errorf("HTTP 422: payload rejected"))
	})
	c := MustStart(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond})

	waitFor(t, 10*time.Second, "row failed", func() bool { return f.MustRow(t, "bad").Status == "failed" })
	r := f.MustRow(t, "bad")
	if r.LastError == nil || *r.LastError != "sink a: permanent: HTTP 422: payload rejected" {
		t.Errorf("last_error = %v", deref(r.LastError))
	}
	if r.Attempts != 1 {
		t.Errorf("attempts = %d, want 1", r.Attempts)
	}
	if n := len(a.Calls()); n != 1 {
		t.Errorf("%d sends, want 1", n)
	}
	if _, ok := f.MustLedger(t)[relay.LedgerKey{EventKey: "bad", Action: "a"}]; ok {
		t.Error("the ledger keeps a claim for a failed send")
	}
	if c.Engine.Stats.DeadLettered.Load() != 1 {
		t.Errorf("Engine.Stats.DeadLettered = %d", c.Engine.Stats.DeadLettered.Load())
	}
}

// Transient errors up to max_attempts fail the row with the last reason.
func TestMaxAttemptsFails(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t, event{Key: "flaky", Diverted: true})
	a := newFakeSink("a", func(*relay.Delivery) error { return relay.TransientError(fmt.Errorf("HTTP 503"), 0) })
	MustStart(t, f, options{Routes: routes(a), PollInterval: 20 * time.Millisecond, MaxAttempts: 3,
		Backoff: []time.Duration{10 * time.Millisecond}})

	waitFor(t, 10*time.Second, "row failed", func() bool { return f.MustRow(t, "flaky").Status == "failed" })
	r := f.MustRow(t, "flaky")
	if r.Attempts != 3 || r.LastError == nil || *r.LastError != "max_attempts reached: sink a: transient: HTTP 503" {
		t.Errorf("attempts %d, last_error %q", r.Attempts, deref(r.LastError))
	}
	calls := a.Calls()
	if len(calls) != 3 {
		t.Fatalf("%d sends, want 3", len(calls))
	}
	for i, c := range calls {
		if c.Attempt != i+1 {
			t.Errorf("send %d carried attempt %d", i+1, c.Attempt)
		}
	}
}

// A replayed row (outbox-relay replay counts replays in the row) is sent
// with Delivery.Replay, so sinks derive a fresh idempotency id.
func TestReplayReachesTheSink(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t, event{Key: "again", Diverted: true}, event{Key: "first", Diverted: true})
	f.MustExec(t, `UPDATE integration_outbox SET replays = 2 WHERE event_key = 'again'`)
	a := newFakeSink("a", nil)
	MustStart(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond})
	waitFor(t, 10*time.Second, "rows done", func() bool { return f.MustStatusCount(t, "done") == 2 })
	for _, c := range a.Calls() {
		if want := map[string]int{"again": 2, "first": 0}[c.Key]; c.Replay != want {
			t.Errorf("%s sent with Replay %d, want %d", c.Key, c.Replay, want)
		}
	}
}

// A batch larger than the engine's room for unsettled events
// (source.batch_size above MaxUnsettled) is still delivered: the engine
// takes it in parts instead of waiting for room for all of it at once,
// which never comes.
func TestBatchLargerThanTheEngineTakes(t *testing.T) {
	f := MustFixture(t)
	const rows = 20
	f.MustInsertMany(t, "evt", rows, 0, true)
	a := newFakeSink("a", nil)
	start := time.Now()
	MustStart(t, f, options{Routes: routes(a), BatchSize: 10, MaxUnsettled: 4, PollInterval: 50 * time.Millisecond})
	waitFor(t, 10*time.Second, "every row done", func() bool { return f.MustStatusCount(t, "done") == rows })
	t.Logf("%d rows in batches of 10, 4 unsettled at most: done after %s", rows, time.Since(start).Round(time.Millisecond))
	for key, n := range a.Delivered() {
		if n != 1 {
			t.Errorf("%s delivered %d times", key, n)
		}
	}
}

func deref[T any](p *T) string {
	if p == nil {
		return "NULL"
	}
	return fmt.Sprint(*p)
}
