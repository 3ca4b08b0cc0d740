package relay

import (
	"context"
	"path"
	"sync"
	"time"
)

// lane is one sink's share of the engine. It holds at most LaneCapacity
// events; with ordering on, one event per aggregate is in flight and the
// rest of that aggregate waits behind it in commit order. Events of
// different aggregates go out concurrently, up to the sink's own window.
type lane struct {
	e       *Engine
	route   Route
	name    string
	sink    Sink
	metrics sinkMetrics

	slots chan struct{} // one token per event the lane holds: back-pressure
	ready chan *task    // to the dispatcher; never blocks (a task holds a slot)

	mu   sync.Mutex
	busy map[AggregateKey]*aggQueue // aggregates with an event in flight
	// diverted holds aggregates with an event at the claim path (handed off
	// or held), with the engine's divert sequence number of the latest
	// hand-off; unwritten counts hand-offs not yet written to the table.
	// Undiverted uses both so that the claim path, which learns from the
	// table, never clears a mark the table does not show yet.
	diverted  map[AggregateKey]uint64
	unwritten map[AggregateKey]int

	// The circuit: open while the sink is down (credentials, not published,
	// unreachable); events then go to the claim path at once.
	openUntil time.Time
	downCount int
}

type aggQueue struct{ waiting []*task }

// task is one event on its way to one sink.
type task struct {
	st      *eventState
	tries   int  // sends made; the attempt header counts them
	counted int  // failed attempts that count against max_attempts
	claimed bool // the ledger holds our 'sending' claim (Hold routes)
}

func newLane(e *Engine, r Route) *lane {
	return &lane{
		e:         e,
		route:     r,
		name:      r.Sink.Name(),
		sink:      r.Sink,
		metrics:   newSinkMetrics(r.Sink.Name()),
		slots:     make(chan struct{}, e.cfg.LaneCapacity),
		ready:     make(chan *task, e.cfg.LaneCapacity),
		busy:      map[AggregateKey]*aggQueue{},
		diverted:  map[AggregateKey]uint64{},
		unwritten: map[AggregateKey]int{},
	}
}

// routes reports whether the sink takes this event type.
func (l *lane) routes(ev *Event) bool {
	if len(l.route.Events) == 0 {
		return true
	}
	for _, g := range l.route.Events {
		if g == "*" {
			return true
		}
		if ev.EventType != nil {
			if ok, _ := path.Match(g, *ev.EventType); ok {
				return true
			}
		}
	}
	return false
}

func (l *lane) ordered(ev *Event) bool { return !l.e.cfg.Unordered && ev.Ordered() }

// enqueue takes an event into the lane. It blocks while the lane is full —
// back-pressure on decoding — but never longer than LaneBlockMax: then the
// event is handed off and the stream moves on.
func (l *lane) enqueue(ctx context.Context, t *task) error {
	select {
	case l.slots <- struct{}{}:
	default:
		timer := time.NewTimer(l.e.cfg.LaneBlockMax)
		select {
		case l.slots <- struct{}{}:
			timer.Stop()
		case <-timer.C:
			l.divert(t.st.ev)
			l.e.finish(l, t, outcome{kind: outcomeHandOff, reason: "lane blocked longer than lane_block_max", availableAt: time.Now(), why: "lane_blocked"})
			return nil
		case <-ctx.Done():
			timer.Stop()
			return ctx.Err()
		}
	}

	ev := t.st.ev
	l.mu.Lock()
	if until := l.openUntil; time.Now().Before(until) {
		l.mu.Unlock()
		<-l.slots
		l.divert(ev)
		l.e.finish(l, t, outcome{kind: outcomeHandOff, reason: "circuit open: sink is down", availableAt: until, why: "sink_down"})
		return nil
	}
	if l.ordered(ev) {
		agg := ev.AggregateKey()
		if _, ok := l.diverted[agg]; ok {
			l.mu.Unlock()
			<-l.slots
			l.e.finish(l, t, outcome{kind: outcomeHandOff, reason: "an earlier event of its aggregate is with the claim path", availableAt: time.Now(), why: "ordering"})
			return nil
		}
		if q, ok := l.busy[agg]; ok {
			q.waiting = append(q.waiting, t)
			l.mu.Unlock()
			return nil
		}
		l.busy[agg] = &aggQueue{}
	}
	l.mu.Unlock()
	l.ready <- t
	return nil
}

func (l *lane) divert(ev *Event) {
	if !l.ordered(ev) {
		return
	}
	l.mu.Lock()
	l.diverted[ev.AggregateKey()] = l.e.divertSeq.Add(1)
	l.mu.Unlock()
}

// handedOff counts a hand-off of ev by this lane until written is called.
func (l *lane) handedOff(ev *Event) {
	if !l.ordered(ev) {
		return
	}
	l.mu.Lock()
	l.unwritten[ev.AggregateKey()]++
	l.mu.Unlock()
}

// written is called once the hand-off of ev is in the table: from now on the
// claim path can see it.
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

// dispatch sends ready events; Send blocks while the sink's window is full.
func (l *lane) dispatch(ctx context.Context) {
	for {
		var t *task
		select {
		case <-ctx.Done():
			return
		case t = <-l.ready:
		}
		l.mu.Lock()
		until := l.openUntil
		l.mu.Unlock()
		if time.Now().Before(until) {
			l.complete(t, outcome{kind: outcomeHandOff, reason: "circuit open: sink is down", availableAt: until, counted: t.counted, why: "sink_down"})
			continue
		}
		if l.route.Hold && !t.claimed {
			ok, err := l.e.cfg.Holds.ClaimSending(ctx, l.key(t), l.e.cfg.Owner)
			if err != nil {
				l.complete(t, outcome{kind: outcomeHandOff, reason: "claim before sending: " + firstLine(err.Error()),
					availableAt: time.Now().Add(l.e.backoff(1)), counted: t.counted})
				continue
			}
			if !ok {
				go l.unclaimable(ctx, t)
				continue
			}
			t.claimed = true
		}
		t.tries++
		st := t.st
		d := &Delivery{Event: st.ev, Body: st.body(l.route.Nudge), Attempt: st.ev.Attempts + t.tries}
		l.sink.Send(ctx, d, func(err error) { l.result(t, err) })
	}
}

// result decides what happens after one send.
func (l *lane) result(t *task, err error) {
	if err == nil {
		l.closeCircuit()
		l.complete(t, outcome{kind: outcomeDelivered})
		return
	}
	class, retryAfter := Classify(err)
	reason := firstLine(err.Error())
	ev := t.st.ev
	switch class {
	case Permanent:
		l.complete(t, outcome{kind: outcomeDeadLetter, reason: reason})
		return
	case SinkDown:
		until := l.openCircuit(reason, retryAfter)
		l.complete(t, outcome{kind: outcomeHandOff, reason: reason, availableAt: until, counted: t.counted, why: "sink_down"})
		return
	}

	if class == Unknown && l.route.Hold {
		// The sink may have acted on it: park it for a person, never resend.
		go l.hold(t, "outcome unknown: "+reason)
		return
	}

	// Transient or unknown: an attempt that counts.
	t.counted++
	l.e.Stats.Retried.Add(1)
	l.metrics.retried.Inc()
	total := ev.Attempts + t.counted
	if total >= l.e.cfg.MaxAttempts {
		l.complete(t, outcome{kind: outcomeDeadLetter, reason: "max_attempts reached: " + reason, counted: t.counted})
		return
	}
	delay := 100 * time.Millisecond << min(t.counted-1, 5)
	delay = max(delay, retryAfter)
	select {
	case <-l.e.stopping:
		l.complete(t, outcome{kind: outcomeHandOff, reason: reason, availableAt: time.Now().Add(max(l.e.backoff(total), retryAfter)), counted: t.counted})
		return
	default:
	}
	if t.counted < l.e.cfg.InlineAttempts && delay <= l.e.cfg.LaneBlockMax {
		time.AfterFunc(delay, func() {
			select {
			case <-l.e.stopping:
				l.complete(t, outcome{kind: outcomeHandOff, reason: reason, availableAt: time.Now().Add(l.e.backoff(total)), counted: t.counted})
			default:
				l.ready <- t
			}
		})
		return
	}
	l.complete(t, outcome{kind: outcomeHandOff, reason: reason, availableAt: time.Now().Add(max(l.e.backoff(total), retryAfter)), counted: t.counted})
}

func (l *lane) key(t *task) LedgerKey {
	return LedgerKey{EventKey: t.st.ev.EventKey, Action: l.name}
}

// hold parks the event: the ledger pair becomes unknown and the row held.
// It runs on its own goroutine: sinks call done where blocking is not allowed.
func (l *lane) hold(t *task, reason string) {
	for attempt := 0; ; attempt++ {
		err := l.e.cfg.Holds.Hold(l.e.runCtx, t.st.ev.ID, l.key(t), reason)
		if err == nil {
			break
		}
		if l.e.runCtx.Err() != nil {
			return // stopping: the row stays the stream's and is re-streamed
		}
		l.e.log.Warn().Err(err).Int64("id", t.st.ev.ID).Msg("hold an event whose outcome is unknown; retrying")
		time.Sleep(retryDelay(attempt))
	}
	l.e.log.Warn().Str("sink", l.name).Int64("id", t.st.ev.ID).Str("event_key", t.st.ev.EventKey).Str("reason", reason).
		Msg("event held: its outcome is unknown and the sink holds such events; see outbox-relay dlq list")
	l.complete(t, outcome{kind: outcomeHeld, reason: reason})
}

// unclaimable handles an event whose ledger claim was refused: delivered
// already (a re-stream), or claimed before a crash, whose outcome is
// therefore unknown.
func (l *lane) unclaimable(ctx context.Context, t *task) {
	for attempt := 0; ; attempt++ {
		known, err := l.e.cfg.Store.Restreamed(ctx, []*Event{t.st.ev})
		if err == nil {
			if contains(known[t.st.ev.ID].Delivered, l.name) {
				l.complete(t, outcome{kind: outcomeDelivered})
				return
			}
			break
		}
		if ctx.Err() != nil {
			return
		}
		time.Sleep(retryDelay(attempt))
	}
	l.hold(t, "outcome unknown: claimed for sending before a restart or by another relay")
}

// complete records the sink's outcome, frees the slot and lets the next
// event of the aggregate go. A hand-off or hold diverts the aggregate: the
// events waiting behind it follow it to the claim path, so none overtakes it.
// A claim whose send is known not to have happened is released first.
func (l *lane) complete(t *task, o outcome) {
	if t.claimed && o.kind != outcomeDelivered && o.kind != outcomeHeld {
		t.claimed = false
		go func() {
			if err := l.e.cfg.Holds.Release(l.e.runCtx, l.key(t), l.e.cfg.Owner); err != nil {
				l.e.log.Warn().Err(err).Int64("id", t.st.ev.ID).Msg("release the ledger claim of an event handed off; the claim path takes it over after lock_timeout")
			}
			l.complete(t, o)
		}()
		return
	}
	<-l.slots
	ev := t.st.ev
	var next *task
	var follow []*task
	if l.ordered(ev) {
		agg := ev.AggregateKey()
		l.mu.Lock()
		q := l.busy[agg]
		switch {
		case o.kind == outcomeHandOff || o.kind == outcomeHeld:
			l.diverted[agg] = l.e.divertSeq.Add(1)
			if q != nil {
				follow = q.waiting
			}
			delete(l.busy, agg)
		case q != nil && len(q.waiting) > 0:
			next = q.waiting[0]
			q.waiting = q.waiting[1:]
		default:
			delete(l.busy, agg)
		}
		l.mu.Unlock()
	}
	l.e.finish(l, t, o)
	for _, w := range follow {
		<-l.slots
		l.e.finish(l, w, outcome{kind: outcomeHandOff, reason: "an earlier event of its aggregate is with the claim path", availableAt: time.Now(), why: "ordering"})
	}
	if next != nil {
		l.ready <- next
	}
}

// openCircuit opens (or keeps open, longer) the sink's circuit and returns
// when it closes: Retry-After when the sink said, else 1 s doubling to 30 s.
func (l *lane) openCircuit(reason string, retryAfter time.Duration) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.downCount++
	cool := retryAfter
	if cool <= 0 {
		cool = min(time.Second<<min(l.downCount-1, 5), 30*time.Second)
	}
	now := time.Now()
	until := now.Add(cool)
	if !now.Before(l.openUntil) {
		l.e.log.Warn().Str("sink", l.name).Str("error", reason).Dur("retry_in", cool).
			Msg("sink is down: circuit open, its events go to the claim path")
	}
	if until.After(l.openUntil) {
		l.openUntil = until
	}
	return l.openUntil
}

func (l *lane) closeCircuit() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.downCount > 0 {
		l.e.log.Info().Str("sink", l.name).Msg("sink is back: circuit closed")
		l.downCount = 0
	}
}
