package claim_test

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Per-aggregate order: with a sink failing a fifth of first attempts, each
// aggregate's first successful deliveries still arrive in id order, at the
// flaky sink and at a healthy one.
func TestOrderingPerAggregate(t *testing.T) {
	f := MustFixture(t)
	const aggregates, perAggregate = 100, 20
	// Interleaved: consecutive ids belong to different aggregates.
	f.MustInsertMany(t, "evt", aggregates*perAggregate, aggregates, true)

	type arrival struct {
		agg string
		id  int64
	}
	var (
		mu       sync.Mutex
		tried    = map[string]bool{}
		arrivals = map[string][]arrival{} // by sink
		failed   int
	)
	record := func(sink string, d *relay.Delivery) {
		arrivals[sink] = append(arrivals[sink], arrival{agg: *d.Event.AggregateID, id: d.Event.ID})
	}
	flaky := newFakeSink("flaky", func(d *relay.Delivery) error {
		time.Sleep(time.Duration(rand.N(2000)) * time.Microsecond) // finish out of order
		mu.Lock()
		defer mu.Unlock()
		if !tried[d.Event.EventKey] {
			tried[d.Event.EventKey] = true
			if rand.N(5) == 0 {
				failed++
				return relay.TransientError(errors.New("HTTP 503"), 0)
			}
		}
		record("flaky", d)
		return nil
	})
	steady := newFakeSink("steady", func(d *relay.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		record("steady", d)
		return nil
	})
	start := time.Now()
	MustStart(t, f, options{Routes: routes(flaky, steady), PollInterval: 20 * time.Millisecond,
		Backoff: []time.Duration{30 * time.Millisecond}})
	waitFor(t, 120*time.Second, "every row done", func() bool {
		return f.MustStatusCount(t, "done") == aggregates*perAggregate
	})
	t.Logf("%d events over %d aggregates in %s; %d first attempts failed", aggregates*perAggregate, aggregates,
		time.Since(start).Round(time.Millisecond), failed)

	mu.Lock()
	defer mu.Unlock()
	for sink, list := range arrivals {
		if len(list) != aggregates*perAggregate {
			t.Errorf("sink %s: %d first successful deliveries, want %d", sink, len(list), aggregates*perAggregate)
		}
		last := map[string]int64{}
		for _, a := range list {
			if a.id <= last[a.agg] {
				t.Errorf("sink %s: aggregate %s: id %d delivered after id %d", sink, a.agg, a.id, last[a.agg])
			}
			last[a.agg] = a.id
		}
	}
	if failed == 0 {
		t.Error("no first attempt failed; the test proves nothing")
	}
}

// A failed row does not block its aggregate; a held one does, and so does
// one still pending (here: the stream's, not delivered yet).
func TestFailedRowDoesNotBlockHeldRowDoes(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "a1", AggType: "order", AggID: "A", Status: "failed", Diverted: true},
		event{Key: "a2", AggType: "order", AggID: "A", Diverted: true},
		event{Key: "b1", AggType: "order", AggID: "B", Status: "held", Diverted: true},
		event{Key: "b2", AggType: "order", AggID: "B", Diverted: true},
		event{Key: "c1", AggType: "order", AggID: "C"},
		event{Key: "c2", AggType: "order", AggID: "C", Diverted: true},
		event{Key: "d1", AggType: "order", AggID: "D", Status: "done", Diverted: true},
		event{Key: "d2", AggType: "order", AggID: "D", Diverted: true},
	)
	a := newFakeSink("a", nil)
	MustStart(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond})
	waitFor(t, 10*time.Second, "a2 and d2 done", func() bool {
		return f.MustRow(t, "a2").Status == "done" && f.MustRow(t, "d2").Status == "done"
	})
	time.Sleep(500 * time.Millisecond)
	for _, key := range []string{"b2", "c2"} {
		if r := f.MustRow(t, key); r.Status != "pending" {
			t.Errorf("%s: status %s, want pending behind its aggregate's earlier row", key, r.Status)
		}
	}
	if got := a.Delivered(); len(got) != 2 {
		t.Errorf("delivered %v, want a2 and d2 only", got)
	}
}

// ordering: none claims a row whatever its aggregate's earlier rows are.
func TestUnorderedIgnoresAggregates(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "b1", AggType: "order", AggID: "B", Status: "held", Diverted: true},
		event{Key: "b2", AggType: "order", AggID: "B", Diverted: true},
		event{Key: "c1", AggType: "order", AggID: "C"},
		event{Key: "c2", AggType: "order", AggID: "C", Diverted: true},
	)
	a := newFakeSink("a", nil)
	MustStart(t, f, options{Routes: routes(a), Unordered: true, PollInterval: 50 * time.Millisecond})
	waitFor(t, 10*time.Second, "b2 and c2 done", func() bool {
		rows := f.MustRows(t)
		return rows["b2"].Status == "done" && rows["c2"].Status == "done"
	})
}

// TestOrderingCheckReadsTheStatus: the ordering check reads a lower row's
// status alone (docs/schema.md, "A row's states"): done, failed and
// discarded rows never hold their aggregate's later rows back; a pending
// row the stream owns does, even when the ledger shows it delivered to
// every sink (an earlier version left its status pending: reconcile hands
// it to the claim path, which settles it), and so does a held one.
func TestOrderingCheckReadsTheStatus(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "a1", AggType: "order", AggID: "A", Status: "done"},
		event{Key: "a2", AggType: "order", AggID: "A", Diverted: true},
		event{Key: "b1", AggType: "order", AggID: "B"},
		event{Key: "b2", AggType: "order", AggID: "B", Diverted: true},
		event{Key: "c1", AggType: "order", AggID: "C", Status: "discarded"},
		event{Key: "c2", AggType: "order", AggID: "C", Diverted: true},
		event{Key: "d1", AggType: "order", AggID: "D", Status: "failed"},
		event{Key: "d2", AggType: "order", AggID: "D", Diverted: true},
		event{Key: "e1", AggType: "order", AggID: "E", Status: "held"},
		event{Key: "e2", AggType: "order", AggID: "E", Diverted: true},
	)
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		VALUES ('b1', 'all', 'delivered', 1, now())`)
	all := newFakeSink("all", nil)
	MustStart(t, f, options{PollInterval: 50 * time.Millisecond, Routes: []relay.Route{{Sink: all}}})
	waitFor(t, 10*time.Second, "a2, c2 and d2 done", func() bool {
		rows := f.MustRows(t)
		return rows["a2"].Status == "done" && rows["c2"].Status == "done" && rows["d2"].Status == "done"
	})
	time.Sleep(500 * time.Millisecond)
	rows := f.MustRows(t)
	for _, key := range []string{"b2", "e2"} {
		if rows[key].Status != "pending" {
			t.Errorf("%s: status %s, want pending behind an unsettled row", key, rows[key].Status)
		}
	}
	if rows["b1"].Status != "pending" || rows["b1"].Diverted {
		t.Errorf("b1: %+v, want the stream's row left pending", rows["b1"])
	}
}
