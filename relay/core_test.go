package relay_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/prometheus/client_golang/prometheus"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// consumerRef lets a store hook, set before the engine starts, read the
// engine's settled position.
type consumerRef struct {
	p atomic.Pointer[relay.Consumer]
}

func (r *consumerRef) set(c relay.Consumer) { r.p.Store(&c) }
func (r *consumerRef) settled() relay.LSN {
	lsn, _ := (*r.p.Load()).Settled()
	return lsn
}

// waitBlockedIn waits until some goroutine's stack shows fn: a call that
// blocks (a full lane) and has no other sign of it.
func waitBlockedIn(t *testing.T, fn string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	waitFor(t, "a goroutine blocked in "+fn, func() bool {
		n := runtime.Stack(buf, true)
		return bytes.Contains(buf[:n], []byte(fn))
	})
}

// TestEngine_NeverSettlesWhatWasNotWritten: a row the store reports
// invisible (the walsender sent it before its commit became visible) is
// written again until it is seen, for as long as that takes: the event
// stays unsettled meanwhile and the settled position does not pass it,
// even though a later transaction is delivered and written. Before the new
// core, a row invisible for 30 s was given up on and settled unwritten.
func TestEngine_NeverSettlesWhatWasNotWritten(t *testing.T) {
	const invisibleWrites = 8
	for _, tt := range []struct {
		name    string
		hold    bool
		send    func(*relay.Delivery) error
		written func(s *fakeStore) bool
	}{
		{name: "diversion", send: func(*relay.Delivery) error { return relay.TransientError(errors.New("503"), 0) },
			written: func(s *fakeStore) bool { _, ok := s.diversions[1]; return ok }},
		{name: "dead letter", send: func(*relay.Delivery) error { return relay.PermanentError(errors.New("400")) },
			written: func(s *fakeStore) bool { _, ok := s.deadLetters[1]; return ok }},
		{name: "Hold on an invisible row", hold: true, send: func(*relay.Delivery) error { return relay.UnknownError(errors.New("timeout")) },
			written: func(s *fakeStore) bool { _, ok := s.held[1]; return ok }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := newFakeStore()
			store.invisibleFor[1] = invisibleWrites
			var c consumerRef
			var writes atomic.Int32
			var early atomic.Value
			write := store.settleStream
			store.settleStream = func(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
				for _, w := range works {
					if w.Event.ID == 1 {
						// Each write of event 1 comes before its settlement.
						if n := writes.Add(1); c.settled() != 0 {
							early.Store(fmt.Sprintf("settled at %v before write %d of event 1", c.settled(), n))
						}
					}
				}
				return write(ctx, works, owner)
			}
			sink := newFakeSink("s", func(d *relay.Delivery) error {
				if d.Event.ID == 1 {
					return tt.send(d)
				}
				return nil
			})
			e := startEngine(t, relay.EngineConfig{Stream: store, Owner: "me", Routes: []relay.Route{{Sink: sink, Hold: tt.hold}},
				Policy: relay.Policy{InlineAttempts: 0}})
			c.set(e.Stream())
			submit(t, e.Stream(), event(1, "a"))
			e.Stream().Commit(100)
			submit(t, e.Stream(), event(2, "b"))
			e.Stream().Commit(200)

			waitSettledAt(t, e.Stream(), 200)
			if msg := early.Load(); msg != nil {
				t.Fatal(msg)
			}
			if n := writes.Load(); n != invisibleWrites+1 {
				t.Fatalf("event 1 written %d times, want %d (invisible %d times, then seen)", n, invisibleWrites+1, invisibleWrites)
			}
			store.mu.Lock()
			defer store.mu.Unlock()
			if !tt.written(store) {
				t.Fatal("settled without the decision in the table")
			}
		})
	}
}

// TestEngine_RowDataErrorIsIsolated: the store refuses one row's data
// (relay.ErrRowData) every time; the batch is split so the other rows are
// written and settle; the refused row is written as a plain dead letter
// after DataErrorsBeforeFallback refusals, and after twice that many it is
// left pending — settled unwritten, so it holds nothing back.
func TestEngine_RowDataErrorIsIsolated(t *testing.T) {
	t.Parallel()
	const bad, events = 3, 8
	store := newFakeStore()
	var mu sync.Mutex
	var badWrites []relay.Decision // the decisions of the refused row, as written alone
	biggest := 0                   // the largest batch the refused row was in
	write := store.settleStream
	store.settleStream = func(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
		for _, w := range works {
			if w.Event.ID == bad {
				mu.Lock()
				biggest = max(biggest, len(works))
				if len(works) == 1 {
					badWrites = append(badWrites, w.Decision)
				}
				mu.Unlock()
				return nil, fmt.Errorf("settle %d stream events: ERROR: invalid byte sequence (SQLSTATE 22021): %w", len(works), relay.ErrRowData)
			}
		}
		return write(ctx, works, owner)
	}
	// Every send waits for all of them, so the decisions reach the settle
	// queue together and are written in one batch.
	var started sync.WaitGroup
	started.Add(events)
	sink := newFakeSink("s", func(*relay.Delivery) error { started.Done(); started.Wait(); return nil })
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}}})
	c := e.Stream()
	var batch []*relay.Event
	for i := int64(1); i <= events; i++ {
		batch = append(batch, event(i, fmt.Sprint(i)))
	}
	submit(t, c, batch...)
	c.Commit(100)
	waitSettledAt(t, c, 100)

	delivered, diversions, dead := store.snapshot()
	for i := int64(1); i <= events; i++ {
		n := delivered[relay.LedgerKey{EventKey: fmt.Sprintf("k%d", i), Action: "s"}]
		if i == bad && n != 0 || i != bad && n != 1 {
			t.Errorf("event %d: %d delivered ledger rows written", i, n)
		}
	}
	if len(diversions) != 0 || len(dead) != 0 {
		t.Fatalf("diversions %v, dead letters %v: want none written", diversions, dead)
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("the refused row was in a batch of %d", biggest)
	if want := 2*relay.DataErrorsBeforeFallback + 1; len(badWrites) != want {
		t.Fatalf("the refused row was written alone %d times, want %d", len(badWrites), want)
	}
	for i, d := range badWrites {
		if i < relay.DataErrorsBeforeFallback {
			if d.Kind != relay.Done {
				t.Fatalf("write %d of the refused row: %+v, want its own decision (done)", i+1, d)
			}
			continue
		}
		if d.Kind != relay.DeadLetter || !strings.Contains(d.Reason, "outcome not storable") || !strings.Contains(d.Reason, "it was: done") ||
			!strings.Contains(d.Reason, "SQLSTATE 22021") {
			t.Fatalf("write %d of the refused row: %+v, want the fallback dead letter", i+1, d)
		}
	}
}

// TestEngine_BackPressureWhileSettlementFails: while the store cannot write
// outcomes, the engine takes at most MaxUnsettled events — that many pass
// the sink, whatever the lane's capacity, since a lane frees its slot once
// a pair is decided — and then Submit blocks; it resumes when the store
// recovers, and every event is sent once.
func TestEngine_BackPressureWhileSettlementFails(t *testing.T) {
	t.Parallel()
	const laneCapacity, maxUnsettled = 4, 6
	store := newFakeStore()
	var failing atomic.Bool
	failing.Store(true)
	write := store.settleStream
	store.settleStream = func(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
		if failing.Load() {
			return nil, errors.New("connection refused")
		}
		return write(ctx, works, owner)
	}
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}},
		LaneCapacity: laneCapacity, MaxUnsettled: maxUnsettled})
	c := e.Stream()
	for i := int64(1); i <= maxUnsettled; i++ {
		submit(t, c, event(i, fmt.Sprint(i)))
		c.Commit(relay.LSN(i * 10))
	}
	waitFor(t, "the events taken sent", func() bool { return len(sink.sent()) == maxUnsettled })

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := c.Submit(ctx, []*relay.Event{event(maxUnsettled+1, "x")}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Submit with %d events unsettled returned %v, want it blocked until its deadline", maxUnsettled, err)
	}
	if n := len(sink.sent()); n != maxUnsettled {
		t.Fatalf("%d events passed the sink while settlement failed, want %d (MaxUnsettled)", n, maxUnsettled)
	}
	if lsn, _ := c.Settled(); lsn != 0 {
		t.Fatalf("settled at %v while nothing was written", lsn)
	}

	submitted := make(chan error, 1)
	go func() { submitted <- c.Submit(context.Background(), []*relay.Event{event(maxUnsettled+1, "x")}) }()
	failing.Store(false)
	if err := <-submitted; err != nil {
		t.Fatal(err)
	}
	c.Commit(1000)
	waitSettledAt(t, c, 1000)
	ids := sink.sentIDs()
	slices.Sort(ids)
	if want := []int64{1, 2, 3, 4, 5, 6, 7}; !slices.Equal(ids, want) {
		t.Fatalf("sent %v, want each of %v once", ids, want)
	}
}

// TestEngine_SubmitCutShortOnFullLane: a Submit waiting for room in a full
// lane returns when its ctx ends; the event it had taken is diverted
// ("its source stopped"), nothing stays counted, and the stream's next
// session works: Restart does not wait for the event still in flight, the
// slot's copy of that event joins it and is not sent again, WaitSettled
// returns once it is done, and the settled position advances.
func TestEngine_SubmitCutShortOnFullLane(t *testing.T) {
	store := newFakeStore()
	release := make(chan struct{})
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if d.Event.ID == 1 {
			<-release
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}}, LaneCapacity: 1,
		Policy: relay.Policy{LaneBlockMax: time.Hour}})
	c := e.Stream()
	first, second := event(1, "a"), event(2, "b")
	first.CommitLSN, second.CommitLSN = 50, 150
	submit(t, c, first)
	c.Commit(100)
	waitFor(t, "event 1 sent", func() bool { return len(sink.sent()) == 1 })

	ctx, cancel := context.WithCancel(context.Background())
	cut := make(chan error, 1)
	go func() { cut <- c.Submit(ctx, []*relay.Event{second}) }()
	waitBlockedIn(t, "relay.(*lane).acquire")
	cancel()
	if err := <-cut; !errors.Is(err, context.Canceled) {
		t.Fatalf("cut Submit returned %v", err)
	}
	waitFor(t, "event 2 diverted", func() bool { _, h, _ := store.snapshot(); _, ok := h[2]; return ok })
	if _, h, _ := store.snapshot(); !strings.Contains(h[2].Reason, "its source stopped") {
		t.Fatalf("diversion of event 2: %+v", h[2])
	}

	// The source reconnects: the slot sends both transactions again.
	restarted := make(chan error, 1)
	go func() { restarted <- c.Restart(context.Background(), 1000) }()
	select {
	case err := <-restarted:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Restart waits for the event in flight")
	}
	waited := make(chan error, 1)
	go func() { waited <- e.WaitSettled(context.Background()) }()
	again1, again2 := event(1, "a"), event(2, "b")
	again1.CommitLSN, again2.CommitLSN = 50, 150
	submit(t, c, again1)
	c.Commit(100)
	submit(t, c, again2)
	c.Commit(200)
	if lsn, _ := c.Settled(); lsn != 0 {
		t.Fatalf("settled at %v with event 1 in flight", lsn)
	}
	select {
	case err := <-waited:
		t.Fatalf("WaitSettled returned %v with event 1 in flight", err)
	default:
	}
	close(release)
	if err := <-waited; err != nil {
		t.Fatal(err)
	}
	waitSettledAt(t, c, 200)
	if ids := sink.sentIDs(); !slices.Equal(ids, []int64{1}) {
		t.Fatalf("sent %v, want event 1 once", ids)
	}
	if delivered, _, _ := store.snapshot(); delivered[relay.LedgerKey{EventKey: "k1", Action: "s"}] != 1 {
		t.Fatalf("delivered %v", delivered)
	}
}

// TestEngine_ScheduledEventDivertsAtDecision: an event whose available_at
// is in the future goes to the claim path, and its aggregate is diverted at
// that moment, not when the diversion is written: the aggregate's next
// event, decoded right after it, follows it and is never sent first.
func TestEngine_ScheduledEventDivertsAtDecision(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}}})
	c := e.Stream()
	at := time.Now().Add(time.Hour)
	scheduled := func(id int64, agg string) *relay.Event { ev := event(id, agg); ev.AvailableAt = at; return ev }
	// In one Submit, and in two in a row.
	submit(t, c, scheduled(1, "a"), event(2, "a"), event(3, "other"))
	submit(t, c, scheduled(4, "b"))
	submit(t, c, event(5, "b"))
	c.Commit(100)
	waitSettledAt(t, c, 100)

	if ids := sink.sentIDs(); !slices.Equal(ids, []int64{3}) {
		t.Fatalf("sent %v, want only event 3", ids)
	}
	_, diversions, _ := store.snapshot()
	for _, id := range []int64{1, 4} {
		if h := diversions[id]; h.Kind != relay.Later || h.Why != "scheduled" || !h.At.Equal(at) {
			t.Errorf("scheduled event %d: %+v, want a diversion due at its available_at", id, h)
		}
	}
	for _, id := range []int64{2, 5} {
		if h := diversions[id]; h.Kind != relay.Later || !strings.Contains(h.Reason, "earlier event") {
			t.Errorf("event %d behind a scheduled one: %+v, want it diverted after it", id, h)
		}
	}
}

// claimWork is a row the claim path claimed.
func claimWork(id int64, aggregate string) *relay.Work {
	ev := event(id, aggregate)
	ev.Status = "processing"
	return &relay.Work{Event: ev}
}

// claimRecorder records what SettleClaim writes.
type claimRecorder struct {
	mu      sync.Mutex
	settled map[int64]relay.Decision
}

func (r *claimRecorder) settle(_ context.Context, works []*relay.Work, _ string) ([]int64, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, w := range works {
		r.settled[w.Event.ID] = w.Decision
	}
	return nil, nil
}

func (r *claimRecorder) decision(id int64) (relay.Decision, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, ok := r.settled[id]
	return d, ok
}

// TestEngine_ClaimAndStreamShareAggregateOrder: works of both paths of one
// aggregate go through the sink's lane one at a time in arrival order: a
// claimed row waits behind the stream's event in flight, and a streamed
// event behind a claimed row in flight; other aggregates pass them.
func TestEngine_ClaimAndStreamShareAggregateOrder(t *testing.T) {
	store := newFakeStore()
	rec := &claimRecorder{settled: map[int64]relay.Decision{}}
	claims := &fakeClaimStore{settleClaim: rec.settle}
	releases := map[int64]chan struct{}{1: make(chan struct{}), 21: make(chan struct{})}
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if ch, ok := releases[d.Event.ID]; ok {
			<-ch
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: store, Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink}}})
	c := e.Stream()
	ctx := context.Background()

	// A claimed row behind the stream's event.
	submit(t, c, event(1, "a"))
	c.Commit(100)
	waitFor(t, "event 1 sent", func() bool { return slices.Contains(sink.sentIDs(), 1) })
	if notTaken, err := e.SubmitClaimed(ctx, []*relay.Work{claimWork(11, "a"), claimWork(12, "other")}); err != nil || len(notTaken) != 0 {
		t.Fatalf("SubmitClaimed: %v, not taken %d", err, len(notTaken))
	}
	waitFor(t, "row 12 of another aggregate sent", func() bool { return slices.Contains(sink.sentIDs(), 12) })
	if slices.Contains(sink.sentIDs(), 11) {
		t.Fatal("claimed row 11 was sent while event 1 of its aggregate was in flight")
	}
	close(releases[1])
	waitFor(t, "row 11 settled", func() bool { _, ok := rec.decision(11); return ok })

	// A streamed event behind a claimed row.
	if _, err := e.SubmitClaimed(ctx, []*relay.Work{claimWork(21, "c")}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "row 21 sent", func() bool { return slices.Contains(sink.sentIDs(), 21) })
	submit(t, c, event(22, "c"), event(23, "other"))
	c.Commit(200)
	waitFor(t, "event 23 of another aggregate sent", func() bool { return slices.Contains(sink.sentIDs(), 23) })
	if slices.Contains(sink.sentIDs(), 22) {
		t.Fatal("event 22 was sent while claimed row 21 of its aggregate was in flight")
	}
	close(releases[21])
	waitSettledAt(t, c, 200)
	waitFor(t, "row 21 settled", func() bool { _, ok := rec.decision(21); return ok })

	ids := sink.sentIDs()
	pos := func(id int64) int { return slices.Index(ids, id) }
	if pos(1) > pos(11) || pos(21) > pos(22) {
		t.Fatalf("send order %v: want 1 before 11 and 21 before 22", ids)
	}
	for _, id := range []int64{11, 12, 21} {
		if d, _ := rec.decision(id); d.Kind != relay.Done {
			t.Fatalf("claimed row %d settled as %+v, want done", id, d)
		}
	}
	delivered, _, _ := store.snapshot()
	if delivered[relay.LedgerKey{EventKey: "k1", Action: "s"}] != 1 || delivered[relay.LedgerKey{EventKey: "k22", Action: "s"}] != 1 {
		t.Fatalf("stream delivered %v", delivered)
	}
}

// TestEngine_UnwrittenDivertDefersClaimWork: while the stream's diversion
// of an aggregate's event is decided but not yet in the table, the claim
// query cannot see it, so a claimed later row of that aggregate is put
// back (ordering) instead of sent; once the diversion is written, claimed
// rows of the aggregate go out.
func TestEngine_UnwrittenDivertDefersClaimWork(t *testing.T) {
	store := newFakeStore()
	gate, atGate := make(chan struct{}), make(chan struct{})
	var once sync.Once
	write := store.settleStream
	store.settleStream = func(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
		for _, w := range works {
			if w.Event.ID == 1 {
				once.Do(func() { close(atGate) })
				<-gate
			}
		}
		return write(ctx, works, owner)
	}
	rec := &claimRecorder{settled: map[int64]relay.Decision{}}
	claims := &fakeClaimStore{settleClaim: rec.settle}
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if d.Event.ID == 1 {
			return relay.TransientError(errors.New("503"), 0)
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: store, Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink}},
		Policy: relay.Policy{InlineAttempts: 0}})
	c := e.Stream()
	submit(t, c, event(1, "a"))
	c.Commit(100)
	<-atGate // decided (the aggregate is diverted), not written

	if _, err := e.SubmitClaimed(context.Background(), []*relay.Work{claimWork(11, "a")}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "row 11 settled", func() bool { _, ok := rec.decision(11); return ok })
	d, _ := rec.decision(11)
	if d.Kind != relay.Later || d.Why != "ordering" || !strings.Contains(d.Reason, "being diverted") || d.Attempts != 0 {
		t.Fatalf("row 11 settled as %+v, want put back for ordering without an attempt", d)
	}
	if slices.Contains(sink.sentIDs(), 11) {
		t.Fatal("row 11 was sent before the diversion of event 1 was written")
	}

	close(gate)
	waitSettledAt(t, c, 100)
	sink.setSend(nil)
	if _, err := e.SubmitClaimed(context.Background(), []*relay.Work{claimWork(1, "a")}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "row 1 settled on the claim path", func() bool { d, ok := rec.decision(1); return ok && d.Kind == relay.Done })
}

// TestEngine_RenewsLeasesOfClaimWorkInFlight: while a claimed row is being
// delivered the engine extends its lease (every third of ClaimLease), and
// stops once the row is settled.
func TestEngine_RenewsLeasesOfClaimWorkInFlight(t *testing.T) {
	type call struct {
		ids   []int64
		owner string
	}
	calls := make(chan call, 100)
	claims := &fakeClaimStore{extendLeases: func(_ context.Context, ids []int64, owner string) error {
		ids = slices.Clone(ids)
		slices.Sort(ids)
		select {
		case calls <- call{ids, owner}:
		default:
		}
		return nil
	}}
	release := map[int64]chan struct{}{11: make(chan struct{}), 12: make(chan struct{})}
	sink := newFakeSink("s", func(d *relay.Delivery) error { <-release[d.Event.ID]; return nil })
	e := startEngine(t, relay.EngineConfig{Stream: newFakeStore(), Claim: claims, Owner: "me", ClaimLease: 300 * time.Millisecond,
		Routes: []relay.Route{{Sink: sink}}})
	if _, err := e.SubmitClaimed(context.Background(), []*relay.Work{claimWork(11, "a"), claimWork(12, "b")}); err != nil {
		t.Fatal(err)
	}
	next := func() call {
		t.Helper()
		select {
		case c := <-calls:
			return c
		case <-time.After(20 * time.Second):
			t.Fatal("no lease renewal")
			return call{}
		}
	}
	c := next()
	if len(c.ids) < 2 { // a renewal between the two rows' admissions
		c = next()
	}
	if !slices.Equal(c.ids, []int64{11, 12}) || c.owner != "me" {
		t.Fatalf("ExtendLeases(%v, %q), want rows 11 and 12 of owner me", c.ids, c.owner)
	}
	close(release[11])
	for c := next(); !slices.Equal(c.ids, []int64{12}); c = next() {
		if !slices.Equal(c.ids, []int64{11, 12}) {
			t.Fatalf("ExtendLeases(%v), want rows 11 and 12, then row 12 once row 11 is settled", c.ids)
		}
	}
	for range 2 {
		if c := next(); !slices.Equal(c.ids, []int64{12}) {
			t.Fatalf("ExtendLeases(%v) after row 11 settled, want row 12 only", c.ids)
		}
	}
	close(release[12])
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := e.WaitPathSettled(ctx, relay.PathClaim); err != nil {
		t.Fatal(err)
	}
}

// TestEngine_RunLeavesNoGoroutines: once Run returns, every goroutine the
// engine started has ended — lanes with inline retries waiting on their
// timers, the settle loops and lease renewal — whether it was
// drained first or not.
func TestEngine_RunLeavesNoGoroutines(t *testing.T) {
	for _, drain := range []bool{true, false} {
		t.Run(fmt.Sprintf("drained=%v", drain), func(t *testing.T) {
			before := runtime.NumGoroutine()
			sink := newFakeSink("s", func(d *relay.Delivery) error {
				if d.Event.ID%2 == 0 {
					return relay.TransientError(errors.New("503"), 0)
				}
				return nil
			})
			var renewals atomic.Int32
			claims := &fakeClaimStore{extendLeases: func(context.Context, []int64, string) error { renewals.Add(1); return nil }}
			e, err := relay.NewEngine(relay.EngineConfig{Stream: newFakeStore(), Claim: claims, Owner: "me",
				Routes: []relay.Route{{Sink: sink}}, Policy: relay.Policy{InlineAttempts: 5, LaneBlockMax: 10 * time.Second},
				Logger: testLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			runDone := make(chan error, 1)
			go func() { runDone <- e.Run(ctx) }()
			c := e.Stream()
			for i := int64(1); i <= 20; i++ {
				submit(t, c, event(i, fmt.Sprint(i)))
				c.Commit(relay.LSN(i * 10))
			}
			if _, err := e.SubmitClaimed(ctx, []*relay.Work{claimWork(101, "x"), claimWork(102, "y")}); err != nil {
				t.Fatal(err)
			}
			// The even events fail and wait for their inline retries.
			waitFor(t, "failed sends", func() bool { return e.Stats.Retried.Load() >= 10 })
			if drain {
				dctx, dcancel := context.WithTimeout(ctx, 20*time.Second)
				defer dcancel()
				if err := e.Drain(dctx); err != nil {
					t.Fatal(err)
				}
			}
			cancel()
			select {
			case <-runDone:
			case <-time.After(20 * time.Second):
				t.Fatal("Run did not return after its ctx ended")
			}
			buf := make([]byte, 1<<20)
			deadline := time.Now().Add(20 * time.Second)
			for runtime.NumGoroutine() > before {
				if time.Now().After(deadline) {
					t.Fatalf("%d goroutines after Run returned, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
}

// TestEngine_RowDataErrorDoesNotStallSettlement: a row whose data the
// store refuses is written again at once, not after the database backoff
// (RetryDelay: 100 ms doubling) meant for a server that is down: the error
// is the row's, so waiting changes nothing, and the path's one settle loop
// would hold every decision queued behind the row — and with them the
// acknowledgement and, at MaxUnsettled, the stream — for at least 6.3 s
// (the six waits before it is given up) per refused row.
func TestEngine_RowDataErrorDoesNotStallSettlement(t *testing.T) {
	t.Parallel()
	store := newFakeStore()
	refused := make(chan struct{})
	var once sync.Once
	write := store.settleStream
	store.settleStream = func(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
		for _, w := range works {
			if w.Event.ID == 1 {
				once.Do(func() { close(refused) })
				return nil, fmt.Errorf("settle: ERROR: value too long (SQLSTATE 22001): %w", relay.ErrRowData)
			}
		}
		return write(ctx, works, owner)
	}
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: newFakeSink("s", nil)}}})
	c := e.Stream()
	submit(t, c, event(1, "a"))
	c.Commit(100)
	<-refused
	start := time.Now()
	var batch []*relay.Event
	for i := int64(2); i <= 5; i++ {
		batch = append(batch, event(i, fmt.Sprint(i)))
	}
	submit(t, c, batch...)
	c.Commit(200)
	waitSettledAt(t, c, 200)
	// Without waits the refused row costs seven round trips; 3 s leaves
	// room for a loaded machine and is half the shortest stall.
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("events decided after a refused row settled %v later, want at once", took.Round(time.Millisecond))
	}
}

// TestEngine_SubmitClaimedBatchLargerThanMaxUnsettled: a claim batch larger
// than MaxUnsettled (source.batch_size above it) is taken a part at a time.
// Before, the engine asked for room for the whole batch at once, more than
// it ever has, and SubmitClaimed waited until its ctx ended: the claim path
// stalled with the batch's rows locked.
func TestEngine_SubmitClaimedBatchLargerThanMaxUnsettled(t *testing.T) {
	const maxUnsettled, rows = 4, 10
	rec := &claimRecorder{settled: map[int64]relay.Decision{}}
	claims := &fakeClaimStore{settleClaim: rec.settle}
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Stream: newFakeStore(), Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink}},
		LaneCapacity: 2, MaxUnsettled: maxUnsettled})
	var works []*relay.Work
	for i := int64(1); i <= rows; i++ {
		works = append(works, claimWork(i, fmt.Sprint(i)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if notTaken, err := e.SubmitClaimed(ctx, works); err != nil || len(notTaken) != 0 {
		t.Fatalf("SubmitClaimed of %d rows with MaxUnsettled %d: %v, %d not taken", rows, maxUnsettled, err, len(notTaken))
	}
	if err := e.WaitPathSettled(ctx, relay.PathClaim); err != nil {
		t.Fatal(err)
	}
	for i := int64(1); i <= rows; i++ {
		if d, _ := rec.decision(i); d.Kind != relay.Done {
			t.Fatalf("row %d settled as %+v, want done", i, d)
		}
	}
}

// TestEngine_EarlyDivertKeepsTheInFlightEventsOrder: an event of an
// aggregate that goes to the claim path as it enters its lane (the sink's
// circuit is open) must not disturb the aggregate's event already in flight:
// a claimed row of that aggregate arriving later still waits behind it.
func TestEngine_EarlyDivertKeepsTheInFlightEventsOrder(t *testing.T) {
	store := newFakeStore()
	rec := &claimRecorder{settled: map[int64]relay.Decision{}}
	claims := &fakeClaimStore{settleClaim: rec.settle}
	release := make(chan struct{})
	var down atomic.Bool
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		switch {
		case d.Event.ID == 1:
			<-release
		case d.Event.ID == 2 && !down.Swap(true):
			return relay.SinkDownError(errors.New("down"), 300*time.Millisecond)
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: store, Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink}},
		Policy: relay.Policy{Backoff: []time.Duration{time.Hour}}})
	c := e.Stream()
	submit(t, c, event(1, "a"))
	waitFor(t, "event 1 in flight", func() bool { return slices.Contains(sink.sentIDs(), 1) })
	submit(t, c, event(2, "b")) // opens the circuit
	waitFor(t, "the circuit open", func() bool { return slices.Contains(sink.sentIDs(), 2) })
	submit(t, c, event(3, "a")) // diverted as it enters: the circuit is open
	c.Commit(100)
	time.Sleep(400 * time.Millisecond) // the circuit closes
	if _, err := e.SubmitClaimed(context.Background(), []*relay.Work{claimWork(11, "a")}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if slices.Contains(sink.sentIDs(), 11) {
		t.Fatalf("claimed row 11 of aggregate a was sent while event 1 of it was in flight (sent %v)", sink.sentIDs())
	}
	close(release)
	waitFor(t, "row 11 settled", func() bool { _, ok := rec.decision(11); return ok })
}

// panickySink panics on its first Send: a bug in a sink.
type panickySink struct{}

func (panickySink) Name() string                                       { return "buggy" }
func (panickySink) Send(context.Context, *relay.Delivery, func(error)) { panic("sink bug") }
func (panickySink) Close(context.Context) error                        { return nil }

// TestEngine_WorkerFailureEndsRun: a lane whose worker fails (here its
// sink panics) ends Run with an error that names it, and the other workers
// stop: the owner reports it and stops instead of waiting on its context
// while a part of the engine is dead. A wait for settlement ends then too.
func TestEngine_WorkerFailureEndsRun(t *testing.T) {
	e, err := relay.NewEngine(relay.EngineConfig{Stream: newFakeStore(), Routes: []relay.Route{{Sink: panickySink{}}}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- e.Run(context.Background()) }()
	c := e.Stream()
	submit(t, c, event(1, "a"))
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "lane buggy") || !strings.Contains(err.Error(), "sink bug") {
			t.Fatalf("Run = %v, want the lane's failure", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after a lane failed")
	}
	// The event the lane failed on is never settled: a wait for it ends
	// as soon as it starts, because Run has returned.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.Drain(ctx); !errors.Is(err, relay.ErrEngineStopped) {
		t.Fatalf("Drain after Run returned = %v, want ErrEngineStopped", err)
	}
}

// TestEngine_HaltStopsSending: once the relay knows its lease is gone
// (Halt), nothing more is sent — not the events queued behind an
// aggregate's event in flight, not an inline retry — and the sends in
// flight are cancelled; the events not sent settle as diversions
// ("stopping"), so the term ends at once instead of finishing its queue.
func TestEngine_HaltStopsSending(t *testing.T) {
	store := newFakeStore()
	var inFlightCancelled atomic.Int32
	sink := &ctxSink{name: "s", hold: 200 * time.Millisecond, cancelled: &inFlightCancelled}
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}}})
	c := e.Stream()
	var evs []*relay.Event
	for i := int64(1); i <= 40; i++ {
		evs = append(evs, event(i, "one")) // one aggregate: one in flight, 39 queued
	}
	submit(t, c, evs...)
	c.Commit(100)
	waitFor(t, "the first send", func() bool { return sink.sends.Load() >= 1 })
	e.Halt()
	sentAtHalt := sink.sends.Load()
	time.Sleep(600 * time.Millisecond) // three more sends' worth
	if n := sink.sends.Load(); n != sentAtHalt {
		t.Fatalf("%d sends after Halt (%d before), want none", n-sentAtHalt, sentAtHalt)
	}
	if inFlightCancelled.Load() == 0 {
		t.Error("the send in flight at Halt was not cancelled")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.WaitSettled(ctx); err != nil {
		t.Fatalf("the events not sent did not settle after Halt: %v", err)
	}
	_, diversions, _ := store.snapshot()
	if len(diversions) < 39 {
		t.Errorf("%d diversions, want the 39 events not sent (at least)", len(diversions))
	}
}

// ctxSink holds each send for hold, or until its context ends (it counts
// that); it answers nil.
type ctxSink struct {
	name      string
	hold      time.Duration
	sends     atomic.Int32
	cancelled *atomic.Int32
}

func (s *ctxSink) Name() string { return s.name }
func (s *ctxSink) Send(ctx context.Context, _ *relay.Delivery, done func(error)) {
	s.sends.Add(1)
	go func() {
		select {
		case <-time.After(s.hold):
			done(nil)
		case <-ctx.Done():
			s.cancelled.Add(1)
			done(ctx.Err())
		}
	}()
}
func (s *ctxSink) Close(context.Context) error { return nil }

// TestEngine_ClaimWorkNotSentPastItsLease: a claimed row's lease lets
// another relay's sweeper take it over once it passes. When the renewals
// fail (the database refuses them), the engine trusts a claimed row only
// until its lease, less a margin, has passed since it was claimed or last
// renewed: the rows of an aggregate still queued then are not sent, and
// settle back to the claim path, instead of reaching the sink beside the
// relay that took them over.
func TestEngine_ClaimWorkNotSentPastItsLease(t *testing.T) {
	claims := &fakeClaimStore{extendLeases: func(context.Context, []int64, string) error { return errors.New("database unreachable") }}
	var sends atomic.Int32
	sink := newFakeSink("s", func(*relay.Delivery) error { sends.Add(1); time.Sleep(150 * time.Millisecond); return nil })
	const lease = time.Second
	e := startEngine(t, relay.EngineConfig{Stream: newFakeStore(), Claim: claims, Owner: "me", ClaimLease: lease,
		Routes: []relay.Route{{Sink: sink}}})
	var works []*relay.Work
	for i := int64(1); i <= 20; i++ {
		works = append(works, claimWork(i, "hot")) // one aggregate: one at a time, 150 ms each
	}
	start := time.Now()
	if _, err := e.SubmitClaimed(context.Background(), works); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.WaitPathSettled(ctx, relay.PathClaim); err != nil {
		t.Fatal(err)
	}
	n := sends.Load()
	if max := int32(lease/(150*time.Millisecond)) + 1; n > max || n < 2 {
		t.Fatalf("%d of 20 rows sent within %v of a lease of %v that no renewal extended, want a few and at most %d", n, time.Since(start).Round(time.Millisecond), lease, max)
	}
}

// TestEngine_UndivertAsksOnlyAboutDivertedAggregates: a claim-path
// settlement asks the store about the aggregates the stream diverts, and
// only those (docs/guarantees.md "Claim runs"): a settlement of rows of
// aggregates nobody diverts (poll mode) costs no round trip, and a
// diverted aggregate's next event goes by the stream as soon as the claim
// path has settled its run.
func TestEngine_UndivertAsksOnlyAboutDivertedAggregates(t *testing.T) {
	store := newFakeStore()
	store.divertedAggs = []relay.AggregateKey{{Type: "order", ID: "diverted"}}
	rec := &claimRecorder{settled: map[int64]relay.Decision{}}
	var (
		mu    sync.Mutex
		asked [][]relay.AggregateKey
	)
	claims := &fakeClaimStore{settleClaim: rec.settle,
		settledAggregates: func(_ context.Context, aggs []relay.AggregateKey) ([]relay.AggregateKey, error) {
			mu.Lock()
			defer mu.Unlock()
			asked = append(asked, slices.Clone(aggs))
			return aggs, nil
		}}
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Stream: store, Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink}}})
	ctx := context.Background()

	if _, err := e.SubmitClaimed(ctx, []*relay.Work{claimWork(1, "calm"), claimWork(2, "calm"), claimWork(3, "other")}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "rows 1-3 settled", func() bool { _, ok := rec.decision(3); _, ok2 := rec.decision(2); return ok && ok2 })
	mu.Lock()
	if len(asked) != 0 {
		t.Errorf("settling rows of aggregates nobody diverts asked the store %v, want no question", asked)
	}
	mu.Unlock()

	if _, err := e.SubmitClaimed(ctx, []*relay.Work{claimWork(4, "diverted"), claimWork(5, "diverted"), claimWork(6, "calm")}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the diverted aggregate checked", func() bool { mu.Lock(); defer mu.Unlock(); return len(asked) > 0 })
	mu.Lock()
	if want := []relay.AggregateKey{{Type: "order", ID: "diverted"}}; len(asked) != 1 || !slices.Equal(asked[0], want) {
		t.Errorf("asked the store %v, want %v once", asked, want)
	}
	mu.Unlock()

	// The stream delivers the aggregate's next event itself.
	c := e.Stream()
	submit(t, c, event(7, "diverted"))
	c.Commit(100)
	waitSettledAt(t, c, 100)
	if !slices.Contains(sink.sentIDs(), 7) {
		_, diversions, _ := store.snapshot()
		t.Fatalf("event 7 not sent by the stream after its aggregate's run settled (diversions %v)", diversions)
	}
}

// TestEngine_StreamDivertWakesTheClaimPath: once the stream has written a
// diversion, the claim path is woken (OnClaimSettled) to take it at once,
// not at its next poll: a diverted aggregate's fresh events wait on the
// claim path for one claim, not for poll_interval.
func TestEngine_StreamDivertWakesTheClaimPath(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Stream: store, Claim: &fakeClaimStore{}, Owner: "me", Routes: []relay.Route{{Sink: sink}}})
	var woken atomic.Int32
	e.OnClaimSettled(func() { woken.Add(1) })
	c := e.Stream()

	submit(t, c, event(1, "a"))
	c.Commit(100)
	waitSettledAt(t, c, 100)
	if n := woken.Load(); n != 0 {
		t.Fatalf("a delivered stream event woke the claim path %d times", n)
	}

	later := event(2, "a")
	later.AvailableAt = time.Now().Add(time.Hour) // scheduled: diverted
	submit(t, c, later)
	c.Commit(200)
	waitSettledAt(t, c, 200)
	if _, diversions, _ := store.snapshot(); len(diversions) != 1 {
		t.Fatalf("diversions %v, want event 2's", diversions)
	}
	if n := woken.Load(); n != 1 {
		t.Fatalf("the stream's diversion woke the claim path %d times, want once", n)
	}
}

// TestEngine_RunStopsAtItsFirstUndeliveredRow: a claimed run's later row is
// never sent once an earlier row of the run failed in the same lane, even
// when the earlier row's settlement is already written by the time the
// later row gets room in the lane (docs/guarantees.md "Claim runs"). The
// lane's queue per aggregate covers rows that wait behind one in flight;
// this is the row that was still waiting for room when the queue emptied.
func TestEngine_RunStopsAtItsFirstUndeliveredRow(t *testing.T) {
	rec := &claimRecorder{settled: map[int64]relay.Decision{}}
	claims := &fakeClaimStore{settleClaim: rec.settle}
	release := make(chan struct{})
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		switch d.Event.ID {
		case 1:
			return errors.New("503 Service Unavailable")
		case 2:
			<-release // holds the lane's only slot
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: newFakeStore(), Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink}},
		LaneCapacity: 1, MaxUnsettled: 16})
	submitted := make(chan error, 1)
	go func() {
		// Rows 1 and 3 are one run of aggregate a; row 2 (aggregate x)
		// sits between them in id order.
		_, err := e.SubmitClaimed(context.Background(), []*relay.Work{claimWork(1, "a"), claimWork(2, "x"), claimWork(3, "a")})
		submitted <- err
	}()
	waitFor(t, "row 1 settled for a retry", func() bool { d, ok := rec.decision(1); return ok && d.Kind == relay.Later })
	close(release)
	if err := <-submitted; err != nil {
		t.Fatal(err)
	}
	waitFor(t, "rows 2 and 3 settled", func() bool { _, ok2 := rec.decision(2); _, ok3 := rec.decision(3); return ok2 && ok3 })
	if ids := sink.sentIDs(); slices.Contains(ids, 3) {
		t.Fatalf("sent %v: row 3 went out while row 1 of its run waits for a retry", ids)
	}
	if d, _ := rec.decision(3); d.Kind != relay.Later {
		t.Fatalf("row 3 decided %v, want Later (back to the claim path behind row 1)", d.Kind)
	}
}

// TestEngine_HaltStopsAClaimRun: a lost lock (Halt) while a claimed run is
// out: the run's row already written to the sink completes, and none of
// its later rows, queued behind it or waiting for room in the lane, is
// sent; they settle back to the claim path without an attempt, so the next
// owner goes on from the run's first undelivered row (docs/guarantees.md,
// "Claim runs").
func TestEngine_HaltStopsAClaimRun(t *testing.T) {
	rec := &claimRecorder{settled: map[int64]relay.Decision{}}
	claims := &fakeClaimStore{settleClaim: rec.settle}
	sent := make(chan struct{})
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if d.Event.ID == 1 {
			close(sent)
			time.Sleep(100 * time.Millisecond) // written: Halt does not undo it
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: newFakeStore(), Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink}},
		LaneCapacity: 2, MaxUnsettled: 64})
	var run []*relay.Work
	for i := int64(1); i <= 20; i++ {
		run = append(run, claimWork(i, "a"))
	}
	submitted := make(chan error, 1)
	go func() {
		_, err := e.SubmitClaimed(context.Background(), run)
		submitted <- err
	}()
	<-sent
	e.Halt()
	if err := <-submitted; err != nil {
		t.Fatal(err)
	}
	waitFor(t, "all 20 rows settled", func() bool {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return len(rec.settled) == 20
	})
	if ids := sink.sentIDs(); !slices.Equal(ids, []int64{1}) {
		t.Fatalf("sent %v, want only the run's first row (written before Halt)", ids)
	}
	if d, _ := rec.decision(1); d.Kind != relay.Done {
		t.Errorf("row 1 decided %v, want Done", d.Kind)
	}
	for i := int64(2); i <= 20; i++ {
		if d, _ := rec.decision(i); d.Kind != relay.Later || d.Attempts != 0 {
			t.Fatalf("row %d decided %v after %d attempts, want Later without an attempt (back to the claim path)", i, d.Kind, d.Attempts)
		}
	}
}

// TestEngine_HandOverRowsGoBeforeTheirAggregatesStreamedEvents: the rows
// of a new slot's hand-over (Consumer.HandOver) are delivered through the
// lanes, their aggregates pinned (Consumer.Divert) until they are queued:
// a streamed event of a pinned aggregate is diverted (it follows in the
// claim path, whose ordering check waits for the rows before it), one of an
// aggregate released after its rows were queued goes out behind them, and
// the hand-over's rows pass the pin — but not a diversion: a row of an
// aggregate with an earlier row at the claim path (in the table, or a
// streamed event diverted while the pin held) follows it there. They
// hold back no slot position, and HandOverSettled returns once they are
// settled. A Restart ends a pin its session left.
func TestEngine_HandOverRowsGoBeforeTheirAggregatesStreamedEvents(t *testing.T) {
	store := newFakeStore()
	z := relay.AggregateKey{Type: "order", ID: "z"}
	store.divertedAggs = []relay.AggregateKey{z} // a row of z is at the claim path
	gate := make(chan struct{})
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if d.Event.ID < 10 {
			<-gate // the hand-over's rows wait until the test lets them go
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}}})
	ctx := context.Background()
	c := e.Stream()
	x, y := relay.AggregateKey{Type: "order", ID: "x"}, relay.AggregateKey{Type: "order", ID: "y"}
	release := c.Divert([]relay.AggregateKey{x, y, z})

	// Streamed before any row is queued: x's event is diverted, the
	// other aggregate's goes out.
	submit(t, c, event(100, "x"), event(101, "other"))
	c.Commit(100)
	waitSettledAt(t, c, 100)
	if sent := sink.sentIDs(); !slices.Equal(sent, []int64{101}) {
		t.Fatalf("sent %v: want only 101 (100's aggregate is pinned)", sent)
	}
	if _, diversions, _ := store.snapshot(); diversions[100].Kind != relay.Later {
		t.Fatalf("event 100 of a pinned aggregate: diversions %v, want it diverted to the claim path", diversions)
	}

	// The hand-over's rows pass the pin (y's); x's follow event 100 and
	// z's the row at the claim path.
	if err := c.HandOver(ctx, []*relay.Event{event(1, "y"), event(2, "y"), event(3, "x"), event(4, "z")}); err != nil {
		t.Fatal(err)
	}
	release([]relay.AggregateKey{x, y, z})
	// y's next streamed event queues behind y's rows; x's follows event
	// 100 to the claim path. The slot's position passes them all although
	// the hand-over's rows are not settled.
	submit(t, c, event(102, "y"), event(103, "x"))
	c.Commit(200)
	waitFor(t, "row 1 sent", func() bool { return slices.Contains(sink.sentIDs(), 1) })
	if slices.Contains(sink.sentIDs(), 102) {
		t.Fatalf("sent %v: 102 overtook its aggregate's rows", sink.sentIDs())
	}
	if err := func() error {
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		return c.HandOverSettled(short)
	}(); err == nil {
		t.Fatal("HandOverSettled returned while the rows were in flight")
	}
	close(gate)
	waitSettledAt(t, c, 200)
	if err := c.HandOverSettled(ctx); err != nil {
		t.Fatal(err)
	}
	sent := sink.sentIDs()
	if i1, i2, i102 := slices.Index(sent, 1), slices.Index(sent, 2), slices.Index(sent, 102); i1 < 0 || i2 < i1 || i102 < i2 {
		t.Errorf("sent %v: want 1, 2, then 102", sent)
	}
	delivered, diversions, _ := store.snapshot()
	for _, id := range []int64{3, 4, 103} {
		if slices.Contains(sent, id) || diversions[id].Kind != relay.Later {
			t.Errorf("%d: sent %v, diversions %v; want it diverted to the claim path behind the earlier event of its aggregate", id, sent, diversions)
		}
	}
	for _, id := range []int64{1, 2} {
		if delivered[relay.LedgerKey{EventKey: fmt.Sprintf("k%d", id), Action: "s"}] != 1 {
			t.Errorf("row %d: no delivered ledger row written (%v)", id, delivered)
		}
	}

	// A pin left by a session that ended before its hand-over is ended by
	// the next session's Restart.
	c.Divert([]relay.AggregateKey{{Type: "order", ID: "left"}})
	if err := c.Restart(ctx, 0); err != nil {
		t.Fatal(err)
	}
	submit(t, c, event(104, "left"))
	c.Commit(300)
	waitSettledAt(t, c, 300)
	if !slices.Contains(sink.sentIDs(), 104) {
		t.Fatalf("sent %v: want event 104 streamed: the pin ended with the Restart", sink.sentIDs())
	}
}

// TestEngine_HandOverWaitsForItsLane: a hand-over's row waits for room in a
// full lane, however long, instead of being diverted to the claim path after
// lane_block_max as a streamed event is: nothing acknowledges the slot
// behind it.
func TestEngine_HandOverWaitsForItsLane(t *testing.T) {
	store := newFakeStore()
	gate := make(chan struct{})
	sink := newFakeSink("s", func(*relay.Delivery) error { <-gate; return nil })
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}}, LaneCapacity: 1, MaxUnsettled: 100,
		Policy: relay.Policy{LaneBlockMax: 20 * time.Millisecond}})
	c := e.Stream()
	done := make(chan error, 1)
	go func() {
		done <- c.HandOver(context.Background(), []*relay.Event{event(1, "a"), event(2, "b"), event(3, "c")})
	}()
	time.Sleep(200 * time.Millisecond) // ten times lane_block_max
	close(gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := c.HandOverSettled(context.Background()); err != nil {
		t.Fatal(err)
	}
	delivered, diversions, _ := store.snapshot()
	if len(diversions) != 0 || len(delivered) != 3 {
		t.Errorf("delivered %v, diverted %v: want all three delivered, none diverted", delivered, diversions)
	}
}

// TestEngine_HandOverLatencyFromCreation: a hand-over's row has no commit
// time (it was read, not decoded): its delivery latency counts from its
// created_at, not from the zero time.
func TestEngine_HandOverLatencyFromCreation(t *testing.T) {
	const sinkName = "hand-over-latency"
	store := newFakeStore()
	sink := newFakeSink(sinkName, nil)
	e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}}})
	ev := event(1, "a")
	ev.CreatedAt = time.Now().Add(-2 * time.Second)
	c := e.Stream()
	if err := c.HandOver(context.Background(), []*relay.Event{ev}); err != nil {
		t.Fatal(err)
	}
	if err := c.HandOverSettled(context.Background()); err != nil {
		t.Fatal(err)
	}
	families, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	var count uint64
	for _, f := range families {
		if f.GetName() != "outbox_relay_delivery_latency_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "sink" && l.GetValue() == sinkName {
					sum, count = sum+m.GetHistogram().GetSampleSum(), count+m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	if count != 1 || sum < 2 || sum > 60 {
		t.Errorf("delivery latency of the hand-over's row: %d samples summing to %.0f s, want one of about 2 s", count, sum)
	}
}
