package supervisor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// lostDrain bounds the drain of a term whose leadership was lost.
const lostDrain = time.Second

// worker is one of a phase's workers: a source feeding the engine, or a
// watch beside them.
type worker struct {
	name string
	run  func(ctx context.Context) error
}

// phase runs one phase: a fresh engine, and over it the workers build
// returns, until ctx ends or a worker fails or returns; then the orderly
// stop, in the order of docs/architecture.md ("Goroutines and their
// owners"): 1. the workers (sources) stop taking events; 2. the engine
// drains (every outcome written, up to ShutdownTimeout); 3. the engine is
// halted and stopped; 4. only then are the workers waited for (the claim
// source holds its owner lock until the engine has stopped: no row it
// claimed is taken over while it may still be sent). A lease lost — the
// leader lock (lost closed) or the claim path's owner lock
// (relay.ErrLeaseLost) — halts the engine at once: nothing more is sent,
// the sends in flight are cancelled, and the drain that writes what was
// delivered is cut short, so the window in which two relays could both
// deliver stays within the lock's keepalive (docs/operations-health.md,
// "a lost lock").
func (s *Supervisor) phase(ctx context.Context, lost <-chan struct{}, build func(e *relay.Engine) ([]worker, error)) error {
	engine, err := s.cfg.Engine()
	if err != nil {
		return err
	}
	// The engine's group outlives ctx: the engine drains after the phase
	// has ended, and stops only once it has.
	core, coreCtx := relay.NewGroup(relay.Detached(ctx, "the engine drains after the phase ends; core.Stop ends it"))
	defer core.Stop()
	core.Go("engine", engine.Run)
	core.Go("lock watch", func(ctx context.Context) error {
		// A lost leader lock halts the engine the moment it is known. The
		// line is logged once Halt has returned: its time is the moment
		// from which nothing more is sent.
		select {
		case <-lost:
			engine.Halt()
			s.log.Warn().Msg("the leader lock is lost: the engine is halted, nothing more is sent")
			<-ctx.Done()
		case <-ctx.Done():
		}
		return nil
	})

	workers, err := build(engine)
	if err != nil {
		engine.Halt()
		return errors.Join(err, core.Stop())
	}
	g, gctx := relay.NewGroup(ctx)
	for _, w := range workers {
		g.Go(w.name, w.run)
	}

	select {
	case <-gctx.Done():
	case <-coreCtx.Done():
	}
	failed := g.Failed()
	g.Cancel() // 1. the sources stop taking events
	drain := s.cfg.ShutdownTimeout
	select {
	case <-lost:
		drain = min(drain, lostDrain)
	default:
	}
	if errors.Is(failed, relay.ErrLeaseLost) {
		engine.Halt()
		drain = min(drain, lostDrain)
	}
	if errors.Is(failed, relay.ErrServerChanged) {
		// What is in flight came from the old server: its outcomes cannot
		// be written to the new one.
		drain = min(drain, lostDrain)
	}
	engineStopped := core.Failed() != nil
	// A stop the operator asked for (or the end of the term) says at once
	// what it waits for, and then what came of it.
	stopping := ctx.Err() != nil && !engineStopped
	began, before := time.Now(), engine.Decided()
	if stopping {
		n, bound := engine.InFlight(), "shutdown_timeout"
		if drain < s.cfg.ShutdownTimeout {
			bound = "cut short: the lease is lost"
		}
		s.log.Info().Int("in_flight", n).Str("up_to", drain.String()).
			Msgf("stopping: %d in flight, up to %s (%s): their outcomes are written first", n, drain, bound)
	}
	if !engineStopped {
		// 2. the engine drains: from now on failed attempts go to the claim
		// path instead of waiting in memory for an inline retry. It drains
		// within the engine's group: a failed engine ends the wait too.
		drainCtx, cancel := context.WithTimeout(coreCtx, drain)
		if err := engine.Drain(drainCtx); err != nil {
			s.log.Warn().Err(err).Msg("the drain's time passed with events in flight; the stream sends them again at the next start and the ledger keeps them from being delivered twice")
		}
		cancel()
	}
	engine.Halt()            // 3. nothing more is sent,
	engineErr := core.Stop() //    and the engine stops
	if stopping {
		s.logStopped(engine, engine.Decided().Minus(before), time.Since(began))
	}
	workersErr := g.Wait() // 4. the sources are waited for
	if workersErr != nil {
		return workersErr
	}
	return engineErr
}

// logStopped says what an orderly stop's drain did with the events in
// flight: d, settled while it drained for took, and those it left.
func (s *Supervisor) logStopped(engine *relay.Engine, d relay.Decided, took time.Duration) {
	left := engine.InFlight()
	msg := fmt.Sprintf("stopped: %d delivered, %d diverted to the claim path, in %s", d.Delivered, d.Later, took.Round(100*time.Millisecond))
	if d.DeadLettered+d.Held > 0 {
		msg += fmt.Sprintf("; %d dead-lettered, %d held", d.DeadLettered, d.Held)
	}
	if left > 0 {
		msg += fmt.Sprintf("; %d left unsettled (the stream sends them again at the next start, the claim path takes its own over)", left)
	}
	s.log.Info().Int64("delivered", d.Delivered).Int64("handed_off", d.Later).Int64("dead_lettered", d.DeadLettered).
		Int64("held", d.Held).Int("unsettled", left).Str("took", took.String()).Msg(msg)
}

// pollPhase builds the workers of a phase where the claim path takes every
// due row (poll mode; in auto mode, while replication is impossible, for d).
func (s *Supervisor) pollPhase(d time.Duration) func(e *relay.Engine) ([]worker, error) {
	return func(e *relay.Engine) ([]worker, error) {
		claim, err := s.cfg.Claim(e, true)
		if err != nil {
			return nil, err
		}
		s.cfg.Observer.Mode("poll")
		l := s.log.Info()
		if d > 0 {
			l = l.Dur("for", d)
		}
		l.Msg("polling: the claim path takes every due row")
		return []worker{{name: "claim path", run: claim.Run}}, nil
	}
}

// streamPhase builds the workers of a phase that streams: the stream and,
// beside it, the claim path over the rows the stream diverts.
func (s *Supervisor) streamPhase(e *relay.Engine) ([]worker, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if pid, err := s.streamSlots().EndStaleWalsender(ctx); err != nil {
		s.log.Warn().Err(err).Msg("could not check the slot for a stale walsender")
	} else if pid != 0 {
		s.log.Warn().Int32("pid", pid).Msg("ended a stale walsender still holding the slot (a former leader)")
	}
	source, err := s.cfg.Stream(e)
	if err != nil {
		return nil, err
	}
	claim, err := s.cfg.Claim(e, false)
	if err != nil {
		return nil, err
	}
	s.cfg.Observer.Mode("replication")
	ws := []worker{{name: "stream", run: source.Run}, {name: "claim path", run: claim.Run}}
	if s.cfg.Standby != nil {
		ws = append(ws, worker{name: "standby watch", run: s.watchStandby})
	}
	return ws, nil
}

// streamSlots is the view of the slot the stream decodes from: on the
// standby when there is one.
func (s *Supervisor) streamSlots() Slots {
	if s.cfg.StandbySlots != nil {
		return s.cfg.StandbySlots
	}
	return s.cfg.Slots
}
