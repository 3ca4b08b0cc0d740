package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// budgetLog follows, from outside the engine, the bytes it holds: a group
// of works is counted when the store prepares it (the engine has taken
// room for it by then) and let go when the store settles it (the engine
// frees the room only after). What the log holds at any moment is at most
// what the engine holds then.
type budgetLog struct {
	t        *testing.T
	budget   int64
	oversize int64 // the id of the event larger than the budget

	mu       sync.Mutex
	held     map[int64]int64 // prepared and not settled: the payload and its envelope's copy of it
	most     int64
	prepared int
}

// size is a lower bound of what the engine counts for ev: its payload, and
// the envelope that copies it.
func (l *budgetLog) size(ev *relay.Event) int64 { return 2 * int64(len(ev.Payload)) }

func (l *budgetLog) prepare(works []*relay.Work) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var held int64
	for _, n := range l.held {
		held += n
	}
	if _, ok := l.held[l.oversize]; ok {
		l.t.Errorf("%d events taken while the event larger than the budget was in flight", len(works))
	}
	ids := idsOf(works)
	var group int64
	for _, w := range works {
		group += l.size(w.Event)
	}
	if slices.Contains(ids, l.oversize) && (len(works) != 1 || len(l.held) != 0) {
		l.t.Errorf("the event larger than the budget was taken with %d others in its group (%d bytes in all) and %d in flight: want it alone",
			len(works)-1, group, len(l.held))
	}
	for _, w := range works {
		l.held[w.Event.ID] = l.size(w.Event)
	}
	l.prepared += len(works)
	if !slices.Contains(ids, l.oversize) {
		if held+group > l.budget {
			l.t.Errorf("%d bytes in flight once %d events (%v) were taken: the budget is %d", held+group, len(works), ids, l.budget)
		}
		l.most = max(l.most, held+group)
	}
}

func (l *budgetLog) settle(works []*relay.Work) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, w := range works {
		delete(l.held, w.Event.ID)
	}
}

func idsOf(works []*relay.Work) []int64 {
	ids := make([]int64, len(works))
	for i, w := range works {
		ids[i] = w.Event.ID
	}
	return ids
}

// TestEngine_InFlightBytesBounded: whatever path feeds it — the stream, a
// new slot's hand-over, the claim path — the engine takes events only while
// the bytes of those it holds unsettled fit its budget
// (delivery.max_inflight_bytes), however many its count allows; an event
// larger than the budget is taken alone, once nothing else is in flight,
// and delivered. Before, only the count bounded them: a sink slower than
// the source held every event of a batch, whatever its size.
func TestEngine_InFlightBytesBounded(t *testing.T) {
	const (
		budget   = 1 << 20
		events   = 25
		oversize = 13
	)
	newEvents := func() []*relay.Event {
		var out []*relay.Event
		for i := int64(1); i <= events; i++ {
			ev := event(i, fmt.Sprint(i%3))
			n := 96 << 10
			if i == oversize {
				n = 2 << 20
			}
			ev.Payload = []byte(`"` + strings.Repeat("x", n) + `"`)
			ev.CommitLSN = 1
			out = append(out, ev)
		}
		return out
	}
	for _, path := range []string{"stream", "hand-over", "claim"} {
		t.Run(path, func(t *testing.T) {
			log := &budgetLog{t: t, budget: budget, oversize: oversize, held: map[int64]int64{}}
			store := newFakeStore()
			prepare, settle := store.prepareStream, store.settleStream
			store.prepareStream = func(ctx context.Context, works []*relay.Work, restreamed bool, owner string) error {
				log.prepare(works)
				return prepare(ctx, works, restreamed, owner)
			}
			store.settleStream = func(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
				invisible, err := settle(ctx, works, owner)
				if err == nil {
					log.settle(works)
				}
				return invisible, err
			}
			claims := &fakeClaimStore{
				prepareClaim: func(_ context.Context, works []*relay.Work, _ string, _ time.Duration) error {
					log.prepare(works)
					for _, w := range works {
						for _, p := range w.Pairs {
							p.Claimed = true
						}
					}
					return nil
				},
				settleClaim: func(_ context.Context, works []*relay.Work, _ string) ([]int64, error) {
					log.settle(works)
					return nil, nil
				},
			}
			sink := newFakeSink("s", nil)
			sink.delay = func() time.Duration { return 5 * time.Millisecond } // slower than the source
			e := startEngine(t, relay.EngineConfig{Stream: store, Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink}},
				MaxInFlightBytes: budget})
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			c := e.Stream()
			switch path {
			case "stream":
				// Re-streamed after a restart, so that every batch is
				// prepared: the decoder's batch of 25 in one Submit.
				if err := c.Restart(ctx, 1000); err != nil {
					t.Fatal(err)
				}
				if err := c.Submit(ctx, newEvents()); err != nil {
					t.Fatal(err)
				}
				c.Commit(2000)
				waitSettledAt(t, c, 2000)
			case "hand-over":
				if err := c.HandOver(ctx, newEvents()); err != nil {
					t.Fatal(err)
				}
				if err := c.HandOverSettled(ctx); err != nil {
					t.Fatal(err)
				}
			case "claim":
				var works []*relay.Work
				for _, ev := range newEvents() {
					ev.Status = "processing"
					works = append(works, &relay.Work{Event: ev})
				}
				if notTaken, err := e.SubmitClaimed(ctx, works); err != nil || len(notTaken) > 0 {
					t.Fatalf("SubmitClaimed: %v, %d not taken", err, len(notTaken))
				}
				if err := e.WaitPathSettled(ctx, relay.PathClaim); err != nil {
					t.Fatal(err)
				}
			}
			sent := sink.sentIDs()
			slices.Sort(sent)
			if len(sent) != events || !slices.Contains(sent, oversize) {
				t.Errorf("sent %v: want all %d events, the one larger than the budget among them", sent, events)
			}
			log.mu.Lock()
			defer log.mu.Unlock()
			if log.prepared != events {
				t.Errorf("%d events taken, want %d", log.prepared, events)
			}
			t.Logf("at most %d bytes in flight besides the event larger than the budget (budget %d)", log.most, budget)
		})
	}
}
