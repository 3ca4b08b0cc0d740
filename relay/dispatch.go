package relay

import (
	"context"
	"time"
)

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
// claim path can now see a diversion.
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

func orUnknown(owner string) string {
	if owner == "" {
		return "unknown owner"
	}
	return owner
}
