package relay

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Settlement: the decisions of each path are written through its store in
// batches — one transaction per batch, after a short linger so that a
// trickle of events does not cost one transaction each — and only then do
// the events count as settled. Nothing is settled that was not written
// (docs/guarantees.md): a batch that fails is retried; a row PostgreSQL
// cannot see yet is written again until it can, or until it is found
// deleted (then it is settled without its outcome, logged and counted); a
// row whose data the store refuses is isolated so that the rows beside it
// settle.

const (
	// settleBatch bounds one Settle call.
	settleBatch = 2000
	// settleLinger is how long the loop, woken by a first decision, lets
	// more gather before it writes.
	settleLinger = 5 * time.Millisecond
	// streamSettleLinger is the stream path's: its settlement waits for
	// nothing but the acknowledgement of the slot, and each write is a
	// transaction the walsender decodes before the events committed after
	// it, so fewer, larger writes cost the server less while adding
	// nothing to delivery latency (docs/performance.md, "The stream's
	// settlement linger", has the figures). The claim path keeps
	// settleLinger: its next claim waits for the settlement.
	streamSettleLinger = 20 * time.Millisecond
	// writeTimeout bounds one write. A write cut off when the engine stops
	// (after its drain) is harmless: every write is conditional and safe
	// to repeat, and what it did not settle is taken again (re-streamed,
	// or returned by the sweeper).
	writeTimeout = 30 * time.Second
	// invisibleWarnAfter is how long a row may stay invisible before each
	// retry is logged as a warning.
	invisibleWarnAfter = 5 * time.Second
	// goneCheckAfter is how long a row must have been invisible before the
	// settle loop asks whether it was deleted.
	goneCheckAfter = time.Second
	// dataErrorsBeforeFallback: after this many refusals of one row's data
	// its decision is written as a dead letter with a plain reason; after
	// twice as many the row is left pending (the stuck-rows alarm reports
	// it) rather than holding every later event back.
	dataErrorsBeforeFallback = 3
)

// settleQueue writes one path's decisions.
type settleQueue struct {
	e      *Engine
	path   Path
	linger time.Duration // settleLinger, or streamSettleLinger

	mu    sync.Mutex
	items []*Work
	wake  chan struct{}

	// later holds works to write again at their time (rows not visible
	// yet); the loop alone touches it.
	later []laterWork
}

type laterWork struct {
	w   *Work
	due time.Time
}

func newSettleQueue(e *Engine, p Path) *settleQueue {
	linger := settleLinger
	if p == PathStream {
		linger = streamSettleLinger
	}
	return &settleQueue{e: e, path: p, linger: linger, wake: make(chan struct{}, 1)}
}

func (q *settleQueue) add(w *Work) {
	q.mu.Lock()
	q.items = append(q.items, w)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// run writes batches until ctx ends.
func (q *settleQueue) run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var due <-chan time.Time
		if len(q.later) > 0 {
			next := q.later[0].due
			for _, l := range q.later[1:] {
				if l.due.Before(next) {
					next = l.due
				}
			}
			timer.Reset(time.Until(next))
			due = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case <-q.wake:
			q.mu.Lock()
			full := len(q.items) >= settleBatch
			q.mu.Unlock()
			if !full && !Sleep(ctx, q.linger) {
				return
			}
		case <-due:
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		now := time.Now()
		var again []*Work
		rest := q.later[:0]
		for _, l := range q.later {
			if l.due.After(now) {
				rest = append(rest, l)
			} else {
				again = append(again, l.w)
			}
		}
		q.later = rest
		if len(again) > 0 {
			q.write(ctx, again)
		}
		for {
			q.mu.Lock()
			n := min(len(q.items), settleBatch)
			batch := q.items[:n:n]
			q.items = q.items[n:]
			if len(q.items) == 0 {
				q.items = nil
			}
			q.mu.Unlock()
			if n == 0 {
				break
			}
			q.write(ctx, batch)
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// write writes batch and settles what was written. It returns when every
// work is settled or put aside to be written again, or ctx ended.
func (q *settleQueue) write(ctx context.Context, batch []*Work) {
	e := q.e
	toWrite := batch[:0:0]
	for _, w := range batch {
		if w.Decision.Kind == Skip {
			e.settled(w)
			continue
		}
		toWrite = append(toWrite, w)
	}
	if len(toWrite) == 0 {
		return
	}
	invisible, ok := q.writeIsolating(ctx, toWrite)
	if !ok {
		return
	}
	hidden := make(map[int64]bool, len(invisible))
	for _, id := range invisible {
		hidden[id] = true
	}
	now := time.Now()
	gone := q.gone(ctx, toWrite, hidden, now)
	var final []*Work
	diverted := false
	for _, w := range toWrite {
		switch {
		case w.dataErrors > 2*dataErrorsBeforeFallback:
			// Given up on: settled unwritten, on purpose (see writeIsolating).
		case gone[w.Event.ID]:
			settleGone.WithLabelValues(string(q.path)).Inc()
			q.e.log.Warn().Str("path", string(q.path)).Int64("id", w.Event.ID).Str("event_key", w.Event.EventKey).Str("decision", decisionName(w.Decision.Kind)).
				Msg("the event's row was deleted before its outcome was written: it is settled without it")
		case hidden[w.Event.ID]:
			q.waitVisible(w, now)
			continue
		}
		e.settled(w)
		if w.Decision.Kind == Done || w.Decision.Kind == DeadLetter {
			final = append(final, w)
		}
		diverted = diverted || q.path == PathStream && w.Decision.Kind == Later
	}
	q.undivert(ctx, final)
	// The claim path is woken when its aggregates' next rows may be due
	// (a run settled) and when the stream has just written diversions for
	// it: a diverted aggregate's fresh events go out at once, not at the
	// next poll, and the claim path catches up with the aggregate sooner.
	if f := e.claimSettled.Load(); f != nil && (q.path == PathClaim && len(final) > 0 || diverted) {
		(*f)()
	}
}

// gone asks the store which of the hidden works' rows were deleted rather
// than not visible yet (StreamStore.Gone, one rule for every path: a row
// read from the table was visible, a streamed row's transaction is
// checked); it asks only about works that have waited a while (a commit's
// visibility normally lags by microseconds).
func (q *settleQueue) gone(ctx context.Context, works []*Work, hidden map[int64]bool, now time.Time) map[int64]bool {
	var ask []*Work
	for _, w := range works {
		if hidden[w.Event.ID] && !w.invisibleSince.IsZero() && now.Sub(w.invisibleSince) >= goneCheckAfter {
			ask = append(ask, w)
		}
	}
	if len(ask) == 0 {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, writeTimeout)
	defer cancel()
	ids, err := q.e.cfg.Stream.Gone(wctx, ask)
	if err != nil {
		if ctx.Err() == nil {
			q.e.log.Warn().Err(err).Msg("look for deleted rows; they are written again meanwhile")
		}
		return nil
	}
	out := make(map[int64]bool, len(ids))
	for _, id := range ids {
		out[id] = true
	}
	return out
}

// waitVisible puts w aside: the store could not see its row, which the
// walsender sent before the committing transaction became visible to other
// sessions (with synchronous replication, until a standby confirms it), or
// which was deleted. It is written again, with a growing delay, until it
// is visible or gone says it was deleted; the event stays unsettled and
// the slot unacknowledged past it meanwhile. A wait for settlement that
// sees nothing settle for StallAfter ends with an error (waitInFlight).
func (q *settleQueue) waitVisible(w *Work, now time.Time) {
	if w.invisibleSince.IsZero() {
		w.invisibleSince = now
	}
	waited := now.Sub(w.invisibleSince)
	if waited >= invisibleWarnAfter {
		q.e.log.Warn().Int64("id", w.Event.ID).Str("event_key", w.Event.EventKey).Dur("waited", waited.Round(time.Second)).
			Msg("the row of a decoded event is not visible yet (is its commit waiting for a synchronous standby?): its outcome is written once it is; the slot is not acknowledged past it meanwhile")
	}
	settleWaitingRows.WithLabelValues(string(q.path)).Inc()
	delay := min(20*time.Millisecond<<min(int(waited/time.Second), 6), time.Second)
	q.later = append(q.later, laterWork{w: w, due: now.Add(delay)})
}

// writeIsolating writes works, retrying failures until ctx ends. When the
// store refuses one row's data (ErrRowData), the batch is split in halves
// and each written on its own, down to the row at fault; that row gets a
// plain dead letter, and at last is left unwritten, so that it never holds
// the others back. ok is false when ctx ended first.
func (q *settleQueue) writeIsolating(ctx context.Context, works []*Work) (invisible []int64, ok bool) {
	e := q.e
	for attempt := 1; ; attempt++ {
		wctx, cancel := context.WithTimeout(ctx, writeTimeout)
		var err error
		if q.path == PathStream {
			invisible, err = e.cfg.Stream.SettleStream(wctx, works, e.cfg.Owner)
		} else {
			invisible, err = e.cfg.Claim.SettleClaim(wctx, works, e.cfg.Owner)
		}
		cancel()
		if err == nil {
			return invisible, true
		}
		if errors.Is(err, ErrRowData) {
			settleRowDataErrors.WithLabelValues(string(q.path)).Inc()
			if len(works) > 1 {
				half := len(works) / 2
				a, okA := q.writeIsolating(ctx, works[:half])
				if !okA {
					return nil, false
				}
				b, okB := q.writeIsolating(ctx, works[half:])
				return append(a, b...), okB
			}
			w := works[0]
			w.dataErrors++
			switch {
			case w.dataErrors == dataErrorsBeforeFallback:
				e.log.Error().Err(err).Int64("id", w.Event.ID).Str("event_key", w.Event.EventKey).
					Msg("the outcome of this row was refused by PostgreSQL; writing it as a dead letter with a plain reason")
				w.Decision = Decision{Kind: DeadLetter, Attempts: w.Decision.Attempts,
					Reason: "outcome not storable (" + ShortError(err.Error()) + "); it was: " + decisionName(w.Decision.Kind)}
				w.Decision.Reason = ShortError(w.Decision.Reason)
			case w.dataErrors > 2*dataErrorsBeforeFallback:
				e.log.Error().Err(err).Int64("id", w.Event.ID).Str("event_key", w.Event.EventKey).
					Msg("the outcome of this row cannot be written: it stays pending and the stuck-rows alarm reports it; the events after it go on")
				return nil, true
			}
			if ctx.Err() != nil {
				return nil, false
			}
			// The row's data is at fault, not the server: waiting would
			// change nothing and hold every decision queued behind it.
			// Write it again (or its fallback) at once.
			continue
		} else {
			settleErrors.WithLabelValues(string(q.path)).Inc()
		}
		if ctx.Err() != nil {
			return nil, false
		}
		wait := RetryDelay(attempt)
		e.log.Error().Err(err).Int("events", len(works)).Dur("retry_in", wait).Str("path", string(q.path)).
			Msg("write delivery outcomes; retrying (the events are not settled, nor the slot acknowledged past them, until this succeeds)")
		if !Sleep(ctx, wait) {
			return nil, false
		}
	}
}

func decisionName(k DecisionKind) string {
	switch k {
	case Done:
		return "done"
	case DeadLetter:
		return "dead letter"
	case Hold:
		return "held"
	case Later:
		return "retry later"
	case Skip:
		return "skip"
	}
	return "unknown"
}

// undivert asks the claim store which aggregates of works just settled for
// good have nothing left at the claim path, and lets the stream deliver
// their events again. It asks only about aggregates a lane diverts now:
// in poll mode, or for aggregates the stream never diverted, a
// settlement costs no round trip, and a diverted aggregate is checked at
// the settlement of each of its claimed runs, so the stream gets it back
// as soon as the claim path has caught up with it (docs/guarantees.md
// "Claim runs").
func (q *settleQueue) undivert(ctx context.Context, works []*Work) {
	e := q.e
	if e.cfg.Claim == nil || e.cfg.Unordered {
		return
	}
	seen := map[AggregateKey]bool{}
	var aggs []AggregateKey
	for _, w := range works {
		if !w.Event.Ordered() {
			continue
		}
		relevant := q.path == PathClaim
		for _, p := range w.Pairs {
			relevant = relevant || diverts(p.Outcome.Kind)
		}
		if a := w.Event.AggregateKey(); relevant && !seen[a] {
			seen[a] = true
			aggs = append(aggs, a)
		}
	}
	// The sequence is read before the lanes are: a divert after it keeps
	// its aggregate diverted whatever the store answers.
	seq := e.DivertSeq()
	if aggs = e.divertedAmong(aggs); len(aggs) == 0 {
		return
	}
	wctx, cancel := context.WithTimeout(ctx, writeTimeout)
	defer cancel()
	settled, err := e.cfg.Claim.SettledAggregates(wctx, aggs)
	if err != nil {
		if ctx.Err() == nil {
			e.log.Warn().Err(err).Msg("check settled aggregates; the stream keeps diverting them until the next settlement")
		}
		return
	}
	for _, a := range settled {
		e.undiverted(a, seq)
	}
}

// OnClaimSettled registers f, called after each claim-path settlement that
// finished events for good (their aggregates' next events may be due),
// and after each stream settlement that handed events to the claim path,
// in place of any f registered before. Safe to call while the engine runs:
// the supervisor starts a new claim source on a running engine.
func (e *Engine) OnClaimSettled(f func()) { e.claimSettled.Store(&f) }
