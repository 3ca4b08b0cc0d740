package relay_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// fakeStore records what the engine writes.
type fakeStore struct {
	mu           sync.Mutex
	delivered    map[relay.LedgerKey]int
	handOffs     map[int64]relay.HandOff
	deadLetters  map[int64]string
	done         map[int64]bool
	restreamed   map[int64]relay.RowState
	diverted     []relay.AggregateKey
	settleErr    func() error  // optional failure injection
	invisibleFor map[int64]int // row changes to report invisible this many times
	settles      int           // Settle calls that wrote something
}

func newFakeStore() *fakeStore {
	return &fakeStore{delivered: map[relay.LedgerKey]int{}, handOffs: map[int64]relay.HandOff{},
		deadLetters: map[int64]string{}, done: map[int64]bool{}, invisibleFor: map[int64]int{}}
}

func (s *fakeStore) Settle(_ context.Context, st relay.Settlement) ([]int64, error) {
	if s.settleErr != nil {
		if err := s.settleErr(); err != nil {
			return nil, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.settles++
	for _, k := range st.Delivered {
		s.delivered[k]++
	}
	for _, h := range st.HandOffs {
		s.handOffs[h.ID] = h
	}
	for _, d := range st.DeadLetters {
		s.deadLetters[d.ID] = d.LastError
	}
	var invisible []int64
	for id, n := range s.invisibleFor {
		if n > 0 {
			s.invisibleFor[id]--
			invisible = append(invisible, id)
			delete(s.handOffs, id)
			delete(s.deadLetters, id)
		}
	}
	return invisible, nil
}

func (s *fakeStore) Restreamed(_ context.Context, events []*relay.Event) (map[int64]relay.RowState, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[int64]relay.RowState{}
	for _, e := range events {
		if st, ok := s.restreamed[e.ID]; ok {
			out[e.ID] = st
		}
	}
	return out, nil
}

func (s *fakeStore) MarkDone(_ context.Context, ids []int64) ([]int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var invisible []int64
	for _, id := range ids {
		if s.invisibleFor[id] > 0 {
			s.invisibleFor[id]--
			invisible = append(invisible, id)
			continue
		}
		s.done[id] = true
	}
	return invisible, nil
}

func (s *fakeStore) Diverted(context.Context) ([]relay.AggregateKey, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.diverted, nil
}

func (s *fakeStore) snapshot() (delivered map[relay.LedgerKey]int, handOffs map[int64]relay.HandOff, dead map[int64]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps(s.delivered), maps(s.handOffs), maps(s.deadLetters)
}

func maps[K comparable, V any](m map[K]V) map[K]V {
	out := make(map[K]V, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// fakeSink answers with send; it records every call.
type fakeSink struct {
	name   string
	window chan struct{} // bounds concurrent sends, like a real sink
	send   func(d *relay.Delivery) error
	delay  func() time.Duration

	mu    sync.Mutex
	calls []relay.Delivery
}

func newFakeSink(name string, send func(d *relay.Delivery) error) *fakeSink {
	return &fakeSink{name: name, window: make(chan struct{}, 16), send: send}
}

func (s *fakeSink) Name() string { return s.name }

func (s *fakeSink) Send(ctx context.Context, d *relay.Delivery, done func(error)) {
	select {
	case s.window <- struct{}{}:
	case <-ctx.Done():
		done(ctx.Err())
		return
	}
	s.mu.Lock()
	s.calls = append(s.calls, *d)
	s.mu.Unlock()
	go func() {
		defer func() { <-s.window }()
		if s.delay != nil {
			time.Sleep(s.delay())
		}
		var err error
		if s.send != nil {
			err = s.send(d)
		}
		done(err)
	}()
}

func (s *fakeSink) Close(context.Context) error { return nil }

func (s *fakeSink) sent() []relay.Delivery {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

func str(s string) *string { return &s }

func event(id int64, aggregate string) *relay.Event {
	return &relay.Event{ID: id, EventKey: fmt.Sprintf("k%d", id), EventType: str("order.placed"),
		AggregateType: str("order"), AggregateID: str(aggregate), Payload: []byte(`{}`),
		CreatedAt: time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)}
}

func startEngine(t *testing.T, cfg relay.EngineConfig) *relay.Engine {
	t.Helper()
	cfg.Logger = zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
	e, err := relay.NewEngine(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { e.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return e
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestEngine_PerAggregateOrder: many aggregates, random delays and a
// concurrent sink; per aggregate, sends happen in id order, and every event
// is delivered exactly once and settled.
func TestEngine_PerAggregateOrder(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", nil)
	sink.delay = func() time.Duration { return time.Duration(rand.IntN(300)) * time.Microsecond }
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}, MarkDone: true})

	ctx := context.Background()
	const aggregates, perAggregate = 100, 20
	var id int64
	var end relay.LSN
	for range perAggregate {
		var batch []*relay.Event
		for a := range aggregates {
			id++
			batch = append(batch, event(id, fmt.Sprint(a)))
		}
		if err := e.Submit(ctx, batch); err != nil {
			t.Fatal(err)
		}
		end += 100
		e.Commit(end)
	}
	waitFor(t, "all settled", func() bool { lsn, _ := e.Settled(); return lsn == end })

	last := map[string]int64{}
	for _, d := range sink.sent() {
		agg := *d.Event.AggregateID
		if d.Event.ID <= last[agg] {
			t.Fatalf("aggregate %s: event %d sent after %d", agg, d.Event.ID, last[agg])
		}
		last[agg] = d.Event.ID
	}
	delivered, _, _ := store.snapshot()
	if len(delivered) != aggregates*perAggregate {
		t.Fatalf("delivered %d pairs, want %d", len(delivered), aggregates*perAggregate)
	}
	for k, n := range delivered {
		if n != 1 {
			t.Fatalf("%v recorded %d times", k, n)
		}
	}
	waitFor(t, "rows marked done", func() bool {
		store.mu.Lock()
		defer store.mu.Unlock()
		return len(store.done) == aggregates*perAggregate
	})
}

// TestEngine_AckWaitsForSlowTransaction: the settled position never passes
// the end of a transaction with an undelivered event, and a keepalive
// received after it waits too.
func TestEngine_AckWaitsForSlowTransaction(t *testing.T) {
	release := make(chan struct{})
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if d.Event.ID == 2 {
			<-release
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Store: newFakeStore(), Routes: []relay.Route{{Sink: sink}}})
	ctx := context.Background()

	e.Submit(ctx, []*relay.Event{event(1, "a")})
	e.Commit(100)
	e.Submit(ctx, []*relay.Event{event(2, "b")})
	e.Keepalive(150) // mid-transaction: must queue behind it
	e.Submit(ctx, []*relay.Event{event(3, "c")})
	e.Commit(200)
	e.Keepalive(300)
	waitFor(t, "first transaction settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	time.Sleep(100 * time.Millisecond)
	if lsn, _ := e.Settled(); lsn != 100 {
		t.Fatalf("settled %v while event 2 is in flight; want 0/64", lsn)
	}
	close(release)
	waitFor(t, "everything settled", func() bool { lsn, _ := e.Settled(); return lsn == 300 })
}

func TestEngine_SettledReportsPassedEvents(t *testing.T) {
	e := startEngine(t, relay.EngineConfig{Store: newFakeStore(), Routes: []relay.Route{{Sink: newFakeSink("s", nil)}}})
	e.Keepalive(50)
	if lsn, passed := e.Settled(); lsn != 50 || passed {
		t.Fatalf("keepalive only: %v %v, want 0/32 false", lsn, passed)
	}
	e.Submit(context.Background(), []*relay.Event{event(1, "a")})
	e.Commit(100)
	waitFor(t, "settled", func() bool {
		lsn, passed := e.Settled()
		if lsn == 100 && !passed {
			t.Fatal("passing a transaction with events was not reported")
		}
		return lsn == 100
	})
	if _, passed := e.Settled(); passed {
		t.Fatal("passed reported twice")
	}
}

// TestEngine_TransientThenHandOff: inline attempts, then the claim path; the
// aggregate's later events follow it, other aggregates keep flowing.
func TestEngine_TransientThenHandOff(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if *d.Event.AggregateID == "bad" {
			return relay.TransientError(errors.New("503 Service Unavailable"), 0)
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}, InlineAttempts: 3,
		Backoff: []time.Duration{time.Minute}})
	ctx := context.Background()
	e.Submit(ctx, []*relay.Event{event(1, "bad"), event(2, "good"), event(3, "bad"), event(4, "good")})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })

	delivered, handOffs, _ := store.snapshot()
	if len(delivered) != 2 || delivered[relay.LedgerKey{EventKey: "k2", Action: "s"}] != 1 {
		t.Fatalf("delivered %v", delivered)
	}
	h1, h3 := handOffs[1], handOffs[3]
	if h1.Attempts != 3 || !strings.Contains(h1.LastError, "503") || time.Until(h1.AvailableAt) < 50*time.Second {
		t.Fatalf("hand-off of event 1: %+v", h1)
	}
	if h3.ID != 3 || h3.Attempts != 0 || !strings.Contains(h3.LastError, "earlier event") {
		t.Fatalf("event 3 should follow event 1 to the claim path without an attempt: %+v", h3)
	}
	tries := 0
	for _, d := range sink.sent() {
		if d.Event.ID == 1 {
			tries++
			if d.Attempt != tries {
				t.Fatalf("attempt header %d on try %d", d.Attempt, tries)
			}
		}
		if d.Event.ID == 3 {
			t.Fatal("event 3 was sent while event 1 was with the claim path")
		}
	}
	if tries != 3 {
		t.Fatalf("event 1 tried %d times, want 3", tries)
	}

	// The aggregate stays diverted until the claim path settles it.
	e.Submit(ctx, []*relay.Event{event(5, "bad")})
	e.Commit(200)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 200 })
	if _, handOffs, _ = store.snapshot(); handOffs[5].ID != 5 {
		t.Fatal("a later event of a diverted aggregate was not handed off")
	}
	stale := e.DivertSeq() - 1 // a check that started before the last hand-off was written
	e.Undiverted(relay.AggregateKey{Type: "order", ID: "bad"}, stale)
	e.Submit(ctx, []*relay.Event{event(7, "bad")})
	e.Commit(250)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 250 })
	if _, handOffs, _ = store.snapshot(); handOffs[7].ID != 7 {
		t.Fatal("Undiverted with a sequence number from before the last hand-off cleared the mark")
	}
	e.Undiverted(relay.AggregateKey{Type: "order", ID: "bad"}, e.DivertSeq())
	sink.send = nil
	e.Submit(ctx, []*relay.Event{event(6, "bad")})
	e.Commit(300)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 300 })
	if delivered, _, _ = store.snapshot(); delivered[relay.LedgerKey{EventKey: "k6", Action: "s"}] != 1 {
		t.Fatal("after Undiverted the aggregate should stream again")
	}
}

func TestEngine_PermanentDeadLettersAndAggregateContinues(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if d.Event.ID == 1 {
			return relay.PermanentError(errors.New("400 Bad Request: invalid lead"))
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}})
	e.Submit(context.Background(), []*relay.Event{event(1, "a"), event(2, "a")})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	delivered, handOffs, dead := store.snapshot()
	if !strings.Contains(dead[1], "400 Bad Request") || !strings.Contains(dead[1], "sink s") {
		t.Fatalf("dead letter reason %q", dead[1])
	}
	if delivered[relay.LedgerKey{EventKey: "k2", Action: "s"}] != 1 || len(handOffs) != 0 {
		t.Fatalf("a failed event must not block its aggregate: delivered %v handOffs %v", delivered, handOffs)
	}
}

func TestEngine_MaxAttemptsDeadLetters(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", func(*relay.Delivery) error { return relay.UnknownError(errors.New("timeout")) })
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}, InlineAttempts: 3, MaxAttempts: 5})
	ev := event(1, "a")
	ev.Attempts = 3 // two more allowed
	e.Submit(context.Background(), []*relay.Event{ev})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	if _, _, dead := store.snapshot(); !strings.Contains(dead[1], "max_attempts") {
		t.Fatalf("dead letters %v", dead)
	}
	if n := len(sink.sent()); n != 2 {
		t.Fatalf("sent %d times, want 2", n)
	}
}

// TestEngine_SinkDownOpensCircuit: a sink-level failure opens the circuit;
// events go to the claim path at once and no attempt is counted.
func TestEngine_SinkDownOpensCircuit(t *testing.T) {
	store := newFakeStore()
	var down atomic.Bool
	down.Store(true)
	sink := newFakeSink("s", func(*relay.Delivery) error {
		if down.Load() {
			return relay.SinkDownError(errors.New("401 Unauthorized: check the credentials"), 0)
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}, Unordered: true})
	ctx := context.Background()
	e.Submit(ctx, []*relay.Event{event(1, "a")})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	var batch []*relay.Event
	for i := range 50 {
		batch = append(batch, event(int64(10+i), fmt.Sprint(i)))
	}
	e.Submit(ctx, batch)
	e.Commit(200)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 200 })

	_, handOffs, _ := store.snapshot()
	if len(handOffs) != 51 {
		t.Fatalf("%d hand-offs, want 51", len(handOffs))
	}
	for id, h := range handOffs {
		if h.Attempts != 0 {
			t.Fatalf("event %d: a sink-level failure counted %d attempts", id, h.Attempts)
		}
	}
	if n := len(sink.sent()); n != 1 {
		t.Fatalf("the sink was called %d times while its circuit was open, want 1", n)
	}
}

// TestEngine_BackPressureThenLaneBlockMax: a full lane blocks Submit; a lane
// blocked longer than lane_block_max hands the event off.
func TestEngine_BackPressureThenLaneBlockMax(t *testing.T) {
	store := newFakeStore()
	release := make(chan struct{})
	sink := newFakeSink("s", func(*relay.Delivery) error { <-release; return nil })
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}, LaneCapacity: 4,
		LaneBlockMax: 300 * time.Millisecond, Unordered: true})
	ctx := context.Background()
	var batch []*relay.Event
	for i := range 4 {
		batch = append(batch, event(int64(i+1), fmt.Sprint(i)))
	}
	e.Submit(ctx, batch)

	start := time.Now()
	e.Submit(ctx, []*relay.Event{event(5, "x")})
	if blocked := time.Since(start); blocked < 250*time.Millisecond {
		t.Fatalf("Submit into a full lane returned after %v, want about lane_block_max", blocked)
	}
	e.Commit(100)
	close(release)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	if _, handOffs, _ := store.snapshot(); !strings.Contains(handOffs[5].LastError, "lane_block_max") {
		t.Fatalf("hand-offs %v", handOffs)
	}
}

func TestEngine_Routing(t *testing.T) {
	store := newFakeStore()
	orders := newFakeSink("orders", nil)
	all := newFakeSink("all", nil)
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{
		{Sink: orders, Events: []string{"order.*"}}, {Sink: all, Events: []string{"*"}},
	}})
	lead := event(1, "a")
	lead.EventType = str("lead.created")
	null := event(2, "b")
	null.EventType = nil
	e.Submit(context.Background(), []*relay.Event{lead, null, event(3, "c")})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	ids := func(s *fakeSink) (out []int64) {
		for _, d := range s.sent() {
			out = append(out, d.Event.ID)
		}
		slices.Sort(out)
		return out
	}
	if got := ids(orders); !slices.Equal(got, []int64{3}) {
		t.Fatalf("orders got %v", got)
	}
	if got := ids(all); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("all got %v (a NULL event_type matches only *)", got)
	}
}

// TestEngine_Restreamed: after a restart, events the database shows settled
// or handed off are skipped, and sinks the ledger shows delivered are not
// sent again.
func TestEngine_Restreamed(t *testing.T) {
	store := newFakeStore()
	store.restreamed = map[int64]relay.RowState{
		1: {Owned: false},
		2: {Owned: true, Delivered: []string{"a"}},
		3: {Owned: true},
	}
	a, b := newFakeSink("a", nil), newFakeSink("b", nil)
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: a}, {Sink: b}}})
	if err := e.Restart(context.Background(), 1000); err != nil {
		t.Fatal(err)
	}
	evs := []*relay.Event{event(1, "x"), event(2, "y"), event(3, "z")}
	for _, ev := range evs {
		ev.CommitLSN = 500
	}
	e.Submit(context.Background(), evs)
	e.Commit(600)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 600 })
	if n := len(a.sent()); n != 1 {
		t.Fatalf("sink a got %d sends, want 1 (event 3)", n)
	}
	if n := len(b.sent()); n != 2 {
		t.Fatalf("sink b got %d sends, want 2 (events 2, 3)", n)
	}
	// Past the horizon nothing is checked.
	late := event(4, "w")
	late.CommitLSN = 2000
	store.restreamed[4] = relay.RowState{Owned: false}
	e.Submit(context.Background(), []*relay.Event{late})
	e.Commit(2100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 2100 })
	if n := len(a.sent()); n != 2 {
		t.Fatalf("an event committed after the horizon was filtered")
	}
}

func TestEngine_SettleRetriesAndHoldsAck(t *testing.T) {
	store := newFakeStore()
	var failures atomic.Int32
	failures.Store(3)
	store.settleErr = func() error {
		if failures.Add(-1) >= 0 {
			return errors.New("connection refused")
		}
		return nil
	}
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: newFakeSink("s", nil)}}})
	e.Submit(context.Background(), []*relay.Event{event(1, "a")})
	e.Commit(100)
	time.Sleep(50 * time.Millisecond)
	if lsn, _ := e.Settled(); lsn != 0 {
		t.Fatalf("settled %v before the ledger write succeeded", lsn)
	}
	waitFor(t, "settled after retries", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
}

func TestEngine_FutureAvailableAtGoesToClaimPath(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}})
	ev := event(1, "a")
	ev.AvailableAt = time.Now().Add(time.Hour)
	e.Submit(context.Background(), []*relay.Event{ev})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	if _, h, _ := store.snapshot(); h[1].ID != 1 || len(sink.sent()) != 0 {
		t.Fatalf("hand-offs %v, sends %d", h, len(sink.sent()))
	}
}

func TestEngine_DrainHandsOffWaitingRetries(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", func(*relay.Delivery) error { return relay.TransientError(errors.New("503"), 0) })
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}, InlineAttempts: 10})
	e.Submit(context.Background(), []*relay.Event{event(1, "a")})
	e.Commit(100)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if _, h, _ := store.snapshot(); h[1].ID != 1 {
		t.Fatalf("drain did not hand off the retrying event: %v", h)
	}
}

func TestEngine_SkipsRowsInsertedSettled(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}})
	done := event(1, "a")
	done.Status = "done"
	e.Submit(context.Background(), []*relay.Event{done, event(2, "a")})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	if sent := sink.sent(); len(sent) != 1 || sent[0].Event.ID != 2 {
		t.Fatalf("sent %v, want only event 2", sent)
	}
}

// fakeHolds is a HoldStore over a map of claims.
type fakeHolds struct {
	mu       sync.Mutex
	claims   map[relay.LedgerKey]string // owner, or "unknown"
	held     map[int64]string
	released int
}

func (h *fakeHolds) ClaimSending(_ context.Context, k relay.LedgerKey, owner string) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.claims[k]; ok {
		return false, nil
	}
	h.claims[k] = owner
	return true, nil
}

func (h *fakeHolds) Release(_ context.Context, k relay.LedgerKey, owner string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.claims[k] == owner {
		delete(h.claims, k)
		h.released++
	}
	return nil
}

func (h *fakeHolds) Hold(_ context.Context, id int64, k relay.LedgerKey, reason string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.claims[k] = "unknown"
	h.held[id] = reason
	return nil
}

func (h *fakeHolds) snapshot() (held map[int64]string, released int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return maps(h.held), h.released
}

// TestEngine_HoldUnknownOutcome: a hold sink claims before sending; an
// unknown outcome holds the row with no second request, and the aggregate's
// later events follow it; a transient failure that ends in a hand-off
// releases the claim; a claim refused before sending (a crash left it) holds.
func TestEngine_HoldUnknownOutcome(t *testing.T) {
	store := newFakeStore()
	holds := &fakeHolds{claims: map[relay.LedgerKey]string{}, held: map[int64]string{}}
	holds.claims[relay.LedgerKey{EventKey: "k9", Action: "s"}] = "crashed-owner"
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		switch *d.Event.AggregateID {
		case "hang":
			return relay.UnknownError(errors.New("timeout after the request was written"))
		case "refused":
			return relay.TransientError(errors.New("connection refused"), 0)
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Store: store, Holds: holds, Owner: "me", InlineAttempts: 2,
		Routes: []relay.Route{{Sink: sink, Hold: true}}})
	e.Submit(context.Background(), []*relay.Event{event(1, "hang"), event(2, "hang"), event(3, "refused"), event(4, "ok"), event(9, "x")})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })

	held, released := holds.snapshot()
	if !strings.Contains(held[1], "outcome unknown") || !strings.Contains(held[9], "before a restart") || len(held) != 2 {
		t.Fatalf("held %v, want events 1 and 9", held)
	}
	sends := map[int64]int{}
	for _, d := range sink.sent() {
		sends[d.Event.ID]++
	}
	if sends[1] != 1 || sends[2] != 0 || sends[9] != 0 || sends[3] != 2 || sends[4] != 1 {
		t.Fatalf("sends per event %v: want 1 once (no resend), 2 never (behind a held event), 3 twice, 4 once, 9 never", sends)
	}
	delivered, handOffs, _ := store.snapshot()
	if handOffs[2].ID != 2 || handOffs[3].ID != 3 || delivered[relay.LedgerKey{EventKey: "k4", Action: "s"}] != 1 {
		t.Fatalf("hand-offs %v delivered %v", handOffs, delivered)
	}
	if _, ok := handOffs[1]; ok {
		t.Fatal("a held row must not also be handed off")
	}
	if released != 1 {
		t.Fatalf("released %d claims, want 1 (event 3, never written)", released)
	}
}

// TestEngine_RowNotVisibleYet: the walsender can send a transaction before
// its rows are visible to other sessions. A hand-off or mark-done that finds
// its row invisible is retried, and the acknowledgement waits for it.
func TestEngine_RowNotVisibleYet(t *testing.T) {
	store := newFakeStore()
	store.invisibleFor[1] = 3 // the hand-off of event 1
	store.invisibleFor[2] = 3 // the mark-done of event 2
	sink := newFakeSink("s", func(d *relay.Delivery) error {
		if d.Event.ID == 1 {
			return relay.PermanentError(errors.New("400"))
		}
		return nil
	})
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}, MarkDone: true})
	e.Submit(context.Background(), []*relay.Event{event(1, "a"), event(2, "b")})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	store.mu.Lock()
	dead := store.deadLetters[1]
	store.mu.Unlock()
	if dead == "" {
		t.Fatal("settled before the dead letter of the invisible row was written")
	}
	waitFor(t, "row 2 marked done", func() bool {
		store.mu.Lock()
		defer store.mu.Unlock()
		return store.done[2]
	})
}

// TestEngine_RestartReloadsDiverted: rows a new slot's hand-over gives the
// claim path divert their aggregates before the stream starts.
func TestEngine_RestartReloadsDiverted(t *testing.T) {
	store := newFakeStore()
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}}})
	store.mu.Lock()
	store.diverted = []relay.AggregateKey{{Type: "order", ID: "old"}}
	store.mu.Unlock()
	if err := e.Restart(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	e.Submit(context.Background(), []*relay.Event{event(1, "old"), event(2, "new")})
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	if sent := sink.sent(); len(sent) != 1 || sent[0].Event.ID != 2 {
		t.Fatalf("sent %v: the event of an aggregate with a row at the claim path was streamed", sent)
	}
}

// TestEngine_TrickleSettlesInBatches: events arriving one at a time, one per
// millisecond, settle a few per Store.Settle call rather than one each (one
// PostgreSQL transaction per event took a quarter of a core at 1,000
// events/s), and all of them settle.
func TestEngine_TrickleSettlesInBatches(t *testing.T) {
	store := newFakeStore()
	e := startEngine(t, relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: newFakeSink("s", nil)}}})
	const n = 40
	ctx := context.Background()
	for i := int64(1); i <= n; i++ {
		if err := e.Submit(ctx, []*relay.Event{event(i, fmt.Sprint(i))}); err != nil {
			t.Fatal(err)
		}
		e.Commit(relay.LSN(i * 10))
		time.Sleep(time.Millisecond)
	}
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == n*10 })
	store.mu.Lock()
	defer store.mu.Unlock()
	if len(store.delivered) != n {
		t.Fatalf("%d ledger rows, want %d", len(store.delivered), n)
	}
	if store.settles > n/2 {
		t.Fatalf("%d events arriving 1 ms apart took %d Settle calls: want them batched (at most %d)", n, store.settles, n/2)
	}
	t.Logf("%d events in %d Settle calls", n, store.settles)
}
