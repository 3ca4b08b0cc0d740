package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/relay"
)

// fakeRunSink is a batching sink (relay.RunSink): every Send and every
// SendRun is one request, answered by answer with one outcome per event
// (nil answer: every event ok). maxRun is its MaxRun: above 1 it stands for
// a receiver declared to keep the ordered-batch contract (docs/sinks.md
// "Ordered batches"). It records each request's event ids and every time two
// requests carried events of one aggregate at once.
type fakeRunSink struct {
	name   string
	maxRun int
	answer func(req []*relay.Delivery) []error

	mu       sync.Mutex
	requests [][]int64
	busy     map[string]bool // aggregates with a request in flight
	overlaps []string
	told     []int // FitRun's aggregates, in call order
}

var _ relay.RunSink = (*fakeRunSink)(nil)

func newFakeRunSink(name string, maxRun int, answer func(req []*relay.Delivery) []error) *fakeRunSink {
	return &fakeRunSink{name: name, maxRun: maxRun, answer: answer, busy: map[string]bool{}}
}

func (s *fakeRunSink) Name() string                { return s.name }
func (s *fakeRunSink) Close(context.Context) error { return nil }
func (s *fakeRunSink) MaxRun() int                 { return s.maxRun }

// FitRun takes as much of ds as MaxRun allows, whatever the aggregates; it
// records the aggregates it was told of.
func (s *fakeRunSink) FitRun(ds []*relay.Delivery, aggregates int) int {
	s.mu.Lock()
	s.told = append(s.told, aggregates)
	s.mu.Unlock()
	return min(len(ds), s.maxRun)
}

func (s *fakeRunSink) Send(_ context.Context, d *relay.Delivery, done func(error)) {
	go func() { done(s.request([]*relay.Delivery{d})[0]) }()
}

func (s *fakeRunSink) SendRun(_ context.Context, ds []*relay.Delivery, done func([]error)) {
	if len(ds) > s.maxRun {
		panic(fmt.Sprintf("a run of %d events, over MaxRun %d", len(ds), s.maxRun))
	}
	go func() { done(s.request(ds)) }()
}

// request makes one request of req and returns its answer.
func (s *fakeRunSink) request(req []*relay.Delivery) []error {
	ids := make([]int64, len(req))
	aggs := map[string]bool{}
	s.mu.Lock()
	for i, d := range req {
		ids[i] = d.Event.ID
		aggs[*d.Event.AggregateID] = true
	}
	for a := range aggs {
		if s.busy[a] {
			s.overlaps = append(s.overlaps, fmt.Sprintf("aggregate %s in request %v while another of its requests is in flight", a, ids))
		}
		s.busy[a] = true
	}
	s.requests = append(s.requests, ids)
	s.mu.Unlock()
	errs := make([]error, len(req))
	if s.answer != nil {
		errs = s.answer(req)
	}
	s.mu.Lock()
	for a := range aggs {
		delete(s.busy, a)
	}
	s.mu.Unlock()
	return errs
}

// requestsOf returns the requests made so far that carry events of
// aggregate agg (event(id, agg)), each as its event ids, in send order.
func (s *fakeRunSink) requestsOf(ids ...int64) [][]int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out [][]int64
	for _, r := range s.requests {
		if slices.ContainsFunc(r, func(id int64) bool { return slices.Contains(ids, id) }) {
			out = append(out, slices.Clone(r))
		}
	}
	return out
}

func (s *fakeRunSink) requestCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.requests)
}

func (s *fakeRunSink) overlapping() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.overlaps)
}

// receiverAnswers is a receiver for fakeRunSink: byTry[id][n] is event id's
// answer at its n-th send (0 from the first; nil, or past the list, is ok).
type receiverAnswers struct {
	mu    sync.Mutex
	byTry map[int64][]error
	tries map[int64]int
	gate  map[int64]chan struct{} // the request carrying id waits for it
}

func (r *receiverAnswers) answer(req []*relay.Delivery) []error {
	r.mu.Lock()
	var wait []chan struct{}
	for _, d := range req {
		if g, ok := r.gate[d.Event.ID]; ok && r.tries[d.Event.ID] == 0 {
			wait = append(wait, g)
		}
	}
	r.mu.Unlock()
	for _, g := range wait {
		<-g
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	errs := make([]error, len(req))
	for i, d := range req {
		n := r.tries[d.Event.ID]
		r.tries[d.Event.ID]++
		if answers := r.byTry[d.Event.ID]; n < len(answers) {
			errs[i] = answers[n]
		}
	}
	return errs
}

var (
	answerRetry   = relay.TransientError(errors.New("the receiver answered retry: an earlier event of its aggregate was not applied"), 0)
	answerUnknown = relay.UnknownError(errors.New("the receiver's answer does not list it"))
)

// startRunRelay starts an engine with one route to sink and submits event 1
// of aggregate a, which the receiver holds (gate) until the events after it
// are queued behind it: those then go out as the lane forms its requests.
// It returns the stream to submit them on and the store.
func startRunRelay(t *testing.T, sink relay.Sink, hold bool, cfg relay.EngineConfig) (relay.Consumer, *fakeStore) {
	t.Helper()
	store := newFakeStore()
	cfg.Stream, cfg.Routes, cfg.Owner = store, []relay.Route{{Sink: sink, Hold: hold}}, "me"
	c := startEngine(t, cfg).Stream()
	submit(t, c, event(1, "a"))
	c.Commit(100)
	return c, store
}

// TestEngine_OrderedBatchCarriesARunOfOneAggregate: with a sink whose
// receiver keeps the ordered-batch contract (MaxRun above 1), the events of
// an aggregate queued behind its event in flight go out together, in one
// request and in commit order, once it is delivered; another aggregate's
// event goes out beside them. Without the contract (MaxRun 1) each event of
// an aggregate is a request of its own, and never two of one aggregate at
// once.
func TestEngine_OrderedBatchCarriesARunOfOneAggregate(t *testing.T) {
	for _, tt := range []struct {
		name   string
		maxRun int
		want   [][]int64 // the requests carrying aggregate a's events
	}{
		{"ordered", 3, [][]int64{{1}, {2, 4, 5}, {6}}},
		{"not ordered", 1, [][]int64{{1}, {2}, {4}, {5}, {6}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := &receiverAnswers{tries: map[int64]int{}, gate: map[int64]chan struct{}{1: make(chan struct{})}}
			sink := newFakeRunSink("s", tt.maxRun, r.answer)
			c, store := startRunRelay(t, sink, false, relay.EngineConfig{})
			waitFor(t, "event 1 at the receiver", func() bool { return sink.requestCount() == 1 })
			submit(t, c, event(2, "a"), event(3, "b"), event(4, "a"), event(5, "a"), event(6, "a"))
			c.Commit(200)
			close(r.gate[1])
			waitSettledAt(t, c, 200)

			if got := sink.requestsOf(1, 2, 4, 5, 6); !slices.EqualFunc(got, tt.want, slices.Equal) {
				t.Errorf("requests with aggregate a's events %v, want %v", got, tt.want)
			}
			if o := sink.overlapping(); len(o) > 0 {
				t.Errorf("two requests of one aggregate at once: %v", o)
			}
			delivered, _, _ := store.snapshot()
			for id := int64(1); id <= 6; id++ {
				if n := delivered[relay.LedgerKey{EventKey: fmt.Sprintf("k%d", id), Action: "s"}]; n != 1 {
					t.Errorf("event %d recorded delivered %d times, want 1", id, n)
				}
			}
		})
	}
}

// TestEngine_OrderedBatchToldTheAggregatesItHolds: when a lane forms a run it
// tells the sink how many aggregates it holds events of (FitRun), so that a
// run takes only its share of the requests in flight: here aggregate a's
// and the four others whose events are in flight.
func TestEngine_OrderedBatchToldTheAggregatesItHolds(t *testing.T) {
	r := &receiverAnswers{tries: map[int64]int{}, gate: map[int64]chan struct{}{}}
	for id := int64(1); id <= 5; id++ {
		r.gate[id] = make(chan struct{})
	}
	sink := newFakeRunSink("s", 10, r.answer)
	c, _ := startRunRelay(t, sink, false, relay.EngineConfig{})
	submit(t, c, event(2, "b"), event(3, "c"), event(4, "d"), event(5, "e"), event(6, "a"), event(7, "a"))
	c.Commit(200)
	waitFor(t, "events 1-5 at the receiver", func() bool { return sink.requestCount() == 5 })
	close(r.gate[1])
	waitFor(t, "the run of events 6 and 7", func() bool { return len(sink.requestsOf(6)) == 1 })
	sink.mu.Lock()
	told := slices.Clone(sink.told)
	sink.mu.Unlock()
	if !slices.Equal(told, []int{5}) {
		t.Errorf("FitRun told of %v aggregates, want [5]: a, and b-e with events in flight", told)
	}
	for id := int64(2); id <= 5; id++ {
		close(r.gate[id])
	}
	waitSettledAt(t, c, 200)
}

// TestEngine_OrderedBatchRetryKeepsTheRunsOrder: a run answered ok, retry,
// retry — the receiver kept the contract, applying nothing of the aggregate
// after the event it did not apply. The first is delivered; the retried
// event is sent again, and the event after it goes again with it, behind
// it in the same request, without an attempt of its own counted.
func TestEngine_OrderedBatchRetryKeepsTheRunsOrder(t *testing.T) {
	r := &receiverAnswers{tries: map[int64]int{}, gate: map[int64]chan struct{}{1: make(chan struct{})},
		byTry: map[int64][]error{3: {answerRetry}, 4: {answerRetry}}}
	sink := newFakeRunSink("s", 10, r.answer)
	c, store := startRunRelay(t, sink, false, relay.EngineConfig{Policy: relay.Policy{InlineAttempts: 3}})
	waitFor(t, "event 1 at the receiver", func() bool { return sink.requestCount() == 1 })
	submit(t, c, event(2, "a"), event(3, "a"), event(4, "a"))
	c.Commit(200)
	close(r.gate[1])
	waitSettledAt(t, c, 200)

	want := [][]int64{{1}, {2, 3, 4}, {3, 4}}
	if got := sink.requestsOf(1, 2, 3, 4); !slices.EqualFunc(got, want, slices.Equal) {
		t.Errorf("requests %v, want %v: event 4 goes again behind event 3, in its request", got, want)
	}
	delivered, diversions, _ := store.snapshot()
	for id := int64(1); id <= 4; id++ {
		if n := delivered[relay.LedgerKey{EventKey: fmt.Sprintf("k%d", id), Action: "s"}]; n != 1 {
			t.Errorf("event %d recorded delivered %d times, want 1", id, n)
		}
	}
	if len(diversions) > 0 {
		t.Errorf("diverted %v, want every event delivered by the stream", diversions)
	}
}

// TestEngine_OrderedBatchDivertTakesTheRunAlong: the retried event of a run
// goes to the claim path (no inline attempts): the event after it, answered
// retry as the contract wants, follows it there unsent, not counted.
func TestEngine_OrderedBatchDivertTakesTheRunAlong(t *testing.T) {
	r := &receiverAnswers{tries: map[int64]int{}, gate: map[int64]chan struct{}{1: make(chan struct{})},
		byTry: map[int64][]error{3: {answerRetry}, 4: {answerRetry}}}
	sink := newFakeRunSink("s", 10, r.answer)
	c, store := startRunRelay(t, sink, false, relay.EngineConfig{Policy: relay.Policy{InlineAttempts: 0}})
	waitFor(t, "event 1 at the receiver", func() bool { return sink.requestCount() == 1 })
	submit(t, c, event(2, "a"), event(3, "a"), event(4, "a"))
	c.Commit(200)
	close(r.gate[1])
	waitSettledAt(t, c, 200)

	if got, want := sink.requestsOf(1, 2, 3, 4), [][]int64{{1}, {2, 3, 4}}; !slices.EqualFunc(got, want, slices.Equal) {
		t.Errorf("requests %v, want %v", got, want)
	}
	_, diversions, _ := store.snapshot()
	if d := diversions[3]; d.Kind != relay.Later || d.Attempts != 1 {
		t.Errorf("event 3 settled %+v, want diverted after 1 counted attempt", d)
	}
	if d := diversions[4]; d.Kind != relay.Later || d.Attempts != 0 || d.Why != "ordering" {
		t.Errorf("event 4 settled %+v, want diverted behind event 3 for ordering, no attempt counted", d)
	}
}

// TestEngine_OrderedBatchContractViolation: a run answered ok, retry, ok —
// the receiver applied event 4 after not applying event 3 of its
// aggregate, breaking the contract it was declared to keep. Event 4 is
// recorded delivered, as answered (the receiver has it: sending it again
// would not undo the order it was applied in, and recording it otherwise
// would deliver it twice); the violation is counted in
// outbox_relay_receiver_order_violations_total; event 3 is sent again alone.
func TestEngine_OrderedBatchContractViolation(t *testing.T) {
	before := orderViolations(t, "violated")
	r := &receiverAnswers{tries: map[int64]int{}, gate: map[int64]chan struct{}{1: make(chan struct{})},
		byTry: map[int64][]error{3: {answerRetry}}}
	sink := newFakeRunSink("violated", 10, r.answer)
	c, store := startRunRelay(t, sink, false, relay.EngineConfig{Policy: relay.Policy{InlineAttempts: 3}})
	waitFor(t, "event 1 at the receiver", func() bool { return sink.requestCount() == 1 })
	submit(t, c, event(2, "a"), event(3, "a"), event(4, "a"))
	c.Commit(200)
	close(r.gate[1])
	waitSettledAt(t, c, 200)

	if got, want := sink.requestsOf(1, 2, 3, 4), [][]int64{{1}, {2, 3, 4}, {3}}; !slices.EqualFunc(got, want, slices.Equal) {
		t.Errorf("requests %v, want %v", got, want)
	}
	delivered, _, _ := store.snapshot()
	for id := int64(1); id <= 4; id++ {
		if n := delivered[relay.LedgerKey{EventKey: fmt.Sprintf("k%d", id), Action: "violated"}]; n != 1 {
			t.Errorf("event %d recorded delivered %d times, want 1", id, n)
		}
	}
	if got := orderViolations(t, "violated") - before; got != 1 {
		t.Errorf("outbox_relay_receiver_order_violations_total{sink=violated} rose by %v, want 1", got)
	}
}

// TestEngine_OrderedBatchUnknownAtAHoldSink: at a sink with on_unknown:
// hold, a run answered ok, retry, unknown, retry. The unknown event may
// have been applied, so it is held, never sent again; the event after it
// follows it to the claim path unsent; the retried event before it is
// sent again alone and delivered.
func TestEngine_OrderedBatchUnknownAtAHoldSink(t *testing.T) {
	r := &receiverAnswers{tries: map[int64]int{}, gate: map[int64]chan struct{}{1: make(chan struct{})},
		byTry: map[int64][]error{3: {answerRetry}, 4: {answerUnknown}, 5: {answerRetry}}}
	sink := newFakeRunSink("s", 10, r.answer)
	c, store := startRunRelay(t, sink, true, relay.EngineConfig{Policy: relay.Policy{InlineAttempts: 3}})
	waitFor(t, "event 1 at the receiver", func() bool { return sink.requestCount() == 1 })
	submit(t, c, event(2, "a"), event(3, "a"), event(4, "a"), event(5, "a"))
	c.Commit(200)
	close(r.gate[1])
	waitSettledAt(t, c, 200)

	if got, want := sink.requestsOf(1, 2, 3, 4, 5), [][]int64{{1}, {2, 3, 4, 5}, {3}}; !slices.EqualFunc(got, want, slices.Equal) {
		t.Errorf("requests %v, want %v", got, want)
	}
	delivered, diversions, _ := store.snapshot()
	for _, id := range []int64{1, 2, 3} {
		if n := delivered[relay.LedgerKey{EventKey: fmt.Sprintf("k%d", id), Action: "s"}]; n != 1 {
			t.Errorf("event %d recorded delivered %d times, want 1", id, n)
		}
	}
	if _, ok := store.heldRows()[4]; !ok {
		t.Errorf("event 4 not held; held rows %v", store.heldRows())
	}
	if d := diversions[5]; d.Kind != relay.Later || d.Why != "ordering" {
		t.Errorf("event 5 settled %+v, want diverted behind the held event 4", d)
	}
}

// orderViolations reads outbox_relay_receiver_order_violations_total for
// sink (0 before its first).
func orderViolations(t *testing.T, sink string) float64 {
	t.Helper()
	families, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "outbox_relay_receiver_order_violations_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "sink" && l.GetValue() == sink {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}
