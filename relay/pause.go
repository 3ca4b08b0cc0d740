package relay

import (
	"context"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// PauseStore tells the engine which sinks an operator paused
// (docs/sinks.md, "Pause and resume"). The database holds the pause, so it
// outlives a restart and holds for every relay on the outbox; the engine
// keeps a copy it reads every PausePoll.
type PauseStore interface {
	// PausedSinks returns the names of the paused sinks, in any order. It
	// is safe to call concurrently and to repeat.
	PausedSinks(ctx context.Context) ([]string, error)
}

// PausePoll is how often a running engine reads the paused sinks: a pause
// or a resume made by the CLI, the console or another relay takes effect
// within it. A pause is one row per paused sink in a table of a handful,
// so reading it this often costs nothing worth a LISTEN connection.
const PausePoll = 500 * time.Millisecond

var sinkPaused = promauto.NewGaugeVec(prometheus.GaugeOpts{
	Namespace: "outbox_relay", Name: "sink_paused",
	Help: "1 while an operator has paused the sink (outbox-relay sink pause), 0 otherwise.",
}, []string{"sink"})

// pausedHold is how long a paused sink defers an event: the claim path
// offers it again then. A pause is an open circuit an operator holds, so it
// shares the circuit's probe interval: a resume reaches the events it held
// within it.
const pausedHold = circuitProbeMax

// loadPauses reads the paused sinks before the lanes start, retrying while
// the database is unreachable: an engine that does not know a pause must
// not send to the sink. It fails only when ctx ends.
func (e *Engine) loadPauses(ctx context.Context) error {
	if e.cfg.Pauses == nil {
		return nil
	}
	return retry(ctx, func() error { return e.readPauses(ctx) }, func(err error, wait time.Duration) {
		e.log.Warn().Err(err).Dur("retry_in", wait).Msg("read the paused sinks; retrying")
	})
}

// watchPauses reads the paused sinks every PausePoll until ctx ends. A
// failed read keeps the last state it knew and is logged once until a read
// succeeds again.
func (e *Engine) watchPauses(ctx context.Context) {
	tick := time.NewTicker(PausePoll)
	defer tick.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := e.readPauses(rctx)
		cancel()
		switch {
		case err != nil && ctx.Err() == nil && !failing:
			failing = true
			e.log.Warn().Err(err).Msg("read the paused sinks: keeping the pauses last read until a read succeeds")
		case err == nil:
			failing = false
		}
	}
}

// readPauses reads the paused sinks once and applies them to the lanes.
func (e *Engine) readPauses(ctx context.Context) error {
	names, err := e.cfg.Pauses.PausedSinks(ctx)
	if err != nil {
		return err
	}
	for _, l := range e.lanes {
		l.setPaused(slices.Contains(names, l.name))
	}
	return nil
}

// setPaused pauses or resumes the lane, logging a change.
func (l *lane) setPaused(paused bool) {
	if l.paused.Swap(paused) == paused {
		return
	}
	if paused {
		sinkPaused.WithLabelValues(l.name).Set(1)
		l.e.log.Info().Str("sink", l.name).Msg("sink paused: its events go to the claim path without an attempt until it is resumed")
		return
	}
	sinkPaused.WithLabelValues(l.name).Set(0)
	l.e.log.Info().Str("sink", l.name).Msg("sink resumed: the events it held are delivered in per-aggregate order")
}

// closed reports whether the lane sends nothing now: the sink is paused,
// or its circuit is open. It returns the deferred outcome of a pair that
// finds it closed. Call it with l.mu held.
func (l *lane) closed(id int64) (Outcome, bool) {
	now := l.e.now()
	if l.paused.Load() {
		return Outcome{Kind: Deferred, Reason: "sink paused by an operator", Until: now.Add(pausedHold), Why: "paused"}, true
	}
	if until, open := l.circuit.isOpen(now); open {
		l.circuit.wait(id)
		return Outcome{Kind: Deferred, Reason: "circuit open: sink is down", Until: until, Why: "sink_down"}, true
	}
	return Outcome{}, false
}
