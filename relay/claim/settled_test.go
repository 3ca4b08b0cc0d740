package claim_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The stream delivers an aggregate's events itself again once the claim
// path has settled the aggregate's last diverted row — not before, and
// not while a held row remains.
//
// The claim path used to tell the engine through a callback
// (OnAggregateSettled, with the DivertSeq read before its check); the engine
// now does it itself after each claim-path settlement, so the test watches
// what the stream does with the aggregate's next event: diverted (still
// diverted) or delivered (no longer). That the divert sequence number is
// read before the table is checked is the engine's own business now and is
// not visible from here.
func TestOnAggregateSettledAfterLastDivertedRow(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "a1", AggType: "order", AggID: "A", Diverted: true},
		event{Key: "a2", AggType: "order", AggID: "A", Diverted: true},
		event{Key: "a3", AggType: "order", AggID: "A", Diverted: true},
		event{Key: "b1", AggType: "order", AggID: "B", Diverted: true},
		event{Key: "b2", AggType: "order", AggID: "B", Status: "held", Diverted: true},
		event{Key: "c1", AggType: "order", AggID: "C", Diverted: true},
		event{Key: "c2", AggType: "order", AggID: "C"}, // the stream's
		event{Key: "n1", Diverted: true},               // no aggregate
	)
	var failedOnce atomic.Bool
	a := newFakeSink("a", func(d *relay.Delivery) error {
		if d.Event.EventKey == "a3" && failedOnce.CompareAndSwap(false, true) {
			return relay.TransientError(errors.New("HTTP 503"), 0)
		}
		return nil
	})
	// The engine starts with A, B and C diverted (the table shows their
	// diverted or held rows).
	r := MustStart(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond,
		Backoff: []time.Duration{time.Second}})

	// Not before: while a3 waits for its retry, A's new event follows it.
	waitFor(t, 10*time.Second, "a3 back to pending after its failure", func() bool {
		row := f.MustRow(t, "a3")
		return row.Status == "pending" && row.Attempts == 1
	})
	r.MustStream(t, f, "A", "a-mid")
	waitFor(t, 5*time.Second, "a-mid diverted", func() bool { return f.MustRow(t, "a-mid").Diverted })

	waitFor(t, 10*time.Second, "a3, a-mid, b1, c1 and n1 done", func() bool {
		rows := f.MustRows(t)
		return rows["a3"].Status == "done" && rows["a-mid"].Status == "done" && rows["b1"].Status == "done" &&
			rows["c1"].Status == "done" && rows["n1"].Status == "done"
	})
	if sent := a.Delivered(); sent["a-mid"] != 1 || sent["a3"] != 1 {
		t.Errorf("sent %v, want a3 and a-mid once each", sent)
	}
	time.Sleep(300 * time.Millisecond) // the engine's check after the settlement

	// A and C are clear: the stream delivers their next events. B still has
	// a held row: its next event follows it to the claim path.
	r.MustStream(t, f, "A", "a4")
	r.MustStream(t, f, "B", "b3")
	r.MustStream(t, f, "C", "c3")
	waitFor(t, 5*time.Second, "a4 and c3 delivered, b3 diverted", func() bool {
		sent := a.Delivered()
		return sent["a4"] == 1 && sent["c3"] == 1 && f.MustRow(t, "b3").Diverted
	})
	time.Sleep(300 * time.Millisecond) // more claims
	rows := f.MustRows(t)
	for _, key := range []string{"a4", "c3"} {
		if rows[key].Diverted || rows[key].Status != "done" {
			t.Errorf("%s: %+v, want delivered by the stream (done, never diverted)", key, rows[key])
		}
	}
	if r := rows["b3"]; r.Status != "pending" {
		t.Errorf("b3: status %s, want pending behind B's held row", r.Status)
	}
	if sent := a.Delivered(); sent["b3"] != 0 {
		t.Errorf("b3 sent %d times behind a held row", sent["b3"])
	}
	if !failedOnce.Load() {
		t.Error("a3 never failed; the test proves little")
	}
}
