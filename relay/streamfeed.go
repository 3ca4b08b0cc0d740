package relay

import (
	"context"
	"sync/atomic"
	"time"
)

// streamFeed is the engine's Consumer: the replication source submits the
// events of each transaction in commit order, and the feed tracks which
// positions are settled, so the slot is acknowledged only past events whose
// outcome is written (docs/guarantees.md, "acknowledged only when settled").
type streamFeed struct {
	e       *Engine
	tracker *tracker
	// horizon: events committed before it may have been streamed (and
	// delivered) before the last restart.
	horizon atomic.Uint64
	// decoded is the highest position the stream has reported (a
	// transaction's end, a keepalive): the walsender has decoded the WAL
	// up to it. StreamView tells by it whether the stream has caught up.
	decoded atomic.Uint64
	// sentLag and sentAt are the last lag Sent reported and when
	// (UnixNano; 0: never).
	sentLag, sentAt atomic.Int64
	// started is when the last Restart began the stream's session
	// (UnixNano; 0: never): StreamView.
	started atomic.Int64
	// counting is the commit position of the transaction this session is
	// counting in decode_latency_seconds (firstDecoded): its later
	// batches are counted too.
	counting atomic.Uint64
}

// decodedHigh is the highest commit position whose events
// decode_latency_seconds has counted in this process. A transaction at or
// below it was counted when it was first decoded: the slot sends it again
// after a reconnect or a PostgreSQL restart, its commit time long past.
var decodedHigh atomic.Uint64

// firstDecoded reports whether the events of the transaction committed at
// lsn are decoded for the first time in this process: above decodedHigh,
// or later batches of the transaction this session is counting.
func (f *streamFeed) firstDecoded(lsn LSN) bool {
	if uint64(lsn) == f.counting.Load() {
		return true
	}
	for {
		high := decodedHigh.Load()
		if uint64(lsn) <= high {
			return false
		}
		if decodedHigh.CompareAndSwap(high, uint64(lsn)) {
			f.counting.Store(uint64(lsn))
			return true
		}
	}
}

// decodedPast reports whether the stream has reported a position at or past
// at.
func (f *streamFeed) decodedPast(at LSN) bool { return LSN(f.decoded.Load()) >= at }

// raiseDecoded records pos as decoded.
func (f *streamFeed) raiseDecoded(pos LSN) {
	for {
		old := f.decoded.Load()
		if uint64(pos) <= old || f.decoded.CompareAndSwap(old, uint64(pos)) {
			return
		}
	}
}

var _ Consumer = (*streamFeed)(nil)

func newStreamFeed(e *Engine) *streamFeed { return &streamFeed{e: e, tracker: newTracker()} }

// Submit implements Consumer. It takes the events in order: an event the
// slot sends again while it is still in flight joins it; the others are
// routed, prepared (checked against the ledger when they may be re-sent,
// claimed for sinks that hold unknown outcomes) and queued in their lanes.
// Each event is counted in its transaction before its first pair is
// queued, so a Submit cut short by ctx leaves nothing counted that will
// not settle.
func (f *streamFeed) Submit(ctx context.Context, events []*Event) error {
	e := f.e
	if len(events) == 0 {
		return nil
	}
	if err := e.waitStarted(ctx); err != nil {
		return err
	}
	restreamed := false
	if h := LSN(f.horizon.Load()); h != 0 && events[0].CommitLSN < h {
		restreamed = true
	}
	ticket := f.tracker.open()
	if restreamed {
		// Whatever settled these events before may have been written with
		// an asynchronous commit: passing them needs the synchronous
		// checkpoint even when every one is skipped or joined below
		// (TestEngine_RestreamedSkipsStillNeedACheckpoint).
		f.tracker.markEvents(ticket)
	}
	now := time.Now()
	if ct := events[0].CommitTime; !ct.IsZero() && f.firstDecoded(events[0].CommitLSN) {
		// One transaction's events share their commit time.
		lag := now.Sub(ct).Seconds()
		for range events {
			decodeLatency.Observe(lag)
		}
	}

	works := make([]*Work, 0, len(events))
	hold := false
	for _, ev := range events {
		if restreamed && e.joinInFlight(ev.ID, ticket) {
			continue
		}
		if ev.Status != "" && ev.Status != "pending" {
			// Inserted already settled (or held) by the application: not ours.
			e.Stats.Skipped.Add(1)
			continue
		}
		w := e.route(PathStream, ev)
		for _, p := range w.Pairs {
			hold = hold || p.Hold
		}
		works = append(works, w)
	}
	// A batch whose bytes pass the engine's budget is taken in parts, in
	// order: the first waits for room, the next for the first's.
	for part := range e.unsettled.groups(works) {
		if err := f.start(ctx, part, restreamed || hold, restreamed, ticket, now, "check decoded events against the ledger; retrying"); err != nil {
			return err
		}
	}
	return nil
}

// start takes room for works, a group cut by the engine's room (fit),
// prepares them when prepare is set (checked against the ledger when
// restreamed), and queues them in their lanes, counted in ticket's
// transaction (none: nil). A work Prepare skips is settled at once. Room
// it takes and gives back is the engine's, and the hand-over's for its
// rows, which the caller has taken.
func (f *streamFeed) start(ctx context.Context, works []*Work, prepare, restreamed bool, ticket *txnEntry, now time.Time, retrying string) error {
	e := f.e
	release := func(works ...*Work) {
		e.unsettled.give(works...)
		if works[0].handOver {
			e.handOverRoom.give(works...)
		}
	}
	if err := e.take(ctx, works); err != nil {
		if works[0].handOver {
			e.handOverRoom.give(works...)
		}
		return err
	}
	if prepare {
		prepareStream := func(ctx context.Context, works []*Work) error {
			return e.cfg.Stream.PrepareStream(ctx, works, restreamed, e.cfg.Owner)
		}
		err := retry(ctx, func() error { return e.prepareIsolating(ctx, works, prepareStream) },
			func(err error, wait time.Duration) {
				e.log.Warn().Err(err).Dur("retry_in", wait).Msg(retrying)
			})
		if err != nil {
			release(works...)
			return err
		}
	}
	// From here every work is taken: with ctx ended, a pair that finds its
	// lane full is diverted rather than dropped, so that a claim Prepare
	// made is settled.
	for _, w := range works {
		if w.Skip {
			// Settled, diverted or claimed before the restart, or since
			// a hand-over's snapshot was read.
			e.Stats.Skipped.Add(1)
			release(w)
			continue
		}
		e.admit(w, ticket)
		e.dispatch(ctx, w, now)
	}
	return ctx.Err()
}

// HandOver implements Consumer. The rows go through the same steps as a
// re-streamed transaction's events (Submit): checked against the ledger,
// counted in flight, queued in their lanes, settled by the stream's settle
// queue; they are counted in no transaction of the tracker, so the slot's
// position never waits for them (docs/architecture.md, "Slot creation").
func (f *streamFeed) HandOver(ctx context.Context, events []*Event) error {
	e := f.e
	if len(events) == 0 {
		return nil
	}
	if err := e.waitStarted(ctx); err != nil {
		return err
	}
	works := make([]*Work, 0, len(events))
	for _, ev := range events {
		w := e.route(PathStream, ev)
		w.handOver = true
		works = append(works, w)
	}
	// The hand-over's share of the engine's room is part of it: a group
	// that fits the share fits the engine's room whole.
	for part := range e.handOverRoom.groups(works) {
		if err := e.handOverRoom.take(ctx, part); err != nil {
			return err
		}
		if err := f.start(ctx, part, true, true, nil, time.Now(), "check the hand-over's rows against the ledger; retrying"); err != nil {
			return err
		}
	}
	return nil
}

// HandOverSettled implements Consumer. None of the rows settled for
// StallAfter ends it with an error naming some of them.
func (f *streamFeed) HandOverSettled(ctx context.Context) error {
	e := f.e
	return e.waitInFlight(ctx, settleWait{what: "hand-over rows", count: func() int { return e.handOvers },
		match: func(w *Work) bool { return w.handOver }, stall: e.cfg.StallAfter})
}

// Commit implements Consumer.
func (f *streamFeed) Commit(endLSN LSN) {
	f.raiseDecoded(endLSN)
	f.tracker.commit(endLSN)
}

// Keepalive implements Consumer.
func (f *streamFeed) Keepalive(walEnd LSN) {
	f.raiseDecoded(walEnd)
	f.tracker.keepalive(walEnd)
}

// Sent implements Consumer.
func (f *streamFeed) Sent(lag time.Duration) {
	f.sentLag.Store(int64(lag))
	f.sentAt.Store(time.Now().UnixNano())
}

// Settled implements Consumer.
func (f *streamFeed) Settled() (LSN, bool) { return f.tracker.position() }

// Divert implements Consumer.
func (f *streamFeed) Divert(aggs []AggregateKey) (release func([]AggregateKey)) {
	return f.e.divertPinned(aggs)
}

// Restart implements Consumer. It also reloads the diverted aggregates: a
// new slot's hand-over has just given the claim path every row pending
// before it, and the stream must not overtake those.
func (f *streamFeed) Restart(ctx context.Context, horizon LSN) error {
	if err := f.e.waitStarted(ctx); err != nil {
		return err
	}
	f.tracker.reset()
	f.horizon.Store(uint64(horizon))
	f.started.Store(time.Now().UnixNano())
	f.counting.Store(0) // a transaction sent again is not the one being counted
	// A pin left by a session whose hand-over did not finish ends here: a
	// new session either hands over again (and pins again, after this) or
	// resumes a slot whose hand-over is recorded, every row of it marked.
	f.e.pinned.Store(nil)
	return f.e.loadDivertedRetrying(ctx)
}
