package claim_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The stream hands an event off; while it is with the claim path the
// stream diverts the aggregate's later events too; the claim path
// delivers them in order and, once the last one settles, the engine lets
// the stream deliver the aggregate's events itself again. Both paths send
// the same body.
func TestEngineDivertAndUndivert(t *testing.T) {
	f := MustFixture(t)
	var (
		mu       sync.Mutex
		order    []string
		failOnce = map[string]bool{"e1": true}
	)
	// One sink object shared by both paths, as the CLI wires it.
	s := newFakeSink("n8n", func(d *relay.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		if failOnce[d.Event.EventKey] {
			delete(failOnce, d.Event.EventKey)
			return relay.TransientError(errors.New("HTTP 503"), 0)
		}
		order = append(order, d.Event.EventKey)
		return nil
	})
	// One engine and one policy for both paths: a failure at the stream is
	// diverted at once and due after 300 ms.
	c := MustStart(t, f, options{Routes: routes(s), PollInterval: 50 * time.Millisecond,
		InlineAttempts: 0, Backoff: []time.Duration{300 * time.Millisecond}})

	// e1 fails at the stream and is diverted (due in 300 ms); e2, submitted
	// meanwhile, follows it to the claim path.
	c.MustStream(t, f, "A", "e1")
	waitFor(t, 5*time.Second, "e1 diverted", func() bool { return f.MustRow(t, "e1").Diverted })
	c.MustStream(t, f, "A", "e2")
	waitFor(t, 5*time.Second, "e2 diverted", func() bool { return f.MustRow(t, "e2").Diverted })
	waitFor(t, 10*time.Second, "e1 and e2 done by the claim path", func() bool {
		rows := f.MustRows(t)
		return rows["e1"].Status == "done" && rows["e2"].Status == "done"
	})
	// The claim path settled the aggregate's last diversion: the stream
	// delivers e3 itself.
	time.Sleep(100 * time.Millisecond)
	c.MustStream(t, f, "A", "e3")
	waitFor(t, 5*time.Second, "e3 delivered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(order) == 3
	})
	time.Sleep(200 * time.Millisecond) // the engine's settlement
	if r := f.MustRow(t, "e3"); r.Diverted {
		t.Errorf("e3 was diverted; the aggregate should no longer be diverted")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(order) != 3 || order[0] != "e1" || order[1] != "e2" || order[2] != "e3" {
		t.Errorf("delivered in order %v, want [e1 e2 e3]", order)
	}
	var e1 []string
	for _, call := range s.Calls() {
		if call.Key == "e1" {
			e1 = append(e1, string(call.Body))
		}
	}
	if len(e1) != 2 || e1[0] != e1[1] {
		t.Errorf("e1's bodies from the stream and the claim path: %q, want two identical", e1)
	}
	// The claim path has no delivery counter of its own any more (the
	// engine counts both paths): it claimed e1 and e2 once each, and the
	// engine delivered three events.
	if got := c.Stats.Claimed.Load(); got != 2 {
		t.Errorf("the claim path claimed %d rows, want 2 (e1, e2)", got)
	}
	if got := c.Engine.Stats.Delivered.Load(); got != 3 {
		t.Errorf("the engine delivered %d pairs, want 3", got)
	}
}

// In-memory order across paths: a row the claim path is delivering holds
// back its aggregate's next event arriving on the stream in the same
// engine, which is sent only after it — and, when the claimed row fails,
// follows it to the claim path instead of overtaking it.
//
// The row is claimed after the engine started without it being diverted
// (as after `outbox-relay reconcile` or in poll mode), so nothing but the
// lane keeps the stream's event back. The test drives the engine's two
// entries directly: the store's Claim and SubmitClaimed, and the stream
// Consumer.
func TestClaimedRowGoesBeforeItsStreamSuccessor(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail bool
	}{{"claimed row delivered", false}, {"claimed row fails", true}} {
		t.Run(tc.name, func(t *testing.T) {
			f := MustFixture(t)
			f.MustInsert(t, event{Key: "c1", AggType: "order", AggID: "A"})
			var (
				mu      sync.Mutex
				order   []string
				started = make(chan struct{})
				release = make(chan struct{})
			)
			a := newFakeSink("a", func(d *relay.Delivery) error {
				if d.Event.EventKey == "c1" {
					close(started)
					<-release
					if tc.fail {
						return relay.TransientError(errors.New("HTTP 503"), 0)
					}
				}
				mu.Lock()
				order = append(order, d.Event.EventKey)
				mu.Unlock()
				return nil
			})
			r := MustEngine(t, f, options{Routes: routes(a), Backoff: []time.Duration{time.Hour}})
			var releaseOnce sync.Once
			unblock := func() { releaseOnce.Do(func() { close(release) }) }
			t.Cleanup(unblock) // before the engine's drain, also when the test fails
			ctx := context.Background()
			// The engine has started (loaded the diverted aggregates) before
			// c1 is claimed: a claimed row is the claim path's (handoff_at
			// set), so an engine starting after the claim diverts A and s2
			// would follow c1 through the claim path instead.
			if _, err := r.Engine.SubmitClaimed(ctx, nil); err != nil {
				t.Fatal(err)
			}
			works, err := r.Store.Claim(ctx, relay.ClaimQuery{All: true, Limit: 10, Owner: r.Owner()})
			if err != nil || len(works) != 1 {
				t.Fatalf("Claim = %d rows, %v; want c1", len(works), err)
			}
			if notTaken, err := r.Engine.SubmitClaimed(ctx, works); err != nil {
				t.Fatalf("SubmitClaimed: %v (%d not taken)", err, len(notTaken))
			}
			select {
			case <-started:
			case <-time.After(10 * time.Second):
				t.Fatal("c1 never reached the sink")
			}

			r.MustStream(t, f, "A", "s2")
			time.Sleep(300 * time.Millisecond) // s2's chance to overtake
			mu.Lock()
			early := slices.Clone(order)
			mu.Unlock()
			if len(early) != 0 {
				t.Fatalf("sent %v while c1 was being delivered", early)
			}
			unblock()

			if !tc.fail {
				waitFor(t, 10*time.Second, "c1 done and s2 delivered", func() bool {
					mu.Lock()
					defer mu.Unlock()
					return len(order) == 2 && f.MustRow(t, "c1").Status == "done"
				})
				mu.Lock()
				defer mu.Unlock()
				if order[0] != "c1" || order[1] != "s2" {
					t.Errorf("delivered in order %v, want [c1 s2]", order)
				}
				if row := f.MustRow(t, "s2"); row.Diverted {
					t.Errorf("s2 was diverted; it should have waited in memory behind c1")
				}
				return
			}
			waitFor(t, 10*time.Second, "c1 back to pending and s2 diverted", func() bool {
				return f.MustRow(t, "c1").Status == "pending" && f.MustRow(t, "s2").Diverted
			})
			if row := f.MustRow(t, "c1"); row.Attempts != 1 {
				t.Errorf("c1: attempts %d, want 1", row.Attempts)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(order) != 0 {
				t.Errorf("sent %v; s2 must not overtake c1, which failed", order)
			}
		})
	}
}
