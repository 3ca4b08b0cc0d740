package relay

import "sync/atomic"

// Decided counts the events an engine has settled since it was built, by
// the decision written for each.
type Decided struct {
	// Delivered: delivered to every sink they are routed to.
	Delivered int64
	// Later: left for the claim path — diverted by the stream, or back
	// to pending with a backoff on the claim path.
	Later int64
	// DeadLettered and Held: status failed and held.
	DeadLettered, Held int64
	// Skipped: no longer the path's (nothing written).
	Skipped int64
}

// Minus returns d less an earlier count.
func (d Decided) Minus(before Decided) Decided {
	return Decided{
		Delivered:    d.Delivered - before.Delivered,
		Later:        d.Later - before.Later,
		DeadLettered: d.DeadLettered - before.DeadLettered,
		Held:         d.Held - before.Held,
		Skipped:      d.Skipped - before.Skipped,
	}
}

// decidedCounts holds an engine's counts, one per DecisionKind.
type decidedCounts [Skip + 1]atomic.Int64

func (c *decidedCounts) add(k DecisionKind) {
	if k > 0 && int(k) < len(c) {
		c[k].Add(1)
	}
}

// Decided returns how many events the engine has settled, by decision. The
// supervisor reports what an orderly stop's drain did with it. Safe to call
// concurrently.
func (e *Engine) Decided() Decided {
	c := &e.decided
	return Decided{
		Delivered:    c[Done].Load(),
		Later:        c[Later].Load(),
		DeadLettered: c[DeadLetter].Load(),
		Held:         c[Hold].Load(),
		Skipped:      c[Skip].Load(),
	}
}

// InFlight returns how many events the engine has taken and not settled,
// on both paths.
func (e *Engine) InFlight() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.inflight[PathStream]) + len(e.inflight[PathClaim])
}
