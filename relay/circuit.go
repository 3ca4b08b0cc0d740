package relay

import "time"

// circuit is a sink's circuit breaker: open while the sink is down
// (credentials, workflow not published, unreachable), when its events are
// deferred without an attempt. It also keeps what its log lines tell
// (docs/operations.md, "Logs"): when it opened, how many probes failed
// since, and which events waited.
type circuit struct {
	openUntil time.Time
	downCount int // openings in a row: the probe interval grows with them
	// since is when it opened (zero while closed); reported is when its
	// last line, the opening or a summary, was logged.
	since, reported time.Time
	probes          int                // probes failed since it opened
	waited          map[int64]struct{} // events deferred while open, at most circuitWaitedMax
}

// circuitProbeMax caps how long a circuit stays open before the next event
// probes the sink (docs/operations-health.md, "The bounds"): it bounds the
// time from a sink's recovery to its first delivery, at the cost of one
// request to a down sink every 2 s.
const circuitProbeMax = 2 * time.Second

// circuitSummaryEvery is the least time between two lines about an open
// circuit: the opening, then summaries of the probes that failed.
const circuitSummaryEvery = time.Minute

// circuitWaitedMax bounds the events a circuit remembers having waited; the
// closing line says "at least" beyond it.
const circuitWaitedMax = 10_000

// circuitLine is what a sink-down failure has the lane log.
type circuitLine int

const (
	circuitQuiet     circuitLine = iota
	circuitOpened                // the circuit was closed: log why
	circuitStillOpen             // a probe failed and the last line is circuitSummaryEvery old
)

// fail records that event id found the sink down at now. It opens the
// circuit (or keeps it open, longer) and returns when it closes:
// Retry-After when the sink said, else 1 s, then circuitProbeMax with each
// failed probe in a row. A failure after the circuit's time ran out is a
// failed probe; one that comes while it is still open (a request in
// flight when it opened) is not.
func (c *circuit) fail(now time.Time, retryAfter time.Duration, id int64) (until time.Time, line circuitLine) {
	c.wait(id)
	if now.Before(c.openUntil) {
		if retryAfter > 0 && now.Add(retryAfter).After(c.openUntil) {
			c.openUntil = now.Add(retryAfter)
		}
		return c.openUntil, circuitQuiet
	}
	c.downCount++
	cool := retryAfter
	if cool <= 0 {
		cool = min(time.Second<<min(c.downCount-1, 5), circuitProbeMax)
	}
	c.openUntil = now.Add(cool)
	switch {
	case c.since.IsZero():
		c.since, c.reported = now, now
		return c.openUntil, circuitOpened
	default:
		c.probes++
		if now.Sub(c.reported) < circuitSummaryEvery {
			return c.openUntil, circuitQuiet
		}
		c.reported = now
		return c.openUntil, circuitStillOpen
	}
}

// wait records that event id waits because the circuit is open.
func (c *circuit) wait(id int64) {
	if c.waited == nil {
		c.waited = map[int64]struct{}{}
	}
	if len(c.waited) < circuitWaitedMax {
		c.waited[id] = struct{}{}
	}
}

// close closes the circuit: the sink answered. It reports whether it had
// been open, for how long, and how many events waited meanwhile.
func (c *circuit) close(now time.Time) (was bool, downFor time.Duration, waited int) {
	if c.since.IsZero() {
		return false, 0, 0
	}
	was, downFor, waited = true, now.Sub(c.since), len(c.waited)
	*c = circuit{}
	return was, downFor, waited
}

// isOpen reports whether the circuit is open at now, and until when.
func (c *circuit) isOpen(now time.Time) (time.Time, bool) {
	return c.openUntil, now.Before(c.openUntil)
}
