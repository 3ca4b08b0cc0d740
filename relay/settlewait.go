package relay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// WaitSettled waits until every stream work taken so far is settled, or
// ctx ends, or the engine stops (ErrEngineStopped), or none of them has
// settled for StallAfter: then it returns an error naming some of them.
// The replication source calls it before it creates a slot, so that the new
// slot's hand-over does not give the claim path rows the engine is still
// delivering (they would reach the sinks twice); the claim path's works
// are rows claimed or diverted, never in a new slot's snapshot.
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
