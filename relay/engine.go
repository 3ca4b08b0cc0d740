package relay

import (
	"context"
	"errors"
	"fmt"
	"path"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// EngineConfig configures an Engine. Zero values take the defaults in
// brackets.
type EngineConfig struct {
	Routes []Route
	Policy Policy
	// Unordered turns off per-aggregate ordering (ordering: none).
	Unordered bool
	// LaneCapacity bounds the events a sink holds (queued, in flight or
	// waiting to retry) [4096].
	LaneCapacity int
	// MaxUnsettled bounds the events taken and not yet settled, whatever
	// holds them (a lane, the settle queue, a failing store): when it is
	// reached, sources wait [2 × LaneCapacity].
	MaxUnsettled int
	// MaxInFlightBytes bounds the bytes (Event.Size) of the events taken
	// and not yet settled, as MaxUnsettled bounds their count
	// (delivery.max_inflight_bytes) [DefaultMaxInFlightBytes]. An event
	// larger than it is taken alone.
	MaxInFlightBytes int64
	// Stream and Claim are the paths' stores; Claim may be nil when no
	// claim path feeds the engine.
	Stream StreamStore
	Claim  ClaimStore
	// Owner names this relay in the ledger's claims and locked_by.
	Owner string
	// ClaimLease is the lease of the claim path's rows and ledger claims
	// (source.lock_timeout) [5m]; the engine renews it while it works.
	ClaimLease time.Duration
	// StallAfter bounds the waits for settlement that a replication
	// session makes (WaitSettled, Consumer.HandOverSettled): one that sees
	// none of the events it waits for settle for this long ends with an
	// error naming them, and so does the session (http.stall_after)
	// [DefaultStallAfter].
	StallAfter time.Duration
	Logger     zerolog.Logger

	// Pauses, when set, says which sinks an operator paused; nil: none is.
	Pauses PauseStore

	// Feed, when set, is told each pair's outcome (the admin API's live
	// feed); it never blocks a lane.
	Feed *Feed
}

// Engine is the one delivery core (docs/architecture.md): the stream and the
// claim path feed it events; it routes each to its sinks' lanes (per
// aggregate order, back-pressure, circuits), sends, decides every outcome
// with the Policy, writes the decisions through the path's store in
// batches, and only then counts the events as settled (and the stream may
// acknowledge them).
//
// Its owner runs it as a worker of its Group (Run) and stops it in one of
// two ways (docs/architecture.md, "Goroutines and their owners"). A
// graceful stop: the sources stop taking events, Drain waits (bounded by
// its context) until every event taken is settled, then Halt, then the
// owner stops its group. An immediate halt, when the lease under which the
// engine delivers is lost: Halt, and nothing more is sent.
type Engine struct {
	cfg   EngineConfig
	log   zerolog.Logger
	lanes []*lane

	// unsettled bounds the works taken and not yet settled, by count and
	// by bytes: the one place that counts what is in flight, on every path.
	unsettled *room

	mu sync.Mutex
	// inflight holds the works taken and not yet settled, by path and id:
	// the stream joins an event the slot sends again while it is in flight,
	// and the claim path renews the leases of its rows.
	inflight map[Path]map[int64]*Work
	idle     *sync.Cond // broadcast when inflight empties

	divertSeq atomic.Uint64 // orders diverts against the claim path's checks
	// pinned holds the aggregates of a hand-over whose rows are still being
	// given to the engine (Consumer.Divert): their streamed events go to
	// the claim path, each aggregate's until its last row is queued.
	pinned atomic.Pointer[pinSet]
	// handOverRoom is the hand-over's share of unsettled: its rows taken
	// and not settled (HandOverWindow, and half the bytes); handOvers
	// counts them, guarded by mu.
	handOverRoom *room
	handOvers    int
	// settledCount counts works settled, per path (Progress); decided, by
	// decision (Decided).
	settledCount map[Path]*atomic.Uint64
	decided      decidedCounts
	draining     atomic.Bool // stop retrying inline: hand waiting retries off
	// halted: send nothing more (Halt); cancelSends, set by Run under mu,
	// cancels the sends in flight.
	halted      atomic.Bool
	cancelSends context.CancelFunc
	// leaseRenewed is when the last successful renewal of the claim path's
	// leases began (unix nanoseconds): every row in flight then is leased
	// from that moment.
	leaseRenewed atomic.Int64
	done         chan struct{} // closed when Run has returned

	settle map[Path]*settleQueue

	started chan struct{}

	stream *streamFeed
	// claimSettled is called after claim-path settlements (OnClaimSettled);
	// a source may register while the engine runs.
	claimSettled atomic.Pointer[func()]

	// now is the circuits' clock: time.Now, or a test's.
	now func() time.Time

	// Stats counts outcomes; safe to read concurrently.
	Stats EngineStats
}

// EngineStats counts outcomes of (event, sink) pairs, and events skipped.
type EngineStats struct {
	Delivered, Diverted, DeadLettered, Held, Retried, Skipped atomic.Int64
}

// NewEngine validates cfg and builds an engine; call Run before feeding it.
func NewEngine(cfg EngineConfig) (*Engine, error) {
	cfg.Policy.setDefaults()
	if cfg.LaneCapacity <= 0 {
		cfg.LaneCapacity = DefaultLaneCapacity
	}
	if cfg.MaxUnsettled <= 0 {
		cfg.MaxUnsettled = 2 * cfg.LaneCapacity
	}
	if cfg.MaxInFlightBytes <= 0 {
		cfg.MaxInFlightBytes = DefaultMaxInFlightBytes
	}
	if cfg.ClaimLease <= 0 {
		cfg.ClaimLease = 5 * time.Minute
	}
	if cfg.StallAfter <= 0 {
		cfg.StallAfter = DefaultStallAfter
	}
	if cfg.Stream == nil {
		return nil, errors.New("engine: no stream store")
	}
	e := &Engine{
		cfg:          cfg,
		log:          cfg.Logger,
		unsettled:    newRoom(cfg.MaxUnsettled, cfg.MaxInFlightBytes),
		handOverRoom: newRoom(handOverWindow(cfg.MaxUnsettled), cfg.MaxInFlightBytes/2),
		inflight:     map[Path]map[int64]*Work{PathStream: {}, PathClaim: {}},
		settledCount: map[Path]*atomic.Uint64{PathStream: new(atomic.Uint64), PathClaim: new(atomic.Uint64)},
		started:      make(chan struct{}),
		done:         make(chan struct{}),
		now:          time.Now,
	}
	e.idle = sync.NewCond(&e.mu)
	e.settle = map[Path]*settleQueue{PathStream: newSettleQueue(e, PathStream), PathClaim: newSettleQueue(e, PathClaim)}
	names := map[string]bool{}
	for _, r := range cfg.Routes {
		if r.Sink == nil {
			return nil, errors.New("engine: a route has no sink")
		}
		if names[r.Sink.Name()] {
			return nil, fmt.Errorf("engine: two sinks named %q", r.Sink.Name())
		}
		if n := len(r.Sink.Name()); n > MaxSinkNameBytes {
			return nil, fmt.Errorf("engine: sink %.40s…: its name is %d bytes; the ledger's action holds at most %d", r.Sink.Name(), n, MaxSinkNameBytes)
		}
		names[r.Sink.Name()] = true
		for _, g := range r.Events {
			if _, err := path.Match(g, ""); err != nil {
				return nil, fmt.Errorf("engine: sink %s: bad event glob %q: %w", r.Sink.Name(), g, err)
			}
		}
		if r.Hold && cfg.Owner == "" {
			return nil, fmt.Errorf("engine: sink %s holds unknown outcomes but the engine has no owner", r.Sink.Name())
		}
		l := newLane(e, r)
		l.idx = len(e.lanes)
		e.lanes = append(e.lanes, l)
	}
	e.stream = newStreamFeed(e)
	return e, nil
}

// handOverWindow is how many of a hand-over's rows an engine holding at most
// maxUnsettled works takes unsettled: HandOverWindow, and at most half its
// room, so that streamed events always find some (the hand-over's bytes are
// half the budget, for the same reason).
func handOverWindow(maxUnsettled int) int { return max(min(HandOverWindow, maxUnsettled/2), 1) }

// ReadBytes is the most payload bytes one read of rows for this engine
// takes: see ReadBytes. The claim path sizes its claims by it.
func (e *Engine) ReadBytes() int64 { return ReadBytes(e.cfg.MaxInFlightBytes) }

// Stream returns the Consumer the replication source feeds.
func (e *Engine) Stream() Consumer { return e.stream }

// StreamLag returns the walsender's lag the replication source last
// reported (Consumer.Sent) and when it did; at is zero when it never has.
// The claim path yields to a stream that lags (docs/architecture.md, "The
// claim path yields to a lagging stream").
func (e *Engine) StreamLag() (lag time.Duration, at time.Time) {
	n := e.stream.sentAt.Load()
	if n == 0 {
		return 0, time.Time{}
	}
	return time.Duration(e.stream.sentLag.Load()), time.Unix(0, n)
}

// Run loads the diverted aggregates, then runs the lanes and the writers
// until ctx is done: it is a worker of its owner's Group, and the engine's
// life is Run's. Every goroutine it starts has ended when it returns, and
// nothing is sent or settled after: the waits for settlement still waiting
// return ErrEngineStopped. A worker that fails — a lane whose sink panics,
// say — ends Run with its error, naming it (relay.Group). The owner ends
// ctx once it has stopped the engine in one of its two ways (Engine).
func (e *Engine) Run(ctx context.Context) error {
	defer func() {
		close(e.done)
		e.mu.Lock()
		e.idle.Broadcast() // waiters for settlement: nothing will settle any more
		e.mu.Unlock()
	}()
	if err := e.loadDivertedRetrying(ctx); err != nil {
		return err
	}
	if err := e.loadPauses(ctx); err != nil {
		return err
	}
	g, ctx := NewGroup(ctx)
	sendCtx, cancelSends := context.WithCancel(ctx)
	defer cancelSends()
	e.mu.Lock()
	e.cancelSends = cancelSends
	e.mu.Unlock()
	if e.halted.Load() {
		cancelSends()
	}
	close(e.started)
	for _, l := range e.lanes {
		g.Go("lane "+l.name, func(ctx context.Context) error { l.dispatch(ctx, sendCtx); return nil })
	}
	for _, p := range []Path{PathStream, PathClaim} {
		q := e.settle[p]
		g.Go("settle "+string(p), func(ctx context.Context) error { q.run(ctx); return nil })
	}
	if e.cfg.Pauses != nil {
		g.Go("pause watch", func(ctx context.Context) error { e.watchPauses(ctx); return nil })
	}
	if e.cfg.Claim != nil {
		g.Go("lease renewer", func(ctx context.Context) error { e.renewLeases(ctx); return nil })
	}
	if err := g.Wait(); err != nil {
		return fmt.Errorf("engine: %w", err)
	}
	return nil
}

// Drain is a graceful stop's wait, called once the sources feeding the
// engine have stopped taking events: from its call on, failed attempts are
// diverted to the claim path instead of retried in memory, and it waits until
// every work taken is settled (its outcome written). It returns ctx's error
// if ctx ends first (ctx is its bound: shutdown_timeout), and
// ErrEngineStopped if Run returns first. It sends nothing itself and does
// not stop sending: the owner halts the engine (Halt) and stops its group
// after it. Safe to call more than once, and concurrently.
func (e *Engine) Drain(ctx context.Context) error {
	e.draining.Store(true)
	return e.waitInFlight(ctx, settleWait{what: "events", count: func() int { return len(e.inflight[PathStream]) + len(e.inflight[PathClaim]) }})
}

// Halt stops sending at once: the lease under which this engine delivers
// is gone, and another relay may already be delivering the same events
// (docs/operations-health.md, "a lost lock"). The sends in flight are
// cancelled (a request already written stays an unknown outcome); every
// event not sent yet — queued behind its aggregate, waiting for an inline
// retry, or handed to a lane from now on — settles as diverted to the claim
// path without being sent, which counts no attempt. Drain then finishes
// quickly. A graceful stop ends with it too, after Drain: what the drain
// left unsettled is not sent. Safe to call more than once, before or after
// Run starts.
func (e *Engine) Halt() {
	e.draining.Store(true)
	e.halted.Store(true)
	e.mu.Lock()
	cancel := e.cancelSends
	e.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// Progress reports, for path p, how many events the engine has taken and
// not yet settled, and how many it has settled since it was built. The
// stall detector reads it (docs/operations-health.md): events held for long
// while the count stands still are a stall. Safe to call concurrently.
func (e *Engine) Progress(p Path) (unsettled int, settled uint64) {
	e.mu.Lock()
	unsettled = len(e.inflight[p])
	e.mu.Unlock()
	if c := e.settledCount[p]; c != nil {
		settled = c.Load()
	}
	return unsettled, settled
}

// waitStarted waits until Run has started the lanes, or ctx ends.
func (e *Engine) waitStarted(ctx context.Context) error {
	select {
	case <-e.started:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// DefaultStallAfter is EngineConfig.StallAfter's default, and
// http.stall_after's.
const DefaultStallAfter = 5 * time.Minute

// retry runs f until it succeeds or ctx ends, waiting RetryDelay between
// attempts and telling warn each time.
func retry(ctx context.Context, f func() error, warn func(error, time.Duration)) error {
	for attempt := 1; ; attempt++ {
		err := f()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		wait := RetryDelay(attempt)
		warn(err, wait)
		if !Sleep(ctx, wait) {
			return ctx.Err()
		}
	}
}

// Sleep waits d or until ctx ends; it reports whether d passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// ErrLeaseLost marks the loss of a lease under which the relay delivers — the
// claim path's owner lock: the rows it claimed may be taken over by another
// relay, so nothing more may be sent under it (Engine.Halt) and the phase
// ends (docs/operations-health.md, "a lost lock").
var ErrLeaseLost = errors.New("lease lost")
