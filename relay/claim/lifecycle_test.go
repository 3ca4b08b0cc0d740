package claim_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
)

// An unknown outcome holds the row at a hold sink (one request, no second)
// and is sent again at a retry sink; a held row released by `dlq retry`
// (status back to pending, ledger pair still 'unknown') is claimed and
// delivered.
func TestUnknownOutcome(t *testing.T) {
	for _, tc := range []struct {
		name string
		hold bool
	}{{"retry sink", false}, {"hold sink", true}} {
		t.Run(tc.name, func(t *testing.T) {
			f := MustFixture(t)
			f.MustInsert(t, event{Key: "k", AggType: "order", AggID: "A", Diverted: true},
				event{Key: "k2", AggType: "order", AggID: "A", Diverted: true})
			var sends atomic.Int32
			a := newFakeSink("a", func(d *relay.Delivery) error {
				if d.Event.EventKey == "k" && sends.Add(1) == 1 {
					return relay.UnknownError(errors.New("request written, no response"))
				}
				return nil
			})
			MustStart(t, f, options{Routes: []relay.Route{{Sink: a, Hold: tc.hold}}, PollInterval: 50 * time.Millisecond,
				Backoff: []time.Duration{100 * time.Millisecond}})
			key := relay.LedgerKey{EventKey: "k", Action: "a"}

			if tc.hold {
				waitFor(t, 10*time.Second, "k held", func() bool { return f.MustRow(t, "k").Status == "held" })
				time.Sleep(300 * time.Millisecond)
				if pair := f.MustLedger(t)[key]; pair.State != "unknown" || !strings.Contains(deref(pair.Detail), "no response") {
					t.Errorf("ledger pair %+v (%s), want unknown with the reason", pair, deref(pair.Detail))
				}
				if r := f.MustRow(t, "k2"); r.Status != "pending" {
					t.Errorf("k2 is %s behind a held row, want pending", r.Status)
				}
				if n := sends.Load(); n != 1 {
					t.Fatalf("%d requests for a held event, want 1", n)
				}
				// dlq retry: the person releases the row.
				f.MustExec(t, `UPDATE integration_outbox SET status = 'pending' WHERE event_key = 'k'`)
			}
			waitFor(t, 10*time.Second, "k and k2 done", func() bool {
				rows := f.MustRows(t)
				return rows["k"].Status == "done" && rows["k2"].Status == "done"
			})
			pair := f.MustLedger(t)[key]
			if pair.State != "delivered" || pair.Attempts != 2 {
				t.Errorf("ledger pair %+v, want delivered at its second claim", pair)
			}
			if n := sends.Load(); n != 2 {
				t.Errorf("%d requests, want 2 (the unknown one and the resend)", n)
			}
			var bodies []string
			for _, c := range a.Calls() {
				if c.Key == "k" {
					bodies = append(bodies, string(c.Body))
				}
			}
			if len(bodies) != 2 || bodies[0] != bodies[1] {
				t.Errorf("bodies of k's requests %q, want two identical", bodies)
			}
		})
	}
}

// The owner lock is the claim path's lease: when its connection dies,
// other relays may return this owner's rows and send them. The claim
// source stops claiming and Run ends with relay.ErrLeaseLost while a
// delivery is still in flight — it does not wait for it — so that the
// phase halts the engine at once (relay/supervisor) and starts again with
// the lock taken afresh. Before, the source took the lock again and went
// on while the engine kept sending the rows the lock had covered.
func TestOwnerLockLostEndsTheClaimPath(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t, event{Key: "slow"})
	inFlight := make(chan struct{}, 1)
	a := newFakeSink("a", func(*relay.Delivery) error {
		inFlight <- struct{}{}
		time.Sleep(8 * time.Second)
		return nil
	})
	r := MustEngine(t, f, options{Routes: routes(a), All: true, PollInterval: 50 * time.Millisecond})
	c, err := claim.New(r.SourceConfig(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	select {
	case <-inFlight:
	case <-time.After(20 * time.Second):
		t.Fatal("the row was never sent")
	}
	cut := time.Now()
	if n := f.MustInt(t, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = 'outbox-relay owner lock' AND datname = current_database()`); n != 1 {
		t.Fatalf("terminated %d owner-lock sessions, want 1", n)
	}
	select {
	case err := <-done:
		if !errors.Is(err, relay.ErrLeaseLost) {
			t.Fatalf("Run = %v, want relay.ErrLeaseLost", err)
		}
		t.Logf("Run ended %v after the owner lock's session was cut", time.Since(cut).Round(time.Millisecond))
		if took := time.Since(cut); took > 4*time.Second {
			t.Errorf("Run ended %v after the cut, want within the lock's check (1 s) and its timeout (3 s)", took)
		}
	case <-time.After(6 * time.Second):
		t.Fatal("Run went on after its owner lock was lost (waiting for the delivery in flight?)")
	}
}

// Stopping claims nothing new, lets the engine finish the deliveries of
// the rows already claimed and waits until they are settled (rows not
// claimed stay pending without an attempt), then releases the owner lock.
//
// The source no longer sends: it hands claimed rows to the engine, which
// delivers every row it took, so "in flight" is now every claimed row.
func TestRunStopsAfterSettlingInFlight(t *testing.T) {
	f := MustFixture(t)
	f.MustInsertMany(t, "evt", 5, 0, true)
	started := make(chan struct{}, 5)
	a := newFakeSink("a", func(*relay.Delivery) error {
		started <- struct{}{}
		time.Sleep(500 * time.Millisecond)
		return nil
	})
	r := MustEngine(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond})
	c, err := claim.New(r.SourceConfig(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	<-started
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
	}
	sent := len(a.Calls())
	if n := f.MustStatusCount(t, "done"); n != int64(sent) {
		t.Errorf("%d rows done after stopping, want the %d sent", n, sent)
	}
	if claimed := c.Stats.Claimed.Load(); int64(sent) != claimed {
		t.Errorf("%d rows sent by the time Run returned, want every claimed row (%d)", sent, claimed)
	}
	for key, r := range f.MustRows(t) {
		if r.Status != "done" && (r.Status != "pending" || r.Attempts != 0) {
			t.Errorf("%s: status %s, attempts %d after stopping; want done, or pending without an attempt", key, r.Status, r.Attempts)
		}
	}
	t.Logf("%d of 5 rows were claimed when Run was stopped", sent)
	if n := f.MustInt(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1`, int64(ledger.OwnerLockClass)); n != 0 {
		t.Errorf("owner lock still held after Run returned")
	}
}

// Rows the engine cannot take go back: here the engine holds one unsettled
// event at most (MaxUnsettled 1) and is busy with the first row when the
// source, having claimed the second, is stopped while SubmitClaimed waits
// for room. The second row goes back to pending, still the claim path's,
// without an attempt counted, a ledger claim or a send; the first is
// delivered and settled before Run returns.
func TestPutBackWhenTheEngineCannotTake(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t, event{Key: "r1", Diverted: true}, event{Key: "r2", Diverted: true})
	started := make(chan string, 2)
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	a := newFakeSink("a", func(d *relay.Delivery) error {
		started <- d.Event.EventKey
		<-release
		return nil
	})
	r := MustEngine(t, f, options{Routes: routes(a), MaxUnsettled: 1, BatchSize: 1, PollInterval: 50 * time.Millisecond})
	t.Cleanup(unblock) // before the engine's drain, also when the test fails
	c, err := claim.New(r.SourceConfig(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var first string
	select {
	case first = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("no row reached the sink")
	}
	second := map[string]string{"r1": "r2", "r2": "r1"}[first]
	// A full batch: the source claims again at once, and waits in
	// SubmitClaimed for room the first row holds.
	waitFor(t, 10*time.Second, second+" claimed", func() bool { return f.MustRow(t, second).Status == "processing" })
	time.Sleep(200 * time.Millisecond)
	cancel()

	waitFor(t, 10*time.Second, second+" put back", func() bool { return f.MustRow(t, second).Status == "pending" })
	row := f.MustRow(t, second)
	if row.Attempts != 0 || row.LockedBy != nil || !row.Diverted || row.LastError != nil {
		t.Errorf("%s put back as %+v (locked by %s, last_error %s); want pending, 0 attempts, unlocked, still diverted",
			second, row, deref(row.LockedBy), deref(row.LastError))
	}
	if _, ok := f.MustLedger(t)[relay.LedgerKey{EventKey: second, Action: "a"}]; ok {
		t.Errorf("%s has a ledger claim; the engine never took it", second)
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) before the row it handed to the engine was settled", err)
	default:
	}
	unblock()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
	}
	if st := f.MustRow(t, first).Status; st != "done" {
		t.Errorf("%s: status %s after Run returned, want done", first, st)
	}
	if sent := a.Delivered(); sent[second] != 0 || sent[first] != 1 {
		t.Errorf("sent %v, want %s once and %s never", sent, first, second)
	}
	if n := c.Stats.Claimed.Load(); n != 2 {
		t.Errorf("claimed %d rows, want 2", n)
	}
}

// One engine outlives its claim sources: in auto mode the supervisor runs
// a polling source, stops it and starts the stream's source over the same
// engine (relay/supervisor), while the engine may still be finishing the
// first source's settlement. New registers the new source's wake-up with
// the running engine; each source delivers its rows.
func TestSourcesOneAfterAnotherOnOneEngine(t *testing.T) {
	f := MustFixture(t)
	a := newFakeSink("a", nil)
	r := MustEngine(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond})
	ctx := context.Background()

	// The first source's last batch settles after its loop has stopped
	// (here it never ran: the rows are claimed for it).
	if _, err := claim.New(r.SourceConfig(t, nil)); err != nil {
		t.Fatal(err)
	}
	f.MustInsertMany(t, "first", 5, 0, false)
	works, err := r.Store.Claim(ctx, relay.ClaimQuery{All: true, Limit: 10, Owner: r.Owner()})
	if err != nil || len(works) != 5 {
		t.Fatalf("Claim = %d rows, %v; want 5", len(works), err)
	}
	if notTaken, err := r.Engine.SubmitClaimed(ctx, works); err != nil {
		t.Fatalf("SubmitClaimed: %v (%d not taken)", err, len(notTaken))
	}
	waitFor(t, 10*time.Second, "the first rows done", func() bool { return f.MustStatusCount(t, "done") == 5 })
	time.Sleep(100 * time.Millisecond) // the engine's bookkeeping after the write

	// The next source, on the same engine.
	f.MustInsertMany(t, "second", 5, 0, true)
	second, err := claim.New(r.SourceConfig(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	runSource(t, second)
	waitFor(t, 10*time.Second, "the second source's rows done", func() bool { return f.MustStatusCount(t, "done") == 10 })
	if n := len(a.Delivered()); n != 10 {
		t.Errorf("delivered %d rows, want 10", n)
	}
}

// Config errors name what is wrong. Routes are the engine's now: a
// duplicate sink or a bad glob is refused by relay.NewEngine. The owner is
// given (ledger.NewOwner makes one with ledger.OwnerPrefix); New no longer
// makes one nor checks its prefix.
func TestNewRejectsBadConfig(t *testing.T) {
	f := MustFixture(t)
	a := newFakeSink("a", nil)
	r := MustEngine(t, f, options{Routes: routes(a)})
	for _, tc := range []struct {
		name string
		cfg  claim.Config
		want string
	}{
		{"no engine", claim.Config{Store: r.Store, Owner: r.Owner()}, "no engine"},
		{"no store", claim.Config{Engine: r.Engine, Owner: r.Owner()}, "no store"},
		{"no owner", claim.Config{Engine: r.Engine, Store: r.Store}, "no owner"},
		{"bad channel", claim.Config{Engine: r.Engine, Store: r.Store, Owner: r.Owner(), Notify: "a\x01"}, "notify channel"},
	} {
		if _, err := claim.New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: New = %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
	for _, tc := range []struct {
		name   string
		routes []relay.Route
		want   string
	}{
		{"duplicate sinks", routes(a, a), `two sinks named "a"`},
		{"bad glob", []relay.Route{{Sink: a, Events: []string{"order.["}}}, "syntax error in pattern"},
	} {
		_, err := relay.NewEngine(relay.EngineConfig{Routes: tc.routes, Stream: r.Store, Claim: r.Store, Owner: r.Owner()})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: NewEngine = %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
	if owner := ledger.NewOwner(); !strings.HasPrefix(owner, ledger.OwnerPrefix) {
		t.Errorf("ledger.NewOwner() = %q, want the prefix %q", owner, ledger.OwnerPrefix)
	}
	// A second source with a live owner's id cannot start.
	first := MustStart(t, f, options{Routes: routes(a)})
	waitFor(t, 5*time.Second, "the first owner lock", func() bool {
		return f.MustInt(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1`, int64(ledger.OwnerLockClass)) == 1
	})
	second, err := claim.New(claim.Config{Engine: r.Engine, Store: r.Store, Owner: first.Owner()})
	if err != nil {
		t.Fatal(err)
	}
	if err := second.Run(context.Background()); !errors.Is(err, relay.ErrLockTaken) {
		t.Errorf("Run with a live owner's id = %v, want relay.ErrLockTaken", err)
	}
}
