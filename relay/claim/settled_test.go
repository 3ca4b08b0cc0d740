package claim_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
)

// OnAggregateSettled tells the engine an aggregate is clear once its last
// handed-off row settles — not before, not while a held row remains — with
// the DivertSeq value read before the check.
func TestOnAggregateSettledAfterLastHandedOffRow(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "a1", AggType: "order", AggID: "A", HandedOff: true},
		event{Key: "a2", AggType: "order", AggID: "A", HandedOff: true},
		event{Key: "a3", AggType: "order", AggID: "A", HandedOff: true},
		event{Key: "b1", AggType: "order", AggID: "B", HandedOff: true},
		event{Key: "b2", AggType: "order", AggID: "B", Status: "held", HandedOff: true},
		event{Key: "c1", AggType: "order", AggID: "C", HandedOff: true},
		event{Key: "c2", AggType: "order", AggID: "C"}, // the stream's
		event{Key: "n1", HandedOff: true},              // no aggregate
	)
	var failedOnce atomic.Bool
	a := newFakeSink("a", func(d *relay.Delivery) error {
		if d.Event.EventKey == "a3" && failedOnce.CompareAndSwap(false, true) {
			return relay.TransientError(errors.New("HTTP 503"), 0)
		}
		return nil
	})

	type settledCall struct {
		agg      relay.AggregateKey
		seq      uint64
		wantSeq  uint64
		unsettle int64 // handed-off or held rows of the aggregate not settled, at the call
	}
	var (
		seq   atomic.Uint64
		mu    sync.Mutex
		calls []settledCall
	)
	MustStart(t, f, claim.Config{Routes: routes(a), PollInterval: 50 * time.Millisecond,
		Backoff:   []time.Duration{300 * time.Millisecond},
		DivertSeq: func() uint64 { return seq.Add(1) },
		OnAggregateSettled: func(agg relay.AggregateKey, s uint64) {
			var n int64
			err := f.pool.QueryRow(context.Background(), `SELECT count(*) FROM integration_outbox
				WHERE aggregate_type = $1 AND aggregate_id = $2 AND status IN ('pending', 'processing', 'held')
				  AND (handoff_at IS NOT NULL OR status = 'held')`, agg.Type, agg.ID).Scan(&n)
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			calls = append(calls, settledCall{agg: agg, seq: s, wantSeq: seq.Load(), unsettle: n})
			mu.Unlock()
		}})

	waitFor(t, 10*time.Second, "a3, b1, c1 and n1 done", func() bool {
		rows := f.MustRows(t)
		return rows["a3"].Status == "done" && rows["b1"].Status == "done" && rows["c1"].Status == "done" && rows["n1"].Status == "done"
	})
	time.Sleep(300 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	got := map[relay.AggregateKey]int{}
	for _, c := range calls {
		got[c.agg]++
		if c.unsettle != 0 {
			t.Errorf("%v settled with %d handed-off or held rows still open", c.agg, c.unsettle)
		}
		if c.seq != c.wantSeq {
			t.Errorf("%v settled with seq %d; DivertSeq last returned %d before the check", c.agg, c.seq, c.wantSeq)
		}
	}
	want := map[relay.AggregateKey]int{{Type: "order", ID: "A"}: 1, {Type: "order", ID: "C"}: 1}
	if len(got) != len(want) || got[relay.AggregateKey{Type: "order", ID: "A"}] != 1 || got[relay.AggregateKey{Type: "order", ID: "C"}] != 1 {
		t.Errorf("OnAggregateSettled calls %v, want %v (B still has a held row)", got, want)
	}
	if !failedOnce.Load() {
		t.Error("a3 never failed; the test proves little")
	}
}
