package relay

import (
	"container/heap"
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// lane is one sink's share of the engine. It holds at most LaneCapacity
// pairs; with ordering on, one pair per aggregate is in flight and the rest
// of that aggregate waits behind it in arrival order, whichever path it came
// from — or, at a sink whose receiver keeps the ordered-batch contract
// (runs), one request per aggregate, carrying the pair in flight and the
// pairs waiting behind it as a run (lanerun.go). Pairs of different
// aggregates go out concurrently, up to the sink's own window. One
// goroutine, dispatch, sends; the sink's callbacks decide each outcome
// (result) and complete it.
type lane struct {
	e       *Engine
	idx     int // its index in Engine.lanes
	route   Route
	name    string
	sink    Sink
	metrics map[Path]sinkMetrics
	// runs is the sink as a RunSink when its receiver keeps the
	// ordered-batch contract (MaxRun above 1), else nil.
	runs RunSink

	slots   chan struct{} // one token per pair the lane holds: back-pressure
	ready   chan *task    // to the dispatcher; never blocks (a task holds a slot)
	retryIn chan *task    // inline retries, to the dispatcher's timer heap

	mu   sync.Mutex
	busy map[AggregateKey]*aggQueue // aggregates with a pair in flight
	// diverted holds the aggregates with an event at the claim path (diverted
	// or held) with the divert sequence number of the latest decision;
	// unwritten counts such decisions not yet written to the table.
	// undiverted uses both so that the claim path, which learns from the
	// table, never clears a mark the table does not show yet.
	diverted  map[AggregateKey]uint64
	unwritten map[AggregateKey]int
	circuit   circuit
	// paused is set while an operator has paused the sink: its pairs are
	// deferred as an open circuit defers them (pause.go).
	paused atomic.Bool
	// failures holds what the log said of each event that failed here and
	// is not delivered or settled for good (failNote): a repeat of the same
	// failure, in this pass or a later claim, is not logged again.
	failures map[int64]failNote
}

type aggQueue struct{ waiting []*task }

// claimRun links the rows of one aggregate that one claim took together as
// a run (docs/guarantees.md "Claim runs"). stopped[i] is set, under the mu
// of lane i, once a row of the run has an outcome there that leaves it with
// the claim path: from then on the run's later rows do not go out in that
// lane, whether they wait behind it in the aggregate's queue or were still
// waiting for room in the lane when the queue emptied.
type claimRun struct{ stopped []bool }

// task is one pair on its way through the lane.
type task struct {
	w *Work
	p *Pair
	l *lane
	// owns: t is its aggregate's pair in flight in this lane (busy[agg]
	// is its queue); only its completion moves the queue on.
	owns    bool
	tries   int    // sends made in this pass; the attempt header counts them
	counted int    // failed attempts of this pass that count
	last    string // the last failure
	due     time.Time
	since   time.Time // when it entered the lane: its wait for the rate limit counts from then
	index   int       // in the retry heap
}

func newLane(e *Engine, r Route) *lane {
	name := r.Sink.Name()
	l := &lane{
		e:         e,
		route:     r,
		name:      name,
		sink:      r.Sink,
		metrics:   map[Path]sinkMetrics{PathStream: newSinkMetrics(name, PathStream), PathClaim: newSinkMetrics(name, PathClaim)},
		slots:     make(chan struct{}, e.cfg.LaneCapacity),
		ready:     make(chan *task, e.cfg.LaneCapacity),
		retryIn:   make(chan *task, e.cfg.LaneCapacity),
		busy:      map[AggregateKey]*aggQueue{},
		diverted:  map[AggregateKey]uint64{},
		unwritten: map[AggregateKey]int{},
		failures:  map[int64]failNote{},
	}
	if rs, ok := r.Sink.(RunSink); ok && rs.MaxRun() > 1 {
		l.runs = rs
	}
	return l
}

func (l *lane) ordered(ev *Event) bool { return !l.e.cfg.Unordered && ev.Ordered() }

// enqueue takes a pair into the lane. It blocks while the lane is full:
// back-pressure on the source. A stream pair waits at most LaneBlockMax,
// then goes to the claim path and the stream moves on; a claim-path pair
// waits until ctx ends. A pair that could not be queued because ctx ended
// is deferred.
func (l *lane) enqueue(ctx context.Context, t *task) {
	if !l.acquire(ctx, t) {
		return
	}
	ev := t.w.Event
	now := time.Now()
	t.since = now
	l.mu.Lock()
	if o, closed := l.closed(ev.ID); closed {
		l.mu.Unlock()
		l.complete(t, o, true)
		return
	}
	if l.ordered(ev) {
		agg := ev.AggregateKey()
		_, diverted := l.diverted[agg]
		switch {
		case t.w.path == PathStream && (diverted || !t.w.handOver && l.e.pinnedNow(agg)):
			// A hand-over's row passes its own pin, not a diversion: an
			// earlier row of its aggregate is with the claim path (diverted
			// before, or by this hand-over), or a streamed event was
			// diverted while the pin held, and the claim path delivers
			// them all in id order.
			l.mu.Unlock()
			l.complete(t, Outcome{Kind: Deferred, Reason: "an earlier event of its aggregate is with the claim path", Until: now, Why: "ordering"}, true)
			return
		case t.w.run != nil && t.w.run.stopped[l.idx]:
			l.mu.Unlock()
			l.complete(t, Outcome{Kind: Deferred, Reason: "an earlier event of its aggregate in the same claim was not delivered", Until: now, Why: "ordering"}, true)
			return
		case t.w.path == PathClaim && l.unwritten[agg] > 0:
			// The stream decided to hand an earlier event of this aggregate
			// off and has not written it yet: the table does not show it,
			// so the claim query could not wait for it. Try again shortly.
			l.mu.Unlock()
			l.complete(t, Outcome{Kind: Deferred, Reason: "an earlier event of its aggregate is being diverted", Until: now.Add(100 * time.Millisecond), Why: "ordering"}, true)
			return
		}
		if q, ok := l.busy[agg]; ok {
			q.waiting = append(q.waiting, t)
			l.mu.Unlock()
			return
		}
		l.busy[agg] = &aggQueue{}
		t.owns = true
	}
	l.mu.Unlock()
	l.ready <- t
}

// acquire takes a slot for t, waiting as enqueue says; when it gives up it
// completes t itself and reports false.
func (l *lane) acquire(ctx context.Context, t *task) bool {
	select {
	case l.slots <- struct{}{}:
		return true
	default:
	}
	var timeout <-chan time.Time
	if t.w.path == PathStream && !t.w.handOver {
		timer := time.NewTimer(l.e.cfg.Policy.LaneBlockMax)
		defer timer.Stop()
		timeout = timer.C
	}
	select {
	case l.slots <- struct{}{}:
		return true
	case <-timeout:
		l.complete(t, Outcome{Kind: Deferred, Reason: "lane blocked longer than lane_block_max", Until: time.Now(), Why: "lane_blocked"}, false)
	case <-ctx.Done():
		l.complete(t, Outcome{Kind: Deferred, Reason: "not sent: its source stopped", Until: time.Now(), Why: "stopping"}, false)
	}
	return false
}

// dispatch sends ready pairs and due retries until ctx ends; sends run with
// sendCtx, which Engine.Halt cancels. Send blocks while the sink's window
// is full.
func (l *lane) dispatch(ctx, sendCtx context.Context) {
	var retries retryHeap
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var due <-chan time.Time
		if len(retries) > 0 {
			timer.Reset(time.Until(retries[0].due))
			due = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case t := <-l.ready:
			l.send(sendCtx, t)
		case t := <-l.retryIn:
			heap.Push(&retries, t)
		case <-due:
			now := time.Now()
			for len(retries) > 0 && !retries[0].due.After(now) {
				t := heap.Pop(&retries).(*task)
				if l.e.draining.Load() {
					l.complete(t, l.retryOutcome(t, 0), true)
					continue
				}
				l.send(sendCtx, t)
			}
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// send gives t to the sink, unless the sink is paused, its circuit is open
// or the engine is halted.
func (l *lane) send(ctx context.Context, t *task) {
	if l.e.halted.Load() {
		l.complete(t, haltedOutcome(t), true)
		return
	}
	if t.w.path == PathClaim && l.e.leaseLeft(t.w, time.Now()) <= 0 {
		o := Outcome{Kind: Deferred, Reason: "not sent: the claim's lease passed without a renewal", Until: time.Now(), Why: "stopping"}
		if t.counted > 0 {
			o = Outcome{Kind: Retry, Reason: t.last + "; then the claim's lease passed", Counted: t.counted, Unknown: t.p.Outcome.Unknown}
		}
		l.complete(t, o, true)
		return
	}
	l.mu.Lock()
	o, closed := l.closed(t.w.Event.ID)
	l.mu.Unlock()
	if closed {
		if t.counted > 0 {
			o = Outcome{Kind: Retry, Reason: t.last + "; then " + o.Reason, Until: o.Until, Counted: t.counted}
		}
		l.complete(t, o, true)
		return
	}
	if !l.admit(ctx, t) {
		return
	}
	if run, ds := l.takeRun(t); run != nil {
		l.admitMore(ctx, len(ds)-1)
		l.runs.SendRun(ctx, ds, func(errs []error) { l.runResult(run, errs) })
		return
	}
	t.tries++
	w := t.w
	d := &Delivery{Event: w.Event, Body: l.body(w), Attempt: w.Event.Attempts + t.tries, Replay: w.Replay}
	l.sink.Send(ctx, d, func(err error) { l.result(t, err) })
}

// body is the event's envelope or nudge, built once per event: every
// attempt and every sink send the same bytes.
func (l *lane) body(w *Work) []byte {
	if l.route.Nudge {
		w.nudgeOnce.Do(func() { w.nudge = w.Event.AppendNudge(nil) })
		return w.nudge
	}
	w.envelopeOnce.Do(func() { w.envelope = w.Event.AppendEnvelope(nil) })
	return w.envelope
}

// result decides what happens after one send. It runs on the sink's
// callback and never blocks.
func (l *lane) result(t *task, err error) {
	if err == nil {
		l.delivered(t)
		l.complete(t, Outcome{Kind: Delivered}, true)
		return
	}
	class, retryAfter := Classify(err)
	if l.e.halted.Load() && class != Unknown && class != Permanent {
		// Cut short by Halt before it was written: not an attempt.
		l.complete(t, haltedOutcome(t), true)
		return
	}
	reason := ShortError(err.Error())
	if class != SinkDown {
		l.noteFailure(t, failureStatus(err, class))
	}
	switch class {
	case Permanent:
		l.complete(t, Outcome{Kind: Failed, Reason: reason, Counted: t.counted + 1}, true)
		return
	case SinkDown:
		until := l.sinkDown(t, retryAfter, reason)
		o := Outcome{Kind: Deferred, Reason: reason, Until: until, Why: "sink_down"}
		if t.counted > 0 {
			o = Outcome{Kind: Retry, Reason: t.last + "; then " + reason, Until: until, Counted: t.counted}
		}
		l.complete(t, o, true)
		return
	}
	if class == Unknown && t.p.Hold {
		// The sink may have acted on it: park it for a person, never resend.
		l.complete(t, Outcome{Kind: Held, Reason: ShortError("outcome unknown: " + reason), Unknown: true, Counted: t.counted + 1}, true)
		return
	}
	// Transient, or unknown at a sink that retries: an attempt that counts.
	t.counted++
	t.last = reason
	l.e.Stats.Retried.Add(1)
	l.metrics[t.w.path].retried.Inc()
	unknown := class == Unknown
	t.p.Outcome.Unknown = t.p.Outcome.Unknown || unknown
	delay := max(inlineDelay(t.counted), retryAfter)
	if t.w.path == PathStream && t.counted < l.e.cfg.Policy.InlineAttempts && delay <= l.e.cfg.Policy.LaneBlockMax &&
		t.w.Event.Attempts+t.counted < l.e.cfg.Policy.MaxAttempts && !l.e.draining.Load() {
		t.due = time.Now().Add(delay)
		l.logFailure(t.w, nextInlineRetry, t.due, reason)
		l.retryIn <- t
		return
	}
	l.complete(t, l.retryOutcome(t, retryAfter), true)
}

// haltedOutcome is the outcome of a pair not sent because the engine was
// halted: diverted to the claim path, keeping the attempts this pass counted.
func haltedOutcome(t *task) Outcome {
	if t.counted > 0 {
		return Outcome{Kind: Retry, Reason: t.last + "; then delivery stopped (lease lost)", Counted: t.counted, Unknown: t.p.Outcome.Unknown}
	}
	return Outcome{Kind: Deferred, Reason: "not sent: delivery stopped (lease lost)", Until: time.Now(), Why: "stopping"}
}

// retryOutcome is the final outcome of a pair whose counted attempts
// failed: try again after the backoff (or dead-letter it at max_attempts;
// the policy decides).
func (l *lane) retryOutcome(t *task, retryAfter time.Duration) Outcome {
	o := Outcome{Kind: Retry, Reason: t.last, Counted: t.counted, Unknown: t.p.Outcome.Unknown}
	if retryAfter > 0 {
		o.Until = time.Now().Add(retryAfter)
	}
	return o
}

// complete records the pair's outcome. held says whether t holds a slot of
// the lane: then the slot is freed. When t is its aggregate's pair in
// flight, the next pair of the aggregate goes out, unless the outcome
// leaves the event with the claim path: then the pairs waiting behind it
// follow it, so none overtakes it. A diversion decision diverts the
// aggregate at once.
func (l *lane) complete(t *task, o Outcome, held bool) {
	ev := t.w.Event
	var next *task
	var follow []*task
	if l.ordered(ev) {
		agg := ev.AggregateKey()
		l.mu.Lock()
		if diverts(o.Kind) {
			l.diverted[agg] = l.e.divertSeq.Add(1)
			l.unwritten[agg]++
			if t.w.run != nil {
				t.w.run.stopped[l.idx] = true
			}
		}
		if t.owns {
			t.owns = false
			q := l.busy[agg]
			switch {
			case q == nil:
			case diverts(o.Kind):
				follow = q.waiting
				delete(l.busy, agg)
			case len(q.waiting) > 0:
				next = q.waiting[0]
				q.waiting = q.waiting[1:]
			default:
				delete(l.busy, agg)
			}
		}
		l.mu.Unlock()
	}
	if held {
		<-l.slots
	}
	l.record(t, o)
	for _, f := range follow {
		l.complete(f, Outcome{Kind: Deferred, Reason: "an earlier event of its aggregate is with the claim path", Until: time.Now(), Why: "ordering"}, true)
	}
	if next != nil {
		next.owns = true
		l.ready <- next
	}
}

// record stores the pair's outcome and counts it; the last pair of the
// event has it decided and queued for settlement.
func (l *lane) record(t *task, o Outcome) {
	w, p := t.w, t.p
	m := l.metrics[w.path]
	unknown := p.Outcome.Unknown || o.Unknown
	p.Outcome = o
	p.Outcome.Unknown = unknown && o.Kind != Delivered
	switch o.Kind {
	case Delivered:
		if p.State != PairDelivered {
			l.e.Stats.Delivered.Add(1)
			since := w.Event.CommitTime
			if w.path == PathClaim || since.IsZero() {
				since = w.Event.CreatedAt // a hand-over's row: read, not decoded
			}
			m.observeDelivered(since)
		}
	case Failed:
		l.e.Stats.DeadLettered.Add(1)
		m.failed.Inc()
	case Held:
		l.e.Stats.Held.Add(1)
		m.held.Inc()
	case Retry, Deferred:
		if w.path == PathStream {
			l.e.Stats.Diverted.Add(1)
			why := o.Why
			if o.Kind == Retry {
				why = "retries"
			}
			observeDiverted(l.name, why)
		}
	}
	l.e.cfg.Feed.observe(t, o)
	if w.remaining.Add(-1) == 0 {
		l.e.finishWork(w)
	}
}

// written is called once the diversion of ev is in the table: from now on
// the claim path can see it.
func (l *lane) written(ev *Event) {
	if !l.ordered(ev) {
		return
	}
	agg := ev.AggregateKey()
	l.mu.Lock()
	if l.unwritten[agg]--; l.unwritten[agg] <= 0 {
		delete(l.unwritten, agg)
	}
	l.diverted[agg] = l.e.divertSeq.Add(1)
	l.mu.Unlock()
}

// retryHeap orders inline retries by due time.
type retryHeap []*task

func (h retryHeap) Len() int           { return len(h) }
func (h retryHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h retryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].index = i; h[j].index = j }
func (h *retryHeap) Push(x any)        { t := x.(*task); t.index = len(*h); *h = append(*h, t) }
func (h *retryHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return t
}
