package supervisor_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/supervisor"
)

// nopStore is a StreamStore with nothing in it.
type nopStore struct{}

func (nopStore) PrepareStream(context.Context, []*relay.Work, bool, string) error { return nil }
func (nopStore) SettleStream(context.Context, []*relay.Work, string) ([]int64, error) {
	return nil, nil
}
func (nopStore) Gone(context.Context, []*relay.Work) ([]int64, error)   { return nil, nil }
func (nopStore) Diverted(context.Context) ([]relay.AggregateKey, error) { return nil, nil }

func newEngine() (*relay.Engine, error) {
	return relay.NewEngine(relay.EngineConfig{Stream: nopStore{}, Owner: "outbox-relay:test"})
}

// runner is a source whose Run is run.
type runner struct {
	run func(ctx context.Context) error
}

func (r runner) Run(ctx context.Context) error { return r.run(ctx) }

// untilDone runs until ctx ends.
func untilDone(ctx context.Context) error { <-ctx.Done(); return nil }

// slots is a fake slot view.
type slots struct {
	mu       sync.Mutex
	exists   bool
	active   bool
	retained int64
	drops    int
}

func (s *slots) Slot(context.Context) (bool, bool, int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.exists, s.active, s.retained, nil
}

func (s *slots) DropSlot(context.Context) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.exists || s.active {
		return false, nil
	}
	s.exists = false
	s.drops++
	return true, nil
}

func (s *slots) EndStaleWalsender(context.Context) (int32, error) { return 0, nil }

func (s *slots) set(f func(*slots)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

func (s *slots) dropped() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.drops
}

// leadership is a held lock that can be lost.
type leadership struct {
	lost     chan struct{}
	released atomic.Bool
}

func (l *leadership) Lost() <-chan struct{} { return l.lost }
func (l *leadership) Release()              { l.released.Store(true) }

func alwaysLeader(ctx context.Context) (supervisor.Leadership, error) {
	return &leadership{lost: make(chan struct{})}, nil
}

// unavailable is a replication.UnavailableError look-alike.
type unavailable struct{}

func (unavailable) Error() string             { return "replication unavailable: test" }
func (unavailable) UnavailableReason() string { return "test" }

// terms is a fake supervisor.Terms: each method calls its function.
type terms struct {
	leader func(ctx context.Context) (supervisor.Leadership, error)
	engine func() (*relay.Engine, error)
	stream func(e *relay.Engine) (supervisor.Runner, error)
	claim  func(e *relay.Engine, all bool) (supervisor.Runner, error)
}

func (t *terms) Leader(ctx context.Context) (supervisor.Leadership, error) { return t.leader(ctx) }
func (t *terms) Engine() (*relay.Engine, error)                            { return t.engine() }
func (t *terms) Stream(e *relay.Engine) (supervisor.Runner, error)         { return t.stream(e) }
func (t *terms) Claim(e *relay.Engine, all bool) (supervisor.Runner, error) {
	return t.claim(e, all)
}

// fake returns cfg's fake Terms, for a test to replace one of its functions.
func fake(cfg supervisor.Config) *terms { return cfg.Terms.(*terms) }

func baseConfig(mode supervisor.Mode, s *slots) supervisor.Config {
	return supervisor.Config{
		Mode: mode,
		Terms: &terms{
			leader: alwaysLeader,
			engine: newEngine,
			stream: func(*relay.Engine) (supervisor.Runner, error) { return runner{untilDone}, nil },
			claim:  func(*relay.Engine, bool) (supervisor.Runner, error) { return runner{untilDone}, nil },
		},
		Slots:             s,
		SlotMaxUnconsumed: 300 * time.Millisecond,
		ShutdownTimeout:   time.Second,
		StandBy:           50 * time.Millisecond,
		Logger:            zerolog.Nop(),
	}
}

// start runs the supervisor until the test ends and returns a stop that
// waits for Run.
func start(t *testing.T, cfg supervisor.Config) (stop func() error) {
	t.Helper()
	sup, err := supervisor.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sup.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(10 * time.Second):
				t.Error("supervisor did not stop within 10 s")
			}
		})
		return runErr
	}
	t.Cleanup(func() { stop() })
	return stop
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestWatchdogDropsUnconsumedSlotInEveryMode: a slot nobody streams from is
// dropped after slot_max_unconsumed in every mode, and one somebody streams
// from never is.
func TestWatchdogDropsUnconsumedSlotInEveryMode(t *testing.T) {
	for _, mode := range []supervisor.Mode{supervisor.ModeReplication, supervisor.ModeAuto, supervisor.ModePoll} {
		t.Run(string(mode), func(t *testing.T) {
			s := &slots{exists: true, active: true}
			start(t, baseConfig(mode, s))
			time.Sleep(time.Second)
			if s.dropped() != 0 {
				t.Fatal("a slot being streamed from was dropped")
			}
			s.set(func(s *slots) { s.active = false })
			began := time.Now()
			eventually(t, "the unconsumed slot dropped", func() bool { return s.dropped() == 1 })
			if took := time.Since(began); took < 300*time.Millisecond {
				t.Fatalf("dropped after %v, before slot_max_unconsumed", took)
			}
		})
	}
}

// TestWatchdogDropsSlotRetainingTooMuch: an unconsumed slot retaining
// slot_max_retained is dropped without waiting for slot_max_unconsumed.
func TestWatchdogDropsSlotRetainingTooMuch(t *testing.T) {
	s := &slots{exists: true, retained: 2 << 30}
	cfg := baseConfig(supervisor.ModeReplication, s)
	cfg.SlotMaxUnconsumed = time.Hour
	start(t, cfg)
	eventually(t, "the slot retaining too much dropped", func() bool { return s.dropped() == 1 })
}

// TestAutoFallsBackToPollingAndReturns: in auto mode, while replication is
// unavailable, the claim path takes every row; after replication_retry the
// relay drops the old slot and streams again.
func TestAutoFallsBackToPollingAndReturns(t *testing.T) {
	s := &slots{exists: true}
	var streams, polls atomic.Int32
	cfg := baseConfig(supervisor.ModeAuto, s)
	cfg.SlotMaxUnconsumed = time.Hour
	cfg.ReplicationRetry = 200 * time.Millisecond
	fake(cfg).stream = func(*relay.Engine) (supervisor.Runner, error) {
		return runner{func(ctx context.Context) error {
			if streams.Add(1) == 1 {
				return unavailable{}
			}
			return untilDone(ctx)
		}}, nil
	}
	fake(cfg).claim = func(_ *relay.Engine, all bool) (supervisor.Runner, error) {
		if all {
			polls.Add(1)
		}
		return runner{untilDone}, nil
	}
	stop := start(t, cfg)
	eventually(t, "a return to streaming", func() bool { return streams.Load() == 2 })
	if polls.Load() != 1 || s.dropped() != 1 {
		t.Fatalf("polled %d times and dropped the slot %d times, want 1 and 1", polls.Load(), s.dropped())
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// TestReplicationModeFailsWhenUnavailable: in replication mode an
// unavailable replication stops the relay with the reason.
func TestReplicationModeFailsWhenUnavailable(t *testing.T) {
	cfg := baseConfig(supervisor.ModeReplication, &slots{})
	fake(cfg).stream = func(*relay.Engine) (supervisor.Runner, error) {
		return runner{func(context.Context) error { return unavailable{} }}, nil
	}
	sup, err := supervisor.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = sup.Run(context.Background())
	if err == nil || err.Error() != "replication is unavailable and source.mode is replication: test" {
		t.Fatalf("Run = %v", err)
	}
}

// TestLostLeadershipEndsTheTerm: when the lock is lost the sources stop, the
// lock is released, and after the stand-by pause the relay tries to lead
// again.
func TestLostLeadershipEndsTheTerm(t *testing.T) {
	var terms atomic.Int32
	first := &leadership{lost: make(chan struct{})}
	cfg := baseConfig(supervisor.ModeReplication, &slots{})
	var stopped atomic.Int32
	fake(cfg).leader = func(ctx context.Context) (supervisor.Leadership, error) {
		if terms.Add(1) == 1 {
			return first, nil
		}
		return alwaysLeader(ctx)
	}
	fake(cfg).stream = func(*relay.Engine) (supervisor.Runner, error) {
		return runner{func(ctx context.Context) error {
			<-ctx.Done()
			stopped.Add(1)
			return nil
		}}, nil
	}
	start(t, cfg)
	eventually(t, "the first term", func() bool { return terms.Load() == 1 })
	close(first.lost)
	eventually(t, "a second term", func() bool { return terms.Load() == 2 })
	if stopped.Load() != 1 || !first.released.Load() {
		t.Fatalf("stream stopped %d times, lock released %v; want 1, true", stopped.Load(), first.released.Load())
	}
}

// TestTermStopsEveryGoroutine: after Run returns, every goroutine a term
// started has ended.
func TestTermStopsEveryGoroutine(t *testing.T) {
	before := runtime.NumGoroutine()
	for _, mode := range []supervisor.Mode{supervisor.ModeReplication, supervisor.ModePoll} {
		stop := start(t, baseConfig(mode, &slots{exists: true, active: true}))
		time.Sleep(200 * time.Millisecond)
		if err := stop(); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the goroutines to end", func() bool { return runtime.NumGoroutine() <= before })
}

// TestServerChangeStartsNewTerm: a stream that finds another database
// server (relay.ErrServerChanged, a failover) ends the term, its lock is
// released, and a new term leads at once on the new server: Run goes on.
func TestServerChangeStartsNewTerm(t *testing.T) {
	var terms, leads atomic.Int32
	var released []*leadership
	var mu sync.Mutex
	cfg := baseConfig(supervisor.ModeReplication, &slots{})
	cfg.StandBy = time.Hour // a failover does not wait to lead again
	fake(cfg).leader = func(ctx context.Context) (supervisor.Leadership, error) {
		leads.Add(1)
		l := &leadership{lost: make(chan struct{})}
		mu.Lock()
		released = append(released, l)
		mu.Unlock()
		return l, nil
	}
	fake(cfg).engine = func() (*relay.Engine, error) {
		terms.Add(1)
		return newEngine()
	}
	fake(cfg).stream = func(*relay.Engine) (supervisor.Runner, error) {
		return runner{func(ctx context.Context) error {
			if terms.Load() == 1 {
				return fmt.Errorf("stream: %w", relay.ErrServerChanged)
			}
			return untilDone(ctx)
		}}, nil
	}
	stop := start(t, cfg)
	deadline := time.Now().Add(5 * time.Second)
	for terms.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%d terms after the server changed, want a second one at once", terms.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil: a failover is not fatal", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if leads.Load() != 2 || !released[0].released.Load() {
		t.Errorf("leads %d, first lock released %v: want the lock released and taken again", leads.Load(), released[0].released.Load())
	}
}

// slowSink answers every send after release is closed, and counts them.
type slowSink struct {
	release chan struct{}
	sent    atomic.Int32
}

func (s *slowSink) Name() string { return "slow" }
func (s *slowSink) Send(_ context.Context, _ *relay.Delivery, done func(error)) {
	s.sent.Add(1)
	go func() { <-s.release; done(nil) }()
}
func (s *slowSink) Close(context.Context) error { return nil }

// TestFallbackToPollingWaitsForTheStreamsDeliveries: auto mode falls back
// to the claim path over every row while an event the stream decoded is
// still in flight at a sink. The claim path must not start before that
// event's outcome is written: it would claim the same row (pending, not
// yet done) and send it a second time. Before, the poll phase started at
// once on the same engine.
func TestFallbackToPollingWaitsForTheStreamsDeliveries(t *testing.T) {
	sink := &slowSink{release: make(chan struct{})}
	var engines []*relay.Engine
	var mu sync.Mutex
	cfg := baseConfig(supervisor.ModeAuto, &slots{})
	cfg.ReplicationRetry = time.Hour
	fake(cfg).engine = func() (*relay.Engine, error) {
		e, err := relay.NewEngine(relay.EngineConfig{Stream: nopStore{}, Owner: "outbox-relay:test", Routes: []relay.Route{{Sink: sink}}})
		mu.Lock()
		engines = append(engines, e)
		mu.Unlock()
		return e, err
	}
	streamEngine := make(chan *relay.Engine, 1)
	fake(cfg).stream = func(e *relay.Engine) (supervisor.Runner, error) {
		return runner{func(ctx context.Context) error {
			ev := &relay.Event{ID: 1, EventKey: "k1", CreatedAt: time.Now()}
			if err := e.Stream().Submit(ctx, []*relay.Event{ev}); err != nil {
				return err
			}
			e.Stream().Commit(100)
			streamEngine <- e
			// The publication was dropped: replication is unavailable
			// while the event is still at the sink.
			return unavailable{}
		}}, nil
	}
	pollStarted := make(chan int, 1) // the stream's unsettled events when the claim path started
	fake(cfg).claim = func(_ *relay.Engine, all bool) (supervisor.Runner, error) {
		return runner{func(ctx context.Context) error {
			if all {
				e := <-streamEngine
				unsettled, _ := e.Progress(relay.PathStream)
				pollStarted <- unsettled
			}
			return untilDone(ctx)
		}}, nil
	}
	start(t, cfg)
	eventually(t, "the event sent by the stream", func() bool { return sink.sent.Load() == 1 })
	go func() { time.Sleep(300 * time.Millisecond); close(sink.release) }()
	select {
	case unsettled := <-pollStarted:
		if unsettled != 0 {
			t.Fatalf("the claim path over every row started with %d of the stream's events still in flight", unsettled)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the claim path never started")
	}
}

// panickySink panics when it sends: a bug in a sink.
type panickySink struct{}

func (panickySink) Name() string                                       { return "buggy" }
func (panickySink) Send(context.Context, *relay.Delivery, func(error)) { panic("sink bug") }
func (panickySink) Close(context.Context) error                        { return nil }

// TestWorkerFailureStopsTheRelay: a worker of the engine that fails (a lane
// whose sink panics) ends the phase, the term and Run with an error naming
// it; before, the goroutine died and the relay went on waiting.
func TestWorkerFailureStopsTheRelay(t *testing.T) {
	cfg := baseConfig(supervisor.ModeReplication, &slots{})
	fake(cfg).engine = func() (*relay.Engine, error) {
		return relay.NewEngine(relay.EngineConfig{Stream: nopStore{}, Owner: "outbox-relay:test", Routes: []relay.Route{{Sink: panickySink{}}}})
	}
	fake(cfg).stream = func(e *relay.Engine) (supervisor.Runner, error) {
		return runner{func(ctx context.Context) error {
			if err := e.Stream().Submit(ctx, []*relay.Event{{ID: 1, EventKey: "k1"}}); err != nil {
				return err
			}
			return untilDone(ctx)
		}}, nil
	}
	sup, err := supervisor.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- sup.Run(context.Background()) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "lane buggy panicked: sink bug") {
			t.Fatalf("Run = %v, want the lane's failure", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay did not stop after a lane failed")
	}
}

// countingSink holds each send for hold, or until its context ends, and
// counts the sends.
type countingSink struct {
	hold  time.Duration
	sends atomic.Int32
}

func (s *countingSink) Name() string { return "hook" }
func (s *countingSink) Send(ctx context.Context, _ *relay.Delivery, done func(error)) {
	s.sends.Add(1)
	go func() {
		select {
		case <-time.After(s.hold):
			done(nil)
		case <-ctx.Done():
			done(ctx.Err())
		}
	}()
}
func (s *countingSink) Close(context.Context) error { return nil }

// TestLostLockStopsDeliveryAtOnce: 40 events of one aggregate are queued in
// a lane (200 ms a send) when the leader lock is lost. Nothing more is sent
// after the relay knows: the queue is not worked off during the drain, and
// the send in flight is cancelled. Before, the term's lanes ran on a
// context the loss did not cancel and sent for seconds while another relay
// delivered the same events.
func TestLostLockStopsDeliveryAtOnce(t *testing.T) {
	sink := &countingSink{hold: 200 * time.Millisecond}
	first := &leadership{lost: make(chan struct{})}
	var terms atomic.Int32
	cfg := baseConfig(supervisor.ModeReplication, &slots{})
	cfg.StandBy = time.Hour
	fake(cfg).leader = func(ctx context.Context) (supervisor.Leadership, error) {
		if terms.Add(1) == 1 {
			return first, nil
		}
		<-ctx.Done()
		return nil, ctx.Err()
	}
	fake(cfg).engine = func() (*relay.Engine, error) {
		return relay.NewEngine(relay.EngineConfig{Stream: nopStore{}, Owner: "outbox-relay:test", Routes: []relay.Route{{Sink: sink}}})
	}
	fake(cfg).stream = func(e *relay.Engine) (supervisor.Runner, error) {
		return runner{func(ctx context.Context) error {
			var evs []*relay.Event
			for i := int64(1); i <= 40; i++ {
				agg, typ := "order", "A"
				evs = append(evs, &relay.Event{ID: i, EventKey: fmt.Sprint("k", i), AggregateType: &typ, AggregateID: &agg})
			}
			if err := e.Stream().Submit(ctx, evs); err != nil {
				return err
			}
			e.Stream().Commit(100)
			return untilDone(ctx)
		}}, nil
	}
	cfg.ShutdownTimeout = 30 * time.Second
	start(t, cfg)
	eventually(t, "the first sends", func() bool { return sink.sends.Load() >= 2 })
	close(first.lost)
	atLoss := sink.sends.Load()
	time.Sleep(1500 * time.Millisecond)
	if n := sink.sends.Load() - atLoss; n > 0 {
		t.Fatalf("%d sends after the lock was lost (%d before), want none", n, atLoss)
	}
	eventually(t, "the lock released", func() bool { return first.released.Load() })
}

// claimStore is a relay.ClaimStore that claims nothing by itself and
// settles everything.
type claimStore struct{}

func (claimStore) Claim(context.Context, relay.ClaimQuery) ([]*relay.Work, error) { return nil, nil }
func (claimStore) PrepareClaim(_ context.Context, works []*relay.Work, _ string, _ time.Duration) error {
	for _, w := range works {
		for _, p := range w.Pairs {
			p.Claimed = true
		}
	}
	return nil
}
func (claimStore) SettleClaim(context.Context, []*relay.Work, string) ([]int64, error) {
	return nil, nil
}
func (claimStore) SettledAggregates(context.Context, []relay.AggregateKey) ([]relay.AggregateKey, error) {
	return nil, nil
}
func (claimStore) ExtendLeases(context.Context, []int64, string) error { return nil }

// TestLostOwnerLockHaltsThePhase: in poll mode the claim path's owner lock
// is its lease. When the claim source reports it lost (relay.ErrLeaseLost)
// with 20 rows of one aggregate still queued in a lane, nothing more is
// sent, and a new phase starts (taking the lock afresh).
func TestLostOwnerLockHaltsThePhase(t *testing.T) {
	sink := &countingSink{hold: 200 * time.Millisecond}
	var phases atomic.Int32
	cfg := baseConfig(supervisor.ModePoll, nil)
	cfg.Slots = nil
	fake(cfg).engine = func() (*relay.Engine, error) {
		return relay.NewEngine(relay.EngineConfig{Stream: nopStore{}, Claim: claimStore{}, Owner: "outbox-relay:test", Routes: []relay.Route{{Sink: sink}}})
	}
	fake(cfg).claim = func(e *relay.Engine, all bool) (supervisor.Runner, error) {
		n := phases.Add(1)
		return runner{func(ctx context.Context) error {
			if n > 1 {
				return untilDone(ctx)
			}
			var works []*relay.Work
			for i := int64(1); i <= 20; i++ {
				agg, typ := "order", "A"
				works = append(works, &relay.Work{Event: &relay.Event{ID: i, EventKey: fmt.Sprint("k", i), AggregateType: &typ, AggregateID: &agg}})
			}
			if _, err := e.SubmitClaimed(ctx, works); err != nil {
				return err
			}
			for sink.sends.Load() < 2 {
				time.Sleep(10 * time.Millisecond)
			}
			return fmt.Errorf("claim path: owner lock: %w", relay.ErrLeaseLost)
		}}, nil
	}
	start(t, cfg)
	eventually(t, "the lease lost", func() bool { return sink.sends.Load() >= 2 && phases.Load() >= 1 })
	time.Sleep(100 * time.Millisecond)
	atLoss := sink.sends.Load()
	eventually(t, "a new phase", func() bool { return phases.Load() == 2 })
	time.Sleep(time.Second)
	if n := sink.sends.Load() - atLoss; n > 0 {
		t.Fatalf("%d sends after the claim path's lease was lost, want none", n)
	}
}
