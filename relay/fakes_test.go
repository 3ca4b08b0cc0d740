package relay_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// fakeStore is a relay.StreamStore over maps that stand for the outbox
// table and the ledger. Each method calls its function field: newFakeStore
// sets them to the map-backed behaviour below, and a test replaces or wraps
// one (before the engine starts) to inject failures.
type fakeStore struct {
	prepareStream func(ctx context.Context, works []*relay.Work, restreamed bool, owner string) error
	settleStream  func(ctx context.Context, works []*relay.Work, owner string) ([]int64, error)
	diverted      func(ctx context.Context) ([]relay.AggregateKey, error)

	mu          sync.Mutex
	delivered   map[relay.LedgerKey]int    // delivered ledger rows written, and how often
	claims      map[relay.LedgerKey]string // ledger claims ('sending') of hold sinks: owner
	unknown     map[relay.LedgerKey]string // pairs written 'unknown': detail
	released    []relay.LedgerKey          // claims withdrawn
	diversions  map[int64]relay.Decision
	deadLetters map[int64]string
	held        map[int64]string
	done        map[int64]bool
	// notOwned marks rows that are no longer the stream's although this
	// fake did not write them so (settled before a restart).
	notOwned     map[int64]bool
	divertedAggs []relay.AggregateKey
	// invisibleFor makes the row changes of an id report the row
	// invisible this many more times.
	invisibleFor map[int64]int
	settles      int       // SettleStream calls that wrote something
	prepares     [][]int64 // the ids of each PrepareStream call
}

var _ relay.StreamStore = (*fakeStore)(nil)

func newFakeStore() *fakeStore {
	s := &fakeStore{
		delivered: map[relay.LedgerKey]int{}, claims: map[relay.LedgerKey]string{}, unknown: map[relay.LedgerKey]string{},
		diversions: map[int64]relay.Decision{}, deadLetters: map[int64]string{}, held: map[int64]string{},
		done: map[int64]bool{}, notOwned: map[int64]bool{}, invisibleFor: map[int64]int{},
	}
	s.prepareStream, s.settleStream, s.diverted = s.prepare, s.settle, s.divertedRows
	return s
}

func (s *fakeStore) PrepareStream(ctx context.Context, works []*relay.Work, restreamed bool, owner string) error {
	return s.prepareStream(ctx, works, restreamed, owner)
}

func (s *fakeStore) SettleStream(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
	return s.settleStream(ctx, works, owner)
}

// Gone reports none of the invisible rows as deleted.
func (s *fakeStore) Gone(context.Context, []*relay.Work) ([]int64, error) { return nil, nil }

func (s *fakeStore) Diverted(ctx context.Context) ([]relay.AggregateKey, error) {
	return s.diverted(ctx)
}

// prepare is what ledger.PrepareStream does: a re-streamed row that is no
// longer the stream's is skipped and pairs the ledger shows delivered are
// not sent; hold sinks' pairs are claimed, or found delivered, or found
// claimed by another (unknown outcome).
func (s *fakeStore) prepare(_ context.Context, works []*relay.Work, restreamed bool, owner string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ids := make([]int64, len(works))
	for i, w := range works {
		ids[i] = w.Event.ID
		if restreamed && !s.ownedLocked(w.Event.ID) {
			w.Skip = true
			continue
		}
		for _, p := range w.Pairs {
			k := relay.LedgerKey{EventKey: w.Event.EventKey, Action: p.Sink}
			if restreamed && s.delivered[k] > 0 {
				p.State = relay.PairDelivered
			}
			if !p.Hold || p.State != relay.PairSend {
				continue
			}
			switch prev, ok := s.claims[k]; {
			case s.delivered[k] > 0:
				p.State = relay.PairDelivered
			case ok:
				p.State, p.PrevOwner = relay.PairUnknown, prev
			default:
				s.claims[k] = owner
				p.Claimed = true
			}
		}
	}
	s.prepares = append(s.prepares, ids)
	return nil
}

func (s *fakeStore) ownedLocked(id int64) bool {
	_, h := s.diversions[id]
	_, d := s.deadLetters[id]
	_, held := s.held[id]
	return !h && !d && !held && !s.done[id] && !s.notOwned[id]
}

// settle is what ledger.SettleStream does: ledger pairs, then the row
// changes (done included) of rows it can see; it reports the others
// invisible.
func (s *fakeStore) settle(_ context.Context, works []*relay.Work, owner string) ([]int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(works) > 0 {
		s.settles++
	}
	var invisible []int64
	for _, w := range works {
		ev, d := w.Event, w.Decision
		for _, p := range w.Pairs {
			k := relay.LedgerKey{EventKey: ev.EventKey, Action: p.Sink}
			switch {
			case p.Outcome.Kind == relay.Delivered && p.State != relay.PairDelivered:
				s.delivered[k]++
				delete(s.claims, k)
			case p.Claimed && (p.Outcome.Unknown || p.Outcome.Kind == relay.Held):
				s.unknown[k] = p.Outcome.Reason
			case p.Claimed:
				if s.claims[k] == owner {
					delete(s.claims, k)
					s.released = append(s.released, k)
				}
			}
		}
		if d.Kind == relay.Skip {
			continue
		}
		if s.invisibleFor[ev.ID] > 0 {
			s.invisibleFor[ev.ID]--
			invisible = append(invisible, ev.ID)
			continue
		}
		if !s.ownedLocked(ev.ID) {
			continue // every row change is conditional on the row being the stream's
		}
		switch d.Kind {
		case relay.Done:
			s.done[ev.ID] = true
		case relay.Later:
			s.diversions[ev.ID] = d
		case relay.DeadLetter:
			s.deadLetters[ev.ID] = d.Reason
		case relay.Hold:
			s.held[ev.ID] = d.Reason
		}
	}
	return invisible, nil
}

func (s *fakeStore) divertedRows(context.Context) ([]relay.AggregateKey, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.divertedAggs), nil
}

func (s *fakeStore) snapshot() (delivered map[relay.LedgerKey]int, diversions map[int64]relay.Decision, dead map[int64]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.delivered), maps.Clone(s.diversions), maps.Clone(s.deadLetters)
}

func (s *fakeStore) heldRows() map[int64]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.held)
}

// fakeClaimStore is a relay.ClaimStore of function fields; a nil field
// does nothing (PrepareClaim: claims every pair) and returns no error.
type fakeClaimStore struct {
	claim             func(ctx context.Context, q relay.ClaimQuery) ([]*relay.Work, error)
	prepareClaim      func(ctx context.Context, works []*relay.Work, owner string, lease time.Duration) error
	settleClaim       func(ctx context.Context, works []*relay.Work, owner string) ([]int64, error)
	settledAggregates func(ctx context.Context, aggs []relay.AggregateKey) ([]relay.AggregateKey, error)
	extendLeases      func(ctx context.Context, ids []int64, owner string) error
}

var _ relay.ClaimStore = (*fakeClaimStore)(nil)

func (c *fakeClaimStore) Claim(ctx context.Context, q relay.ClaimQuery) ([]*relay.Work, error) {
	if c.claim == nil {
		return nil, nil
	}
	return c.claim(ctx, q)
}

func (c *fakeClaimStore) PrepareClaim(ctx context.Context, works []*relay.Work, owner string, lease time.Duration) error {
	if c.prepareClaim == nil {
		for _, w := range works {
			for _, p := range w.Pairs {
				p.Claimed = true
			}
		}
		return nil
	}
	return c.prepareClaim(ctx, works, owner, lease)
}

func (c *fakeClaimStore) SettleClaim(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
	if c.settleClaim == nil {
		return nil, nil
	}
	return c.settleClaim(ctx, works, owner)
}

func (c *fakeClaimStore) SettledAggregates(ctx context.Context, aggs []relay.AggregateKey) ([]relay.AggregateKey, error) {
	if c.settledAggregates == nil {
		return nil, nil
	}
	return c.settledAggregates(ctx, aggs)
}

func (c *fakeClaimStore) ExtendLeases(ctx context.Context, ids []int64, owner string) error {
	if c.extendLeases == nil {
		return nil
	}
	return c.extendLeases(ctx, ids, owner)
}

// fakeSink answers with send; it records every call.
type fakeSink struct {
	name   string
	window chan struct{} // bounds concurrent sends, like a real sink
	delay  func() time.Duration

	mu    sync.Mutex
	send  func(d *relay.Delivery) error
	calls []relay.Delivery
}

var _ relay.Sink = (*fakeSink)(nil)

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
	send := s.send
	s.mu.Unlock()
	go func() {
		defer func() { <-s.window }()
		if s.delay != nil {
			time.Sleep(s.delay())
		}
		var err error
		if send != nil {
			err = send(d)
		}
		done(err)
	}()
}

func (s *fakeSink) Close(context.Context) error { return nil }

// setSend changes the sink's answer for the sends that follow.
func (s *fakeSink) setSend(send func(d *relay.Delivery) error) {
	s.mu.Lock()
	s.send = send
	s.mu.Unlock()
}

func (s *fakeSink) sent() []relay.Delivery {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

// sentIDs returns the ids of the events sent, in send order.
func (s *fakeSink) sentIDs() []int64 {
	var ids []int64
	for _, d := range s.sent() {
		ids = append(ids, d.Event.ID)
	}
	return ids
}

func str(s string) *string { return &s }

func event(id int64, aggregate string) *relay.Event {
	return &relay.Event{ID: id, EventKey: fmt.Sprintf("k%d", id), EventType: str("order.placed"),
		AggregateType: str("order"), AggregateID: str(aggregate), Payload: []byte(`{}`),
		CreatedAt: time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)}
}

func testLogger(t testing.TB) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
}

// startEngine builds an engine and runs it until the test ends.
func startEngine(t *testing.T, cfg relay.EngineConfig) *relay.Engine {
	t.Helper()
	cfg.Logger = testLogger(t)
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
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// waitSettledAt waits until c's settled position is lsn.
func waitSettledAt(t *testing.T, c relay.Consumer, lsn relay.LSN) {
	t.Helper()
	waitFor(t, "settled at "+lsn.String(), func() bool { got, _ := c.Settled(); return got == lsn })
}

// submit submits events and fails the test on an error.
func submit(t *testing.T, c relay.Consumer, events ...*relay.Event) {
	t.Helper()
	if err := c.Submit(context.Background(), events); err != nil {
		t.Fatal(err)
	}
}
