package relay

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// Route connects a sink to the engine.
type Route struct {
	Sink Sink
	// Events lists the event_type globs (path.Match syntax) the sink takes;
	// empty means all. A NULL event_type matches only "*".
	Events []string
	// Nudge sends {"id","event_key","event_type"} instead of the envelope.
	Nudge bool
	// Hold (on_unknown: hold) claims each event in the ledger before sending
	// and holds it for a person when the outcome is unknown, instead of
	// sending it again. It costs one synchronous round trip per event.
	Hold bool
}

// EngineConfig configures an Engine. Zero values take the defaults in brackets.
type EngineConfig struct {
	Routes []Route
	Store  Store
	// Unordered turns off per-aggregate ordering (ordering: none).
	Unordered bool
	// InlineAttempts is how many times the stream tries an event in memory
	// before handing it to the claim path [3]; 0 hands off on first failure.
	InlineAttempts int
	// MaxAttempts dead-letters an event after this many counted attempts [10].
	MaxAttempts int
	// Backoff is the claim path's schedule, indexed by attempts made
	// [1s 5s 30s 2m 5m 15m 30m 1h]; 0–10% jitter is added.
	Backoff []time.Duration
	// LaneBlockMax is how long a full lane may block decoding before the
	// event is handed off instead [2s].
	LaneBlockMax time.Duration
	// LaneCapacity bounds the events a sink holds (queued, in flight or
	// waiting to retry) [4096].
	LaneCapacity int
	// MarkDone marks fully delivered rows done, in batches, off the
	// acknowledgement path [false: the ledger is the record].
	MarkDone bool
	// Holds and Owner serve routes with Hold; Owner names this instance in
	// the ledger's claims.
	Holds  HoldStore
	Owner  string
	Logger zerolog.Logger
}

func (c *EngineConfig) setDefaults() {
	if c.InlineAttempts < 0 {
		c.InlineAttempts = 0
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 10
	}
	if len(c.Backoff) == 0 {
		c.Backoff = []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 2 * time.Minute,
			5 * time.Minute, 15 * time.Minute, 30 * time.Minute, time.Hour}
	}
	if c.LaneBlockMax <= 0 {
		c.LaneBlockMax = 2 * time.Second
	}
	if c.LaneCapacity <= 0 {
		c.LaneCapacity = 4096
	}
}

// Engine delivers streamed events to sinks. It implements Consumer for the
// replication source: events come in commit order, each routed sink gets its
// own lane, per-aggregate order is kept within a lane, and every outcome is
// written through the Store before the event counts as settled.
type Engine struct {
	cfg   EngineConfig
	log   zerolog.Logger
	lanes []*lane

	tracker   *tracker
	horizon   atomic.Uint64 // events committed before this LSN may have been seen before
	divertSeq atomic.Uint64 // orders diverts against the claim path's checks

	settleMu   sync.Mutex
	toSettle   []*eventState
	settleWake chan struct{}

	doneMu   sync.Mutex
	toMark   []int64
	markWake chan struct{}
	markTry  map[int64]int // ids whose row was not visible yet: tries so far

	runCtx   context.Context // valid once Run started; timers use it
	runStop  context.CancelFunc
	started  chan struct{}
	stopping chan struct{} // closed when Drain asks inline retries to hand off
	stopOnce sync.Once

	// Metrics hooks for tests and /metrics.
	Stats EngineStats
}

// EngineStats counts outcomes; safe to read concurrently.
type EngineStats struct {
	Delivered, HandedOff, DeadLettered, Held, Retried, Skipped atomic.Int64
}

var _ Consumer = (*Engine)(nil)

// NewEngine builds an engine; call Run before submitting events.
func NewEngine(cfg EngineConfig) (*Engine, error) {
	cfg.setDefaults()
	if cfg.Store == nil {
		return nil, errors.New("engine: no store")
	}
	for _, r := range cfg.Routes {
		if r.Hold && (cfg.Holds == nil || cfg.Owner == "") {
			return nil, fmt.Errorf("engine: sink %s holds unknown outcomes but the engine has no hold store or owner", r.Sink.Name())
		}
	}
	e := &Engine{
		cfg:        cfg,
		log:        cfg.Logger,
		tracker:    newTracker(),
		settleWake: make(chan struct{}, 1),
		markWake:   make(chan struct{}, 1),
		markTry:    map[int64]int{},
		started:    make(chan struct{}),
		stopping:   make(chan struct{}),
	}
	names := map[string]bool{}
	for _, r := range cfg.Routes {
		if names[r.Sink.Name()] {
			return nil, fmt.Errorf("engine: two sinks named %q", r.Sink.Name())
		}
		names[r.Sink.Name()] = true
		for _, g := range r.Events {
			if _, err := path.Match(g, ""); err != nil {
				return nil, fmt.Errorf("engine: sink %s: bad event glob %q: %w", r.Sink.Name(), g, err)
			}
		}
		e.lanes = append(e.lanes, newLane(e, r))
	}
	return e, nil
}

// Run loads the diverted aggregates, then runs the lanes and the writers
// until ctx is done. Call Drain first for a graceful stop.
func (e *Engine) Run(ctx context.Context) error {
	if err := e.loadDivertedRetrying(ctx); err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	e.runCtx, e.runStop = ctx, cancel
	close(e.started)

	var wg sync.WaitGroup
	for _, l := range e.lanes {
		wg.Go(func() { l.dispatch(ctx) })
	}
	wg.Go(func() { e.settleLoop(ctx) })
	wg.Go(func() { e.markDoneLoop(ctx) })
	<-ctx.Done()
	cancel()
	wg.Wait()
	return nil
}

// loadDiverted marks, in every lane, the aggregates the table shows with a
// handed-off or held event, so their new events follow them.
func (e *Engine) loadDiverted(ctx context.Context) error {
	diverted, err := e.cfg.Store.Diverted(ctx)
	if err != nil {
		return fmt.Errorf("load diverted aggregates: %w", err)
	}
	for _, l := range e.lanes {
		l.mu.Lock()
		for _, a := range diverted {
			l.diverted[a] = e.divertSeq.Add(1)
		}
		l.mu.Unlock()
	}
	if len(diverted) > 0 {
		e.log.Info().Int("aggregates", len(diverted)).Msg("aggregates with handed-off or held events: their new events go to the claim path until those settle")
	}
	return nil
}

// Drain waits until every submitted event is settled; inline retries still
// waiting are handed off at once. It returns ctx's error if that comes first.
func (e *Engine) Drain(ctx context.Context) error {
	e.stopOnce.Do(func() { close(e.stopping) })
	if !e.tracker.waitIdle(ctx.Done()) {
		return ctx.Err()
	}
	e.flushMarkDone(ctx)
	return nil
}

// WaitSettled waits until every event submitted so far is settled, or ctx
// ends. The replication source calls it before it creates a slot, so that
// the new slot's hand-over does not give the claim path rows the engine is
// still delivering (they would reach the sinks twice).
func (e *Engine) WaitSettled(ctx context.Context) error {
	if !e.tracker.waitIdle(ctx.Done()) {
		return ctx.Err()
	}
	return nil
}

// DivertSeq returns the current divert sequence number. The claim path reads
// it before checking the table for an aggregate's unsettled hand-offs and
// passes it to Undiverted.
func (e *Engine) DivertSeq() uint64 { return e.divertSeq.Load() }

// Undiverted lets the stream deliver an aggregate's events again once the
// claim path has settled its last handed-off or held event. seq is DivertSeq
// read before the claim path looked at the table: a hand-off the engine made
// (or wrote) after that, or one not yet written, keeps the aggregate
// diverted, so a later event never overtakes it.
func (e *Engine) Undiverted(a AggregateKey, seq uint64) {
	for _, l := range e.lanes {
		l.mu.Lock()
		if at, ok := l.diverted[a]; ok && at <= seq && l.unwritten[a] == 0 {
			delete(l.diverted, a)
		}
		l.mu.Unlock()
	}
}

// Submit implements Consumer.
func (e *Engine) Submit(ctx context.Context, events []*Event) error {
	if len(events) == 0 {
		return nil
	}
	select {
	case <-e.started:
	case <-ctx.Done():
		return ctx.Err()
	}

	var known map[int64]RowState
	if h := LSN(e.horizon.Load()); h != 0 && events[0].CommitLSN < h {
		var err error
		if known, err = e.restreamed(ctx, events); err != nil {
			return err
		}
	}

	entry := e.tracker.add(len(events))
	now := time.Now()
	if ct := events[0].CommitTime; !ct.IsZero() {
		// One transaction's events share their commit time.
		lag := now.Sub(ct).Seconds()
		for range events {
			decodeLatency.Observe(lag)
		}
	}
	for _, ev := range events {
		st := &eventState{ev: ev, entry: entry}
		state, seen := known[ev.ID]
		switch {
		case ev.Status != "" && ev.Status != "pending":
			// Inserted already settled (or held) by the application: not ours.
			e.Stats.Skipped.Add(1)
			e.resolveSkipped(st)
			continue
		case seen && !state.Owned:
			// Settled, handed off or claimed before the restart.
			e.Stats.Skipped.Add(1)
			e.resolveSkipped(st)
			continue
		}

		var routed []*lane
		for _, l := range e.lanes {
			if l.routes(ev) && !contains(state.Delivered, l.name) {
				routed = append(routed, l)
			}
		}
		if len(routed) == 0 {
			st.allDelivered = true
			e.resolveSkipped(st)
			continue
		}
		st.remaining.Store(int32(len(routed)))
		if !ev.AvailableAt.IsZero() && ev.AvailableAt.After(now) {
			// Scheduled for later: the claim path honours available_at.
			for _, l := range routed {
				e.finish(l, &task{st: st}, outcome{kind: outcomeHandOff, reason: "available_at is in the future",
					availableAt: ev.AvailableAt, why: "scheduled"})
			}
			continue
		}
		for _, l := range routed {
			if err := l.enqueue(ctx, &task{st: st}); err != nil {
				return err
			}
		}
	}
	return nil
}

// restreamed asks the store about events the slot may be sending again,
// retrying while the database is unreachable.
func (e *Engine) restreamed(ctx context.Context, events []*Event) (map[int64]RowState, error) {
	for attempt := 0; ; attempt++ {
		known, err := e.cfg.Store.Restreamed(ctx, events)
		if err == nil {
			return known, nil
		}
		e.log.Warn().Err(err).Msg("check re-streamed events against the ledger; retrying")
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(retryDelay(attempt)):
		}
	}
}

// Commit implements Consumer.
func (e *Engine) Commit(endLSN LSN) { e.tracker.commit(endLSN) }

// Keepalive implements Consumer.
func (e *Engine) Keepalive(walEnd LSN) { e.tracker.keepalive(walEnd) }

// Settled implements Consumer.
func (e *Engine) Settled() (LSN, bool) { return e.tracker.position() }

// Restart implements Consumer.
//
// It also reloads the diverted aggregates: a new slot's hand-over has just
// given the claim path every row pending before it, and the stream must not
// overtake those.
func (e *Engine) Restart(ctx context.Context, horizon LSN) error {
	if !e.tracker.waitIdle(ctx.Done()) {
		return ctx.Err()
	}
	e.tracker.reset()
	e.horizon.Store(uint64(horizon))
	return e.loadDivertedRetrying(ctx)
}

// loadDivertedRetrying is loadDiverted, retried while the database is
// unreachable (a term that starts just after a PostgreSQL restart); it fails
// only when ctx ends. Run must not fail on this: the source would keep
// streaming into an engine that never started.
func (e *Engine) loadDivertedRetrying(ctx context.Context) error {
	for attempt := 0; ; attempt++ {
		err := e.loadDiverted(ctx)
		if err == nil {
			return nil
		}
		e.log.Warn().Err(err).Msg("load diverted aggregates; retrying")
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(retryDelay(attempt)):
		}
	}
}

// eventState collects the outcome of one event across its sinks.
type eventState struct {
	ev        *Event
	entry     *txnEntry
	remaining atomic.Int32 // routed sinks without an outcome yet

	bodyOnce sync.Once
	envelope []byte
	nudge    []byte

	mu           sync.Mutex
	delivered    []string
	handOff      *HandOff
	deadLetter   string
	held         bool // the store already holds the row
	allDelivered bool
	diverters    []*lane // lanes that handed the event off or held it
	// invisibleSince is when a row change first found the row invisible.
	invisibleSince time.Time
}

func (st *eventState) body(nudge bool) []byte {
	st.bodyOnce.Do(func() { st.envelope = st.ev.AppendEnvelope(nil) })
	if !nudge {
		return st.envelope
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.nudge == nil {
		st.nudge = st.ev.AppendNudge(nil)
	}
	return st.nudge
}

type outcomeKind int

const (
	outcomeDelivered outcomeKind = iota
	outcomeHandOff
	outcomeDeadLetter
	outcomeHeld // written by HoldStore.Hold before the outcome is recorded
)

type outcome struct {
	kind        outcomeKind
	reason      string
	availableAt time.Time
	counted     int    // attempts that count against max_attempts
	why         string // hand-off reason for the metric label
}

// metric is the handed_off_total reason label.
func (o outcome) metric() string {
	if o.why == "" {
		return "retries"
	}
	return o.why
}

// finish records one sink's outcome for an event; the last one queues the
// event for settlement.
func (e *Engine) finish(l *lane, t *task, o outcome) {
	st := t.st
	st.mu.Lock()
	switch o.kind {
	case outcomeDelivered:
		st.delivered = append(st.delivered, l.name)
		e.Stats.Delivered.Add(1)
		l.metrics.observeDelivered(st.ev.CommitTime)
	case outcomeHandOff:
		e.Stats.HandedOff.Add(1)
		observeHandedOff(l.name, o.metric())
		st.diverters = append(st.diverters, l)
		l.handedOff(st.ev)
		reason := "sink " + l.name + ": " + o.reason
		if st.handOff == nil {
			st.handOff = &HandOff{ID: st.ev.ID, AvailableAt: o.availableAt, LastError: reason, Attempts: o.counted}
		} else {
			if o.availableAt.Before(st.handOff.AvailableAt) {
				st.handOff.AvailableAt = o.availableAt
			}
			st.handOff.LastError += "; " + reason
			st.handOff.Attempts = max(st.handOff.Attempts, o.counted)
		}
	case outcomeHeld:
		e.Stats.Held.Add(1)
		l.metrics.held.Inc()
		st.held = true
		st.diverters = append(st.diverters, l)
		l.handedOff(st.ev)
	case outcomeDeadLetter:
		e.Stats.DeadLettered.Add(1)
		l.metrics.failed.Inc()
		if st.deadLetter != "" {
			st.deadLetter += "; "
		}
		st.deadLetter += "sink " + l.name + ": " + o.reason
	}
	st.mu.Unlock()
	if st.remaining.Add(-1) == 0 {
		e.queueSettle(st)
	}
}

func (e *Engine) resolveSkipped(st *eventState) { e.queueSettle(st) }

func (e *Engine) queueSettle(st *eventState) {
	e.settleMu.Lock()
	e.toSettle = append(e.toSettle, st)
	e.settleMu.Unlock()
	select {
	case e.settleWake <- struct{}{}:
	default:
	}
}

// settleBatch bounds one Store.Settle call.
const settleBatch = 2000

// settleLinger is how long the settle loop, woken by a first outcome, lets
// more gather before it writes. Without it a steady trickle (1,000 events/s
// arriving one by one) costs one PostgreSQL transaction per event, which
// at that rate took a quarter of a core from the server and showed up as
// tail latency for every event. Settling is off the delivery path: the
// linger delays only the ledger row and the acknowledgement.
const settleLinger = 5 * time.Millisecond

// settleLoop writes outcomes in batches: one transaction per batch, then
// the events count as settled. A failed write is retried; nothing settles
// (so nothing is acknowledged) until it succeeds.
func (e *Engine) settleLoop(ctx context.Context) {
	linger := time.NewTimer(0)
	<-linger.C
	for {
		select {
		case <-ctx.Done():
			return
		case <-e.settleWake:
		}
		e.settleMu.Lock()
		full := len(e.toSettle) >= settleBatch
		e.settleMu.Unlock()
		if !full {
			linger.Reset(settleLinger)
			select {
			case <-ctx.Done():
				return
			case <-linger.C:
			}
		}
		for {
			e.settleMu.Lock()
			n := min(len(e.toSettle), settleBatch)
			batch := make([]*eventState, n)
			copy(batch, e.toSettle)
			e.toSettle = e.toSettle[n:]
			if len(e.toSettle) == 0 {
				e.toSettle = nil
			}
			e.settleMu.Unlock()
			if n == 0 {
				break
			}
			if !e.settle(ctx, batch) {
				return
			}
		}
	}
}

func (e *Engine) settle(ctx context.Context, batch []*eventState) bool {
	var s Settlement
	var done []int64
	for _, st := range batch {
		st.mu.Lock()
		for _, sink := range st.delivered {
			s.Delivered = append(s.Delivered, LedgerKey{EventKey: st.ev.EventKey, Action: sink})
		}
		switch {
		case st.deadLetter != "":
			s.DeadLetters = append(s.DeadLetters, DeadLetter{ID: st.ev.ID, LastError: st.deadLetter})
		case st.held:
			// Hold wrote the row; it waits for a person.
		case st.handOff != nil:
			s.HandOffs = append(s.HandOffs, *st.handOff)
		case len(st.delivered) > 0 || st.allDelivered:
			done = append(done, st.ev.ID)
		}
		st.mu.Unlock()
	}
	var invisible []int64
	if len(s.Delivered)+len(s.HandOffs)+len(s.DeadLetters) > 0 {
		for attempt := 0; ; attempt++ {
			var err error
			invisible, err = e.cfg.Store.Settle(ctx, s)
			if err == nil {
				break
			}
			e.log.Error().Err(err).Int("events", len(batch)).Msg("write delivery outcomes; retrying (the slot is not acknowledged past them until this succeeds)")
			select {
			case <-ctx.Done():
				return false
			case <-time.After(retryDelay(attempt)):
			}
		}
	}
	if len(invisible) > 0 {
		batch = e.retryInvisible(batch, invisible)
	}
	for _, st := range batch {
		for _, l := range st.diverters {
			l.written(st.ev)
		}
		e.tracker.done(st.entry)
	}
	if e.cfg.MarkDone && len(done) > 0 {
		e.doneMu.Lock()
		e.toMark = append(e.toMark, done...)
		e.doneMu.Unlock()
		select {
		case e.markWake <- struct{}{}:
		default:
		}
	}
	return true
}

// invisibleRetryFor bounds how long the engine waits for a decoded row to
// become visible before it gives up on changing it.
const invisibleRetryFor = 30 * time.Second

// retryInvisible takes the events whose row change could not be applied
// because the row is not visible yet out of batch, and settles them again
// shortly; they stay unsettled (so unacknowledged) meanwhile. Their ledger
// rows are written already. It returns the rest of the batch.
func (e *Engine) retryInvisible(batch []*eventState, invisible []int64) []*eventState {
	ids := make(map[int64]bool, len(invisible))
	for _, id := range invisible {
		ids[id] = true
	}
	rest := batch[:0:0]
	for _, st := range batch {
		if !ids[st.ev.ID] {
			rest = append(rest, st)
			continue
		}
		st.mu.Lock()
		st.delivered = nil
		if st.invisibleSince.IsZero() {
			st.invisibleSince = time.Now()
		}
		waited := time.Since(st.invisibleSince)
		st.mu.Unlock()
		if waited > invisibleRetryFor {
			e.log.Error().Int64("id", st.ev.ID).Str("event_key", st.ev.EventKey).
				Msg("the row of a decoded event never became visible (deleted?); its hand-off or dead letter was not written")
			rest = append(rest, st)
			continue
		}
		time.AfterFunc(20*time.Millisecond, func() { e.queueSettle(st) })
	}
	return rest
}

// markDoneLoop marks delivered rows done in batches, at most every 200 ms.
// It is off the acknowledgement path: a row left pending is marked done at
// the next start from the ledger.
func (e *Engine) markDoneLoop(ctx context.Context) {
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-e.markWake:
			// Let a batch gather; the ticker bounds the delay.
			continue
		}
		e.flushMarkDone(ctx)
	}
}

func (e *Engine) flushMarkDone(ctx context.Context) {
	e.doneMu.Lock()
	ids := e.toMark
	e.toMark = nil
	e.doneMu.Unlock()
	flushed := ids
	var again []int64
	for len(ids) > 0 {
		n := min(len(ids), 5000)
		invisible, err := e.cfg.Store.MarkDone(ctx, ids[:n])
		if err != nil {
			e.log.Warn().Err(err).Int("rows", n).Msg("mark rows done; they stay pending until the next start marks them from the ledger")
		}
		again = append(again, invisible...)
		ids = ids[n:]
	}
	// Rows not visible yet are tried again at the next flush, for up to
	// about invisibleRetryFor.
	e.doneMu.Lock()
	defer e.doneMu.Unlock()
	if len(e.markTry) > 0 {
		retrying := make(map[int64]bool, len(again))
		for _, id := range again {
			retrying[id] = true
		}
		for _, id := range flushed {
			if !retrying[id] {
				delete(e.markTry, id)
			}
		}
	}
	for _, id := range again {
		if e.markTry[id]++; e.markTry[id] < int(invisibleRetryFor/(200*time.Millisecond)) {
			e.toMark = append(e.toMark, id)
		} else {
			delete(e.markTry, id)
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// retryDelay is the backoff for the engine's own database retries.
func retryDelay(attempt int) time.Duration {
	d := 100 * time.Millisecond << min(attempt, 6)
	return d + rand.N(d/4+1)
}

// backoff returns the claim path's delay after the given number of attempts,
// with 0–10% jitter.
func (e *Engine) backoff(attempts int) time.Duration {
	b := e.cfg.Backoff
	d := b[min(max(attempts-1, 0), len(b)-1)]
	return d + rand.N(d/10+1)
}

// firstLine keeps error text to one short line for last_error.
func firstLine(s string) string {
	if i := strings.IndexAny(s, "\r\n"); i >= 0 {
		s = s[:i]
	}
	if len(s) > 500 {
		s = s[:500]
	}
	return s
}
