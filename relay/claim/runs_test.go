package claim_test

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Two poll-mode relays claim runs of the same hot aggregates at once
// (docs/guarantees.md "Claim runs"): each aggregate's events reach the
// sink in id order and each exactly once, and both relays deliver. A run
// claimed behind, or across, the other relay's rows in flight would send
// an aggregate's later event while an earlier one is still being sent.
func TestTwoRelaysClaimRunsInOrder(t *testing.T) {
	f := MustFixture(t)
	const aggregates, perAggregate = 8, 100
	f.MustInsertMany(t, "evt", aggregates*perAggregate, aggregates, false)

	type sent struct {
		relay, agg string
		id         int64
	}
	var (
		mu       sync.Mutex
		log      []sent               // in the order the sends began
		inFlight = map[string]int64{} // aggregate -> id being sent
		overlaps []string
	)
	sink := func(name string) *fakeSink {
		return newFakeSink("hook", func(d *relay.Delivery) error {
			agg := *d.Event.AggregateID
			mu.Lock()
			if _, busy := inFlight[agg]; busy {
				overlaps = append(overlaps, agg)
			}
			inFlight[agg] = d.Event.ID
			log = append(log, sent{relay: name, agg: agg, id: d.Event.ID})
			mu.Unlock()
			time.Sleep(time.Millisecond + time.Duration(rand.N(2000))*time.Microsecond)
			mu.Lock()
			if inFlight[agg] == d.Event.ID {
				delete(inFlight, agg)
			}
			mu.Unlock()
			return nil
		})
	}
	start := time.Now()
	for _, name := range []string{"x", "y"} {
		MustStart(t, f, options{Routes: routes(sink(name)), All: true, BatchSize: 40,
			PollInterval: 10 * time.Millisecond, Owner: ledger.NewOwner() + ":" + name})
	}
	waitFor(t, 120*time.Second, "every row done", func() bool {
		return f.MustStatusCount(t, "done") == aggregates*perAggregate
	})
	t.Logf("%d events over %d aggregates by two relays in %s", aggregates*perAggregate, aggregates, time.Since(start).Round(time.Millisecond))

	mu.Lock()
	defer mu.Unlock()
	seen := map[int64]bool{}
	last := map[string]int64{}
	by := map[string]int{}
	for _, s := range log {
		if seen[s.id] {
			t.Errorf("id %d sent twice", s.id)
		}
		seen[s.id] = true
		if s.id <= last[s.agg] {
			t.Errorf("aggregate %s: id %d sent (relay %s) after id %d", s.agg, s.id, s.relay, last[s.agg])
		}
		last[s.agg] = s.id
		by[s.relay]++
	}
	if len(seen) != aggregates*perAggregate {
		t.Errorf("%d events sent, want %d", len(seen), aggregates*perAggregate)
	}
	if len(overlaps) > 0 {
		t.Errorf("%d sends began while an earlier event of the same aggregate was being sent (first: aggregate %s)", len(overlaps), overlaps[0])
	}
	if by["x"] == 0 || by["y"] == 0 {
		t.Errorf("sends by relay: %v; both relays must claim for the test to mean anything", by)
	}
	t.Logf("sends by relay: %v", by)
	for k, p := range f.MustLedger(t) {
		if p.State != "delivered" {
			t.Errorf("ledger %v: %s, want delivered", k, p.State)
		}
	}
}
