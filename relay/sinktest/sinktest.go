// Package sinktest is the suite every relay.Sink implementation must pass,
// run against a real destination (an HTTP receiver, a JetStream server).
package sinktest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Message is one delivery as the destination stored it.
type Message struct {
	IdempotencyKey string // webhook-id / Nats-Msg-Id
	Body           []byte
	Attempt        int
}

// Harness connects the suite to one sink and its destination.
type Harness struct {
	Sink relay.Sink
	// Received returns everything the destination has stored so far.
	Received func() []Message
	// Deduplicates is true when the destination drops a repeat of a key it
	// has stored (JetStream within its duplicate window); false when it
	// records every request (an HTTP receiver).
	Deduplicates bool
}

// Run runs the suite; newHarness must return a fresh sink and destination
// for each subtest, cleaned up with t.Cleanup.
func Run(t *testing.T, newHarness func(t *testing.T) *Harness) {
	t.Run("DeliversOnce", func(t *testing.T) { testDeliversOnce(t, newHarness(t)) })
	t.Run("ConcurrentDeliveries", func(t *testing.T) { testConcurrent(t, newHarness(t)) })
	t.Run("RepeatCarriesSameKeyAndBody", func(t *testing.T) { testRepeat(t, newHarness(t)) })
	t.Run("CancelledContext", func(t *testing.T) { testCancelled(t, newHarness(t)) })
	t.Run("CloseWaitsForInFlight", func(t *testing.T) { testClose(t, newHarness(t)) })
	t.Run("EmptyEventKeyIsPermanent", func(t *testing.T) { testEmptyKey(t, newHarness(t)) })
	t.Run("ThroughBothSources", func(t *testing.T) { testBothSources(t, newHarness(t)) })
}

// Event returns a sample event with id n.
func Event(n int) *relay.Event {
	typ, aggType, aggID := "order.placed", "order", fmt.Sprintf("O%d", n%17)
	return &relay.Event{
		ID:            int64(n),
		EventKey:      fmt.Sprintf("evt-%d", n),
		EventType:     &typ,
		AggregateType: &aggType,
		AggregateID:   &aggID,
		Payload:       []byte(fmt.Sprintf(`{"n": %d, "text": "é ✓ \"quoted\""}`, n)),
		CreatedAt:     time.Date(2026, 12, 2, 16, 0, 0, 123456000, time.UTC),
	}
}

// NewDelivery wraps Event(n) for its first attempt.
func NewDelivery(n int) *relay.Delivery {
	e := Event(n)
	return &relay.Delivery{Event: e, Body: e.AppendEnvelope(nil), Attempt: 1}
}

// send delivers synchronously and checks that done is called exactly once.
func send(t *testing.T, s relay.Sink, d *relay.Delivery) error {
	t.Helper()
	errs := make(chan error, 2)
	s.Send(context.Background(), d, func(err error) { errs <- err })
	select {
	case err := <-errs:
		select {
		case <-errs:
			t.Fatalf("done called twice for %s", d.Event.EventKey)
		case <-time.After(50 * time.Millisecond):
		}
		return err
	case <-time.After(30 * time.Second):
		t.Fatalf("done not called within 30s for %s", d.Event.EventKey)
		return nil
	}
}

// waitReceived polls the destination until it holds at least n messages.
func waitReceived(t *testing.T, h *Harness, n int) []Message {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		got := h.Received()
		if len(got) >= n || time.Now().After(deadline) {
			return got
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func testDeliversOnce(t *testing.T, h *Harness) {
	d := NewDelivery(1)
	if err := send(t, h.Sink, d); err != nil {
		t.Fatalf("send: %v", err)
	}
	got := waitReceived(t, h, 1)
	if len(got) != 1 {
		t.Fatalf("destination holds %d messages, want 1", len(got))
	}
	if got[0].IdempotencyKey != d.Event.EventKey || !bytes.Equal(got[0].Body, d.Body) || got[0].Attempt != 1 {
		t.Fatalf("stored %+v (body %s), want key %s, attempt 1, body %s", got[0], got[0].Body, d.Event.EventKey, d.Body)
	}
}

func testConcurrent(t *testing.T, h *Harness) {
	const n = 300
	var wg sync.WaitGroup
	var calls, failures atomic.Int64
	for i := range n {
		wg.Add(1)
		h.Sink.Send(context.Background(), NewDelivery(1000+i), func(err error) {
			calls.Add(1)
			if err != nil {
				failures.Add(1)
				t.Errorf("delivery %d: %v", i, err)
			}
			wg.Done()
		})
	}
	wg.Wait()
	if calls.Load() != n || failures.Load() != 0 {
		t.Fatalf("done calls %d (want %d), failures %d", calls.Load(), n, failures.Load())
	}
	got := waitReceived(t, h, n)
	seen := map[string]int{}
	for _, m := range got {
		seen[m.IdempotencyKey]++
	}
	for i := range n {
		if key := NewDelivery(1000 + i).Event.EventKey; seen[key] != 1 {
			t.Fatalf("%s stored %d times, want once", key, seen[key])
		}
	}
}

func testRepeat(t *testing.T, h *Harness) {
	first := NewDelivery(7)
	again := NewDelivery(7)
	again.Attempt = 2
	if err := send(t, h.Sink, first); err != nil {
		t.Fatal(err)
	}
	if err := send(t, h.Sink, again); err != nil {
		t.Fatalf("repeat: %v", err)
	}
	want := 2
	if h.Deduplicates {
		want = 1
	}
	waitReceived(t, h, want)
	time.Sleep(100 * time.Millisecond) // a late extra copy would show up by now
	got := h.Received()
	if len(got) != want {
		t.Fatalf("destination holds %d messages, want %d", len(got), want)
	}
	for _, m := range got {
		if m.IdempotencyKey != first.Event.EventKey || !bytes.Equal(m.Body, first.Body) {
			t.Fatalf("repeat differs: key %q body %s", m.IdempotencyKey, m.Body)
		}
	}
	if !h.Deduplicates && got[1].Attempt != 2 {
		t.Fatalf("second request attempt %d, want 2", got[1].Attempt)
	}
}

func testCancelled(t *testing.T, h *Harness) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	errs := make(chan error, 2)
	h.Sink.Send(ctx, NewDelivery(9), func(err error) { errs <- err })
	select {
	case <-errs:
		// Either outcome is allowed (the sink may have sent before seeing
		// the cancellation); what matters is that done is called once.
	case <-time.After(30 * time.Second):
		t.Fatal("done not called for a cancelled context")
	}
	select {
	case <-errs:
		t.Fatal("done called twice")
	case <-time.After(100 * time.Millisecond):
	}
}

func testClose(t *testing.T, h *Harness) {
	const n = 50
	var calls atomic.Int64
	for i := range n {
		h.Sink.Send(context.Background(), NewDelivery(2000+i), func(error) { calls.Add(1) })
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.Sink.Close(ctx); err != nil {
		t.Fatalf("close: %v", err)
	}
	if c := calls.Load(); c != n {
		t.Fatalf("after Close, done was called %d times, want %d", c, n)
	}
}

// testEmptyKey: an event whose key is empty has no usable idempotency key;
// it fails as Permanent (wrapping relay.ErrEmptyEventKey) and is not sent.
func testEmptyKey(t *testing.T, h *Harness) {
	d := NewDelivery(11)
	d.Event.EventKey = ""
	d.Body = d.Event.AppendEnvelope(nil)
	err := send(t, h.Sink, d)
	if class, _ := relay.Classify(err); class != relay.Permanent || !errors.Is(err, relay.ErrEmptyEventKey) {
		t.Fatalf("send with an empty event key: %v (class %s), want Permanent wrapping relay.ErrEmptyEventKey", err, class)
	}
	if got := h.Received(); len(got) != 0 {
		t.Fatalf("destination holds %d messages, want none", len(got))
	}
}

// testBothSources runs the sink under the one delivery core, fed by both
// sources: events submitted as the stream would and rows handed over as the
// claim path would reach the destination once each, with the same bytes,
// and settle as done.
func testBothSources(t *testing.T, h *Harness) {
	const n = 40
	stores := &memStores{done: map[int64]relay.DecisionKind{}}
	e, err := relay.NewEngine(relay.EngineConfig{Routes: []relay.Route{{Sink: h.Sink}}, Stream: stores, Claim: stores, Owner: "outbox-relay:sinktest"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); e.Run(ctx) }()
	defer func() { cancel(); <-ran }()

	c := e.Stream()
	for i := 1; i <= n/2; i++ {
		if err := c.Submit(ctx, []*relay.Event{Event(i)}); err != nil {
			t.Fatal(err)
		}
		c.Commit(relay.LSN(i * 100))
	}
	var claimed []*relay.Work
	for i := n/2 + 1; i <= n; i++ {
		claimed = append(claimed, &relay.Work{Event: Event(i)})
	}
	if notTaken, err := e.SubmitClaimed(ctx, claimed); err != nil || len(notTaken) > 0 {
		t.Fatalf("SubmitClaimed: %v (%d not taken)", err, len(notTaken))
	}
	deadline := time.Now().Add(30 * time.Second)
	for stores.settled() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events settled", stores.settled(), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	got := waitReceived(t, h, n)
	byKey := map[string]Message{}
	for _, m := range got {
		if prev, ok := byKey[m.IdempotencyKey]; ok && !bytes.Equal(prev.Body, m.Body) {
			t.Fatalf("%s arrived twice with different bodies", m.IdempotencyKey)
		}
		byKey[m.IdempotencyKey] = m
	}
	for i := 1; i <= n; i++ {
		ev := Event(i)
		m, ok := byKey[ev.EventKey]
		if !ok {
			t.Fatalf("event %d never arrived", i)
		}
		if want := ev.AppendEnvelope(nil); !bytes.Equal(m.Body, want) {
			t.Fatalf("event %d arrived as %s, want %s", i, m.Body, want)
		}
		if k := stores.decision(int64(i)); k != relay.Done {
			t.Fatalf("event %d settled as %v, want done", i, k)
		}
	}
}

// memStores are the stream's and the claim path's stores kept in memory.
type memStores struct {
	mu   sync.Mutex
	done map[int64]relay.DecisionKind
}

func (s *memStores) record(works []*relay.Work) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, w := range works {
		s.done[w.Event.ID] = w.Decision.Kind
	}
}

func (s *memStores) settled() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.done)
}

func (s *memStores) decision(id int64) relay.DecisionKind {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done[id]
}

func (s *memStores) PrepareStream(context.Context, []*relay.Work, bool, string) error { return nil }
func (s *memStores) SettleStream(_ context.Context, works []*relay.Work, _ string) ([]int64, error) {
	s.record(works)
	return nil, nil
}
func (s *memStores) Gone(context.Context, []*relay.Work) ([]int64, error)   { return nil, nil }
func (s *memStores) Diverted(context.Context) ([]relay.AggregateKey, error) { return nil, nil }
func (s *memStores) Claim(context.Context, relay.ClaimQuery) ([]*relay.Work, error) {
	return nil, nil
}
func (s *memStores) PrepareClaim(_ context.Context, works []*relay.Work, _ string, _ time.Duration) error {
	for _, w := range works {
		for _, p := range w.Pairs {
			p.Claimed = true
		}
	}
	return nil
}
func (s *memStores) SettleClaim(_ context.Context, works []*relay.Work, _ string) ([]int64, error) {
	s.record(works)
	return nil, nil
}
func (s *memStores) SettledAggregates(context.Context, []relay.AggregateKey) ([]relay.AggregateKey, error) {
	return nil, nil
}
func (s *memStores) ExtendLeases(context.Context, []int64, string) error { return nil }

// StreamThroughEngine submits Event(1) … Event(n) as the stream would, one
// transaction each, to an engine whose only route is s, waits until every
// event is settled, and returns each event's decision by id. Events i and
// i+17 share an aggregate, so the engine's per-aggregate order applies. The
// stream retries a failed event in memory three times before diverting it.
func StreamThroughEngine(t *testing.T, s relay.Sink, n int) map[int64]relay.DecisionKind {
	t.Helper()
	stores := &memStores{done: map[int64]relay.DecisionKind{}}
	e, err := relay.NewEngine(relay.EngineConfig{Routes: []relay.Route{{Sink: s}}, Stream: stores, Claim: stores, Owner: "outbox-relay:sinktest", Policy: relay.Policy{InlineAttempts: 3}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); e.Run(ctx) }()
	defer func() { cancel(); <-ran }()
	c := e.Stream()
	for i := 1; i <= n; i++ {
		if err := c.Submit(ctx, []*relay.Event{Event(i)}); err != nil {
			t.Fatal(err)
		}
		c.Commit(relay.LSN(i * 100))
	}
	deadline := time.Now().Add(30 * time.Second)
	for stores.settled() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events settled", stores.settled(), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	stores.mu.Lock()
	defer stores.mu.Unlock()
	return maps.Clone(stores.done)
}
