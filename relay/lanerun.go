package relay

import (
	"fmt"
	"time"
)

// Runs (docs/sinks.md "Ordered batches"): at a sink whose receiver applies a
// request's events in order and, for each aggregate, applies none after the
// first it does not apply, the pair of an aggregate in flight goes out with
// the pairs waiting behind it, in one request and in commit order. One
// request per aggregate is in flight still: the run is the aggregate's
// pair in flight, as one pair is at any other sink. Its answer is read in
// order: the pairs before the first one not delivered are delivered; that
// one becomes the aggregate's pair in flight and gets its outcome as any
// sent pair does; the pairs after it were not applied, by the contract, and
// go back to the front of the aggregate's queue behind it, unsettled and
// without an attempt counted, to be sent after it.

// takeRun returns the run t heads when the sink takes runs and t is its
// aggregate's pair in flight: t and the pairs waiting behind it, as many as
// one request should carry (RunSink.FitRun, given the aggregates the lane
// holds), taken off the aggregate's queue, with their deliveries. It
// returns nil when t goes alone. A claim-path pair whose lease has passed
// ends the run: send settles it when its turn comes.
func (l *lane) takeRun(t *task) (run []*task, ds []*Delivery) {
	if l.runs == nil || !t.owns {
		return nil, nil
	}
	agg := t.w.Event.AggregateKey()
	l.mu.Lock()
	q := l.busy[agg]
	if q == nil || len(q.waiting) == 0 {
		l.mu.Unlock()
		return nil, nil
	}
	behind := append([]*task(nil), q.waiting[:min(len(q.waiting), l.runs.MaxRun()-1)]...)
	aggregates := len(l.busy)
	l.mu.Unlock()

	now := time.Now()
	run = append(make([]*task, 0, 1+len(behind)), t)
	for _, b := range behind {
		if b.w.path == PathClaim && l.e.leaseLeft(b.w, now) <= 0 {
			break
		}
		run = append(run, b)
	}
	ds = make([]*Delivery, len(run))
	for i, r := range run {
		ds[i] = &Delivery{Event: r.w.Event, Body: l.body(r.w), Attempt: r.w.Event.Attempts + r.tries + 1, Replay: r.w.Replay}
	}
	n := min(l.runs.FitRun(ds, aggregates), len(run))
	if n <= 1 {
		return nil, nil
	}
	run, ds = run[:n], ds[:n]
	// Only t's completion moves the queue's front, and t is in flight:
	// meanwhile tasks were only added at its end.
	l.mu.Lock()
	q.waiting = q.waiting[n-1:]
	l.mu.Unlock()
	for _, r := range run {
		r.tries++
	}
	return run, ds
}

// runResult decides what happens after a run's request, from its answer:
// one outcome per pair, in the run's order. It runs on the sink's callback
// and never blocks.
func (l *lane) runResult(run []*task, errs []error) {
	if len(errs) != len(run) {
		err := UnknownError(fmt.Errorf("sink %s answered a run of %d events with %d outcomes", l.name, len(run), len(errs)))
		errs = make([]error, len(run))
		for i := range errs {
			errs[i] = err
		}
	}
	first := len(run) // the first pair not delivered
	for i, err := range errs {
		if err != nil {
			first = i
			break
		}
	}
	// head is the aggregate's pair in flight from now on: the first not
	// delivered, or the last when all were.
	head := min(first, len(run)-1)
	notApplied := false
	if first < len(run) {
		class, _ := Classify(errs[first])
		notApplied = class == Transient || class == Permanent
	}

	var later, violations, back, follow []*task
	var held []int // indexes in run
	for i := first + 1; i < len(run); i++ {
		t, err := run[i], errs[i]
		class, _ := Classify(err)
		switch {
		case err == nil:
			// The receiver says it applied it: so it is recorded, whatever
			// came before it. Sending it again would not undo the order it
			// was applied in.
			later = append(later, t)
			if notApplied {
				violations = append(violations, t)
			}
		case len(held) > 0:
			follow = append(follow, t)
		case class == Unknown && t.p.Hold:
			// It may have been applied: held, never sent again; the
			// aggregate's later pairs follow it to the claim path.
			held = append(held, i)
		default:
			// Not applied: by the contract, whatever its answer says. An
			// unknown one is sent again with the same id and body, as at a
			// sink that retries unknown outcomes.
			if class == Unknown {
				t.p.Outcome.Unknown = true
			}
			back = append(back, t)
		}
	}

	agg := run[0].w.Event.AggregateKey()
	l.mu.Lock()
	run[0].owns = false
	run[head].owns = true
	q := l.busy[agg]
	switch {
	case q == nil: // never: the aggregate's pair in flight keeps its queue
		follow = append(back, follow...)
	case len(held) > 0:
		follow = append(follow, q.waiting...)
		q.waiting = back
	default:
		q.waiting = append(back, q.waiting...)
	}
	l.mu.Unlock()

	for i := range first {
		if i != head {
			l.delivered(run[i])
			l.complete(run[i], Outcome{Kind: Delivered}, true)
		}
	}
	for _, t := range later {
		l.delivered(t)
		l.complete(t, Outcome{Kind: Delivered}, true)
	}
	for _, t := range violations {
		receiverOrderViolations.WithLabelValues(l.name).Inc()
		l.e.log.Error().Str("sink", l.name).Str("path", string(t.w.path)).Int64("id", t.w.Event.ID).Str("event_key", t.w.Event.EventKey).
			Int64("not_applied_id", run[first].w.Event.ID).Str("not_applied_key", run[first].w.Event.EventKey).
			Msg("receiver broke the ordered-batch contract: it applied an event after an earlier event of its aggregate in the same request that it did not apply; recorded delivered, as answered (docs/sinks.md, \"Ordered batches\")")
	}
	for _, i := range held {
		t := run[i]
		l.noteFailure(t, failureStatus(errs[i], Unknown))
		l.complete(t, Outcome{Kind: Held, Reason: ShortError("outcome unknown: " + ShortError(errs[i].Error())), Unknown: true, Counted: t.counted + 1}, true)
	}
	for _, t := range follow {
		l.complete(t, Outcome{Kind: Deferred, Reason: "an earlier event of its aggregate is with the claim path", Until: time.Now(), Why: "ordering"}, true)
	}
	l.result(run[head], errs[head])
}
