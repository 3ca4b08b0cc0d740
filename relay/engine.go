package relay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/time/rate"
)

// Route connects a sink to the engine.
type Route struct {
	Sink Sink
	// Events lists the event_type globs (path.Match syntax) the sink takes;
	// empty means all. A NULL event_type matches only "*".
	Events []string
	// Nudge sends {"id","event_key","event_type"} instead of the envelope.
	Nudge bool
	// RateLimit, when set, bounds the events sent to the sink per second
	// (NewRateLimit; docs/sinks.md, "Rate limits"); share one per sink
	// across the process's engines.
	RateLimit *rate.Limiter
	// Hold (on_unknown: hold) claims each event in the ledger before sending
	// and holds it for a person when the outcome is unknown, instead of
	// sending it again.
	Hold bool
	// Filter, when set, is the sink's sinks[].filter: the sink takes only
	// the events it accepts (Takes).
	Filter Filter
}

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
	Delivered, HandedOff, DeadLettered, Held, Retried, Skipped atomic.Int64
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
// until ctx is done. Call Drain first for a graceful stop, and Halt when
// nothing more may be sent (a lost lease). Every goroutine it starts has
// ended when it returns, and Done is closed then. A worker that fails — a
// lane whose sink panics, say — ends Run with its error, naming it
// (relay.Group).
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

// Done is closed once Run has returned: nothing is sent or settled after.
func (e *Engine) Done() <-chan struct{} { return e.done }

// Halt stops sending at once: the lease under which this engine delivers
// is gone, and another relay may already be delivering the same events
// (docs/operations-health.md, "a lost lock"). The sends in flight are
// cancelled (a request already written stays an unknown outcome); every
// event not sent yet — queued behind its aggregate, waiting for an inline
// retry, or handed to a lane from now on — settles as handed to the claim
// path without being sent, which counts no attempt. Drain then finishes
// quickly. Safe to call more than once, before or after Run starts.
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

// BeginDrain makes failed attempts go to the claim path from now on instead
// of being retried in memory; Drain calls it. Safe to call more than once.
func (e *Engine) BeginDrain() { e.draining.Store(true) }

// DefaultStallAfter is EngineConfig.StallAfter's default, and
// http.stall_after's.
const DefaultStallAfter = 5 * time.Minute

// Drain waits until every work taken is settled; from now on, failed
// attempts are handed off instead of retried in memory. It returns ctx's
// error if that comes first: ctx is its bound (shutdown_timeout).
func (e *Engine) Drain(ctx context.Context) error {
	e.draining.Store(true)
	return e.waitInFlight(ctx, settleWait{what: "events", count: func() int { return len(e.inflight[PathStream]) + len(e.inflight[PathClaim]) }})
}

// WaitSettled waits until every stream work taken so far is settled, or
// ctx ends, or the engine stops (ErrEngineStopped), or none of them has
// settled for StallAfter: then it returns an error naming some of them.
// The replication source calls it before it creates a slot, so that the new
// slot's hand-over does not give the claim path rows the engine is still
// delivering (they would reach the sinks twice); the claim path's works
// are rows claimed or handed off, never in a new slot's snapshot.
func (e *Engine) WaitSettled(ctx context.Context) error {
	return e.waitInFlight(ctx, settleWait{what: "stream events", count: func() int { return len(e.inflight[PathStream]) },
		match: func(w *Work) bool { return w.path == PathStream }, stall: e.cfg.StallAfter})
}

// WaitPathSettled waits until every work of path p taken so far is
// settled, or ctx ends, or the engine stops (ErrEngineStopped). The claim
// source calls it before it releases its owner lock: it must hold the lock
// while its rows may be sent, so its bound is the engine's stop, which
// follows the phase's drain (shutdown_timeout).
func (e *Engine) WaitPathSettled(ctx context.Context, p Path) error {
	return e.waitInFlight(ctx, settleWait{what: string(p) + " events", count: func() int { return len(e.inflight[p]) }})
}

// settleWait is what a wait for settlement waits for.
type settleWait struct {
	what  string           // names the works in an error: "stream events"
	count func() int       // how many are unsettled; called under mu
	match func(*Work) bool // which works in flight they are, to name some
	// stall, when set, ends the wait with an error once count has not
	// gone down for that long. The works a bounded wait counts are all
	// taken before it begins, so count only goes down as they settle.
	stall time.Duration
}

// waitInFlight waits until w.count() is 0, or ctx ends, or the engine
// stops, or (w.stall) nothing it counts settles for w.stall.
func (e *Engine) waitInFlight(ctx context.Context, w settleWait) error {
	wake := func() {
		e.mu.Lock()
		e.idle.Broadcast()
		e.mu.Unlock()
	}
	stop := context.AfterFunc(ctx, wake)
	defer stop()
	var check *time.Timer
	if w.stall > 0 {
		check = time.AfterFunc(w.stall, wake)
		defer check.Stop()
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	left, checkAt := w.count(), time.Now().Add(w.stall)
	for n := left; n > 0; n = w.count() {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		select {
		case <-e.done:
			return ErrEngineStopped
		default:
		}
		if w.stall > 0 && !time.Now().Before(checkAt) {
			if n >= left {
				return fmt.Errorf("%d %s unsettled, none settled for %s: %s", n, w.what, w.stall, e.describeInFlight(w.match))
			}
			left, checkAt = n, time.Now().Add(w.stall)
			check.Reset(w.stall)
		}
		e.idle.Wait()
	}
	return nil
}

// describeInFlight names the first few works in flight that match, by id,
// and what each waits for. Called under mu.
func (e *Engine) describeInFlight(match func(*Work) bool) string {
	var works []*Work
	for _, byID := range e.inflight {
		for _, w := range byID {
			if match(w) {
				works = append(works, w)
			}
		}
	}
	slices.SortFunc(works, func(a, b *Work) int { return cmp.Compare(a.Event.ID, b.Event.ID) })
	var parts []string
	for _, w := range works[:min(len(works), 3)] {
		waits := "its outcome to be written"
		if n := w.remaining.Load(); n > 0 {
			waits = fmt.Sprintf("%d of %d sinks to answer", n, len(w.Pairs))
		}
		parts = append(parts, fmt.Sprintf("id %d (event_key %q, waiting for %s)", w.Event.ID, w.Event.EventKey, waits))
	}
	if len(works) > len(parts) {
		parts = append(parts, fmt.Sprintf("and %d more", len(works)-len(parts)))
	}
	return strings.Join(parts, ", ")
}

// ErrEngineStopped is returned by the waits for settlement when the engine
// stopped first: what it had not settled never will be (the next owner
// takes it over).
var ErrEngineStopped = errors.New("the engine stopped with events unsettled")

// loadDiverted marks, in every lane, the aggregates the table shows with a
// handed-off or held event, so their new events follow them.
func (e *Engine) loadDiverted(ctx context.Context) error {
	diverted, err := e.cfg.Stream.Diverted(ctx)
	if err != nil {
		return fmt.Errorf("load diverted aggregates: %w", err)
	}
	e.divertAll(diverted)
	if len(diverted) > 0 {
		e.log.Info().Int("aggregates", len(diverted)).Msg("aggregates with handed-off or held events: their new events go to the claim path until those settle")
	}
	return nil
}

// divertAll diverts aggs in every lane: their new stream events are
// handed to the claim path.
func (e *Engine) divertAll(aggs []AggregateKey) {
	for _, l := range e.lanes {
		l.mu.Lock()
		for _, a := range aggs {
			l.diverted[a] = e.divertSeq.Add(1)
		}
		l.mu.Unlock()
	}
}

// divertPinned pins aggs until release: see Consumer.Divert.
func (e *Engine) divertPinned(aggs []AggregateKey) (release func([]AggregateKey)) {
	set := &pinSet{set: make(map[AggregateKey]bool, len(aggs))}
	for _, a := range aggs {
		set.set[a] = true
	}
	// The lanes read the pin for streamed events (pinnedNow): the rows
	// of the hand-over pass it, and a streamed event that meets it is
	// handed off, which diverts its aggregate as any hand-off does.
	// With nothing pinned (or once everything is released) no set is
	// kept: every streamed event's enqueue reads it.
	if len(aggs) == 0 {
		e.pinned.Store(nil)
		return func([]AggregateKey) {}
	}
	e.pinned.Store(set)
	e.log.Info().Int("aggregates", len(aggs)).Msg("aggregates of the new slot's hand-over: their streamed events go to the claim path until the rows committed before the slot are queued")
	// A pin replaced since (the next session's Restart) is no longer
	// read: releasing from it is harmless.
	return func(done []AggregateKey) {
		if set.release(done) {
			e.pinned.CompareAndSwap(set, nil)
		}
	}
}

// pinSet is a hand-over's pinned aggregates, each until its rows are
// queued. A streamed event it hands off diverts its aggregate in the lanes
// as any hand-off does, until the claim path has delivered it, which the
// claim path does only after the hand-over's rows before it (its ordering
// check waits for them in the table).
type pinSet struct {
	mu  sync.Mutex
	set map[AggregateKey]bool
}

// pinnedNow reports whether a's pin has not been released yet.
func (p *pinSet) pinnedNow(a AggregateKey) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.set[a]
}

// release ends the pins of aggs and reports whether none is left.
func (p *pinSet) release(aggs []AggregateKey) (empty bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, a := range aggs {
		delete(p.set, a)
	}
	return len(p.set) == 0
}

// pinnedNow reports whether a is an aggregate of a hand-over whose rows are
// not all queued yet.
func (e *Engine) pinnedNow(a AggregateKey) bool {
	p := e.pinned.Load()
	return p != nil && p.pinnedNow(a)
}

// loadDivertedRetrying is loadDiverted, retried while the database is
// unreachable; it fails only when ctx ends.
func (e *Engine) loadDivertedRetrying(ctx context.Context) error {
	return retry(ctx, func() error { return e.loadDiverted(ctx) }, func(err error, wait time.Duration) {
		e.log.Warn().Err(err).Dur("retry_in", wait).Msg("load diverted aggregates; retrying")
	})
}

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

// DivertSeq returns the current divert sequence number; see undiverted.
func (e *Engine) DivertSeq() uint64 { return e.divertSeq.Load() }

// undiverted lets the stream deliver an aggregate's events again once the
// claim path has settled its last handed-off or held event. seq is DivertSeq
// read before the claim path looked at the table: a hand-off decided after
// that, or one not yet written, keeps the aggregate diverted, so a later
// event never overtakes it.
func (e *Engine) undiverted(a AggregateKey, seq uint64) {
	for _, l := range e.lanes {
		l.mu.Lock()
		if at, ok := l.diverted[a]; ok && at <= seq && l.unwritten[a] == 0 {
			delete(l.diverted, a)
		}
		l.mu.Unlock()
	}
}

// divertedAmong returns those of aggs that some lane diverts now.
func (e *Engine) divertedAmong(aggs []AggregateKey) []AggregateKey {
	out := aggs[:0:0]
	for _, a := range aggs {
		for _, l := range e.lanes {
			l.mu.Lock()
			_, diverted := l.diverted[a]
			l.mu.Unlock()
			if diverted {
				out = append(out, a)
				break
			}
		}
	}
	return out
}

// route builds the work of ev: one pair per sink that takes it (Takes), or
// none when the ledger cannot record its deliveries (refuse.go). A pair
// whose sink's filter failed on ev is dead-lettered unsent (dispatch).
func (e *Engine) route(p Path, ev *Event) *Work {
	e.readTrace(ev)
	w := &Work{Event: ev, path: p, size: ev.Size()}
	if reason := unrecordable(ev); reason != "" {
		w.refuse(reason)
		return w
	}
	for _, l := range e.lanes {
		takes, err := l.route.Takes(ev)
		if takes {
			p := &Pair{Sink: l.name, Hold: l.route.Hold}
			if err != nil {
				p.refused = ShortError(err.Error())
			}
			w.Pairs = append(w.Pairs, p)
			w.lanes = append(w.lanes, l)
		}
	}
	ev.payload = nil // decoded for the filters only (PayloadValue)
	return w
}

// take acquires room for works, a group cut by e.unsettled.fit, blocking
// while the works unsettled leave too little, by count or by bytes
// (back-pressure on every source).
func (e *Engine) take(ctx context.Context, works []*Work) error {
	return e.unsettled.take(ctx, works)
}

// admit registers w as in flight. For the stream it counts w in ticket's
// transaction first; a hand-over's row is counted among the hand-over's.
func (e *Engine) admit(w *Work, ticket *txnEntry) {
	e.mu.Lock()
	if ticket != nil {
		e.stream.tracker.count(ticket)
		w.tickets = append(w.tickets, ticket)
	}
	if w.handOver {
		e.handOvers++
	}
	e.inflight[w.path][w.Event.ID] = w
	e.mu.Unlock()
}

// joinInFlight attaches ticket to the stream work of id already in flight,
// and reports whether there was one.
func (e *Engine) joinInFlight(id int64, ticket *txnEntry) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	w, ok := e.inflight[PathStream][id]
	if !ok {
		return false
	}
	e.stream.tracker.count(ticket)
	w.tickets = append(w.tickets, ticket)
	return true
}

// dispatch starts w's pairs: those Prepare settled go straight to their
// outcome, the others into their lanes. A scheduled stream event (its
// available_at is in the future) goes to the claim path. block says how
// long a full lane may hold the caller: the stream waits at most
// LaneBlockMax, the claim path until ctx ends. A pair that cannot be queued
// because ctx ended is deferred.
func (e *Engine) dispatch(ctx context.Context, w *Work, now time.Time) {
	w.remaining.Store(int32(len(w.Pairs)))
	if len(w.Pairs) == 0 {
		e.finishWork(w)
		return
	}
	scheduled := w.path == PathStream && !w.Event.AvailableAt.IsZero() && w.Event.AvailableAt.After(now)
	for i, p := range w.Pairs {
		l := w.lanes[i]
		t := &task{w: w, p: p, l: l}
		switch {
		case p.State == PairDelivered:
			l.complete(t, Outcome{Kind: Delivered}, false)
		case p.refused != "":
			l.complete(t, Outcome{Kind: Failed, Reason: p.refused}, false)
		case p.State == PairBlocked:
			l.complete(t, Outcome{Kind: Deferred, Reason: "another owner (" + orUnknown(p.PrevOwner) + ") holds a live claim to send it",
				Until: now.Add(time.Second), Why: "claimed"}, false)
		case p.State == PairUnknown && p.Hold:
			reason := "outcome unknown: claimed for sending before a restart or by another relay"
			if p.PrevOwner != "" {
				reason = "outcome unknown: took over the ledger claim of " + p.PrevOwner + " (lease passed or owner gone)"
			}
			l.complete(t, Outcome{Kind: Held, Reason: reason, Unknown: true}, false)
		case scheduled:
			// Diverted now, by complete: the next event of the aggregate,
			// decoded a moment later, must follow it.
			l.complete(t, Outcome{Kind: Deferred, Reason: "available_at is in the future", Until: w.Event.AvailableAt, Why: "scheduled"}, false)
		default:
			if p.State == PairUnknown {
				e.log.Warn().Str("sink", p.Sink).Int64("id", w.Event.ID).Str("event_key", w.Event.EventKey).Str("old_owner", orUnknown(p.PrevOwner)).
					Msg("took over a ledger claim whose lease passed or whose owner is gone: outcome unknown, sending again with the same id and body")
			}
			l.enqueue(ctx, t)
		}
	}
}

// finishWork decides w once every pair has an outcome and queues it for
// settlement.
func (e *Engine) finishWork(w *Work) {
	switch {
	case w.Skip:
		w.Decision = Decision{Kind: Skip}
	case w.refused != "":
		w.Decision = Decision{Kind: DeadLetter, Attempts: w.Event.Attempts, Reason: w.refused}
		e.logDecision(w)
	default:
		outcomes := make([]Outcome, len(w.Pairs))
		sinks := make([]string, len(w.Pairs))
		for i, p := range w.Pairs {
			outcomes[i], sinks[i] = p.Outcome, p.Sink
		}
		w.Decision = e.cfg.Policy.decide(time.Now(), w.Event.Attempts, outcomes, sinks)
		e.logDecision(w)
	}
	e.settle[w.path].add(w)
}

// logDecision logs what w's decision makes of each failure of its pairs,
// as the lanes log failures (lanelog.go): once per event and change.
func (e *Engine) logDecision(w *Work) {
	if w.refused != "" {
		e.log.Warn().Str("path", string(w.path)).Int64("id", w.Event.ID).Str("event_key", w.Event.EventKey).
			Str("error", w.Decision.Reason).Msg("event failed: dead-lettered unsent; see outbox-relay dlq list")
		return
	}
	for i, p := range w.Pairs {
		w.lanes[i].logDecided(w, p.Outcome, w.Decision)
	}
}

// settled is called once w's decision is written (or needs no write): it
// frees w's room, lets the stream acknowledge it, and tells the lanes the
// claim path can now see a hand-off.
func (e *Engine) settled(w *Work) {
	for i, p := range w.Pairs {
		if diverts(p.Outcome.Kind) && w.Decision.Kind != Skip {
			w.lanes[i].written(w.Event)
		}
	}
	e.mu.Lock()
	tickets := w.tickets
	w.tickets = nil
	e.decided.add(w.Decision.Kind) // counted before a waiter can see it settled
	if e.inflight[w.path][w.Event.ID] == w {
		delete(e.inflight[w.path], w.Event.ID)
	}
	for _, t := range tickets {
		e.stream.tracker.done(t)
	}
	if w.handOver {
		e.handOvers--
		e.handOverRoom.give(w)
	}
	if len(e.inflight[w.path]) == 0 || w.handOver && e.handOvers == 0 {
		e.idle.Broadcast()
	}
	e.mu.Unlock()
	e.settledCount[w.path].Add(1)
	e.unsettled.give(w)
}

// diverts reports whether a pair with this outcome leaves its event with
// the claim path (or a person), so that the aggregate's later events must
// follow it.
func diverts(k OutcomeKind) bool { return k == Retry || k == Deferred || k == Held }

// leaseLeft reports how much of the claim path's lease on w is left, less
// a margin (a tenth of the lease, 1-30 s): from its claim, or the last
// successful renewal after it. Another relay's sweeper takes a row over
// once its lease has passed, so a claimed row is sent only while this is
// positive (docs/operations-health.md, "a lost lock").
func (e *Engine) leaseLeft(w *Work, now time.Time) time.Duration {
	from := w.ClaimedAt
	if r := time.Unix(0, e.leaseRenewed.Load()); r.After(from) {
		from = r
	}
	margin := min(max(e.cfg.ClaimLease/10, time.Second), 30*time.Second)
	if margin > e.cfg.ClaimLease/4 {
		margin = e.cfg.ClaimLease / 4
	}
	return from.Add(e.cfg.ClaimLease - margin).Sub(now)
}

// renewLeases extends the claim path's leases on the rows it is working on,
// every third of the lease, until ctx ends.
func (e *Engine) renewLeases(ctx context.Context) {
	every := max(e.cfg.ClaimLease/3, 100*time.Millisecond)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		e.mu.Lock()
		ids := make([]int64, 0, len(e.inflight[PathClaim]))
		for id := range e.inflight[PathClaim] {
			ids = append(ids, id)
		}
		e.mu.Unlock()
		if len(ids) == 0 {
			continue
		}
		began := time.Now()
		if err := e.cfg.Claim.ExtendLeases(ctx, ids, e.cfg.Owner); err != nil {
			if ctx.Err() == nil {
				e.log.Warn().Err(err).Int("rows", len(ids)).Msg("extend the leases of rows being delivered; retrying at the next renewal (rows whose lease passes meanwhile are not sent)")
			}
			continue
		}
		e.leaseRenewed.Store(began.UnixNano())
	}
}

// SubmitClaimed hands rows the claim path claimed to the engine: it
// prepares their ledger claims and queues them; a row whose claims the
// ledger refuses for its data is dead-lettered unsent (refuse.go). It
// blocks while the engine applies back-pressure. On an error (ctx ended,
// or the ledger claims could not be made) the rows it did not take are
// returned to the caller, which puts them back; every row it took is
// settled by the engine.
func (e *Engine) SubmitClaimed(ctx context.Context, works []*Work) (notTaken []*Work, err error) {
	if e.cfg.Claim == nil {
		return works, errors.New("engine: no claim store")
	}
	if err := e.waitStarted(ctx); err != nil {
		return works, err
	}
	if len(works) == 0 {
		return nil, nil
	}
	e.linkRuns(works)
	for _, w := range works {
		w.path = PathClaim
		routed := e.route(PathClaim, w.Event)
		w.Pairs, w.lanes, w.refused, w.size = routed.Pairs, routed.lanes, routed.refused, routed.size
		if w.ClaimedAt.IsZero() {
			w.ClaimedAt = time.Now()
		}
	}
	// Room for more than the engine holds at once never comes: a larger
	// batch is taken in parts, in order.
	for len(works) > 0 {
		part := works[:e.unsettled.fit(works)]
		works = works[len(part):]
		if err := e.submitClaimedPart(ctx, part); err != nil {
			return slices.Concat(part, works), err
		}
	}
	return nil, nil
}

// submitClaimedPart takes room for works, prepares their ledger claims and
// queues them; on an error it has taken none of them.
func (e *Engine) submitClaimedPart(ctx context.Context, works []*Work) error {
	if err := e.take(ctx, works); err != nil {
		return err
	}
	err := e.prepareIsolating(ctx, works, func(ctx context.Context, works []*Work) error {
		return e.cfg.Claim.PrepareClaim(ctx, works, e.cfg.Owner, e.cfg.ClaimLease)
	})
	if err != nil {
		e.unsettled.give(works...)
		return fmt.Errorf("claim the ledger pairs of %d rows: %w", len(works), err)
	}
	now := time.Now()
	for _, w := range works {
		e.admit(w, nil)
	}
	for _, w := range works {
		e.dispatch(ctx, w, now)
	}
	return nil
}

// linkRuns links the works of each aggregate that came in one claim (in id
// order): a run. A run's later rows never go out in a lane once an earlier
// one was not delivered there (claimRun).
func (e *Engine) linkRuns(works []*Work) {
	if e.cfg.Unordered || len(works) < 2 {
		return
	}
	var count map[AggregateKey]int
	for _, w := range works {
		if w.run == nil && w.Event.Ordered() {
			if count == nil {
				count = map[AggregateKey]int{}
			}
			count[w.Event.AggregateKey()]++
		}
	}
	runs := map[AggregateKey]*claimRun{}
	for _, w := range works {
		if w.run != nil || !w.Event.Ordered() {
			continue
		}
		agg := w.Event.AggregateKey()
		if count[agg] < 2 {
			continue
		}
		r := runs[agg]
		if r == nil {
			r = &claimRun{stopped: make([]bool, len(e.lanes))}
			runs[agg] = r
		}
		w.run = r
	}
}

func orUnknown(owner string) string {
	if owner == "" {
		return "unknown owner"
	}
	return owner
}

// ErrLeaseLost marks the loss of a lease under which the relay delivers — the
// claim path's owner lock: the rows it claimed may be taken over by another
// relay, so nothing more may be sent under it (Engine.Halt) and the phase
// ends (docs/operations-health.md, "a lost lock").
var ErrLeaseLost = errors.New("lease lost")
