package relay

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// loadDiverted marks, in every lane, the aggregates the table shows with a
// diverted or held event, so their new events follow them.
func (e *Engine) loadDiverted(ctx context.Context) error {
	diverted, err := e.cfg.Stream.Diverted(ctx)
	if err != nil {
		return fmt.Errorf("load diverted aggregates: %w", err)
	}
	e.divertAll(diverted)
	if len(diverted) > 0 {
		e.log.Info().Int("aggregates", len(diverted)).Msg("aggregates with diverted or held events: their new events go to the claim path until those settle")
	}
	return nil
}

// divertAll diverts aggs in every lane: their new stream events are
// diverted to the claim path.
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
	// diverted, which diverts its aggregate as any diversion does.
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
// queued. A streamed event it diverts diverts its aggregate in the lanes
// as any diversion does, until the claim path has delivered it, which the
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

// DivertSeq returns the current divert sequence number; see undiverted.
func (e *Engine) DivertSeq() uint64 { return e.divertSeq.Load() }

// undiverted lets the stream deliver an aggregate's events again once the
// claim path has settled its last diverted or held event. seq is DivertSeq
// read before the claim path looked at the table: a diversion decided after
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
