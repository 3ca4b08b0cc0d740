package relay

import "time"

// StuckRow is a row the stuck-rows alarm counts: pending, the stream's (not
// diverted), and due longer than sweep_after ago.
type StuckRow struct {
	ID  int64
	Due time.Time
}

// StreamView is what the engine knows of the rows the stream owns, which
// the tables cannot say: which are in its lanes, and whether the stream has
// reached every row committed before its session began. The stuck-rows
// alarm tells by it what a row waits for (docs/operations.md, "reconcile").
type StreamView struct {
	// InFlight holds the ids of the stream's events taken and not settled:
	// they wait for their sinks.
	InFlight map[int64]bool
	// Started is when the stream's current session began (Consumer.Restart);
	// zero when no session has begun on this engine.
	Started time.Time
	// CaughtUp: the stream has decoded past the server's WAL position at
	// that start, so every row committed before it has reached the engine.
	CaughtUp bool
	// SinksDown names the sinks whose circuit is open or that failed since
	// it last closed: their events wait or are diverted.
	SinksDown []string
}

// StreamView returns the engine's view of the stream's rows now. Read it
// before the rows it explains: a row settled in between is then still in
// InFlight, never taken for one the stream passed. Safe to call
// concurrently.
func (e *Engine) StreamView() StreamView {
	v := StreamView{InFlight: map[int64]bool{}}
	e.mu.Lock()
	for id := range e.inflight[PathStream] {
		v.InFlight[id] = true
	}
	e.mu.Unlock()
	f := e.stream
	if n := f.started.Load(); n != 0 {
		v.Started = time.Unix(0, n)
		v.CaughtUp = f.decodedPast(LSN(f.horizon.Load()))
	}
	now := time.Now()
	for _, l := range e.lanes {
		l.mu.Lock()
		_, open := l.circuit.isOpen(now)
		down := open || l.circuit.downCount > 0
		l.mu.Unlock()
		if down {
			v.SinksDown = append(v.SinksDown, l.name)
		}
	}
	return v
}
