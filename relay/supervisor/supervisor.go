// Package supervisor runs the relay's sources over the delivery core
// (docs/architecture.md): it owns the modes (auto, replication, poll),
// leadership of the slot, the watchdog that drops a slot nobody consumes,
// and each leadership term's start and orderly stop.
//
// A term, in replication and auto modes, begins when this relay takes the
// slot's leader lock and ends when ctx ends or the lock is lost. It runs
// phases one after another, each on a fresh engine: the stream
// (relay/replication) beside the claim path for the rows the stream hands
// off (relay/claim); in auto mode, while replication is impossible, the
// claim path over every due row, trying to return to replication every
// ReplicationRetry. A phase stops in this order: the engine stops retrying
// in memory; the sources stop taking events (the claim path waits for the
// rows it claimed to settle); the engine drains (every outcome written, up
// to ShutdownTimeout); the engine stops. Only then does the next phase
// start, so that a path never takes a row another is still delivering, and
// at the end of the term the lock is released. Every goroutine a term
// starts has ended when the term returns. A term streams from one database server: when the
// stream finds another (relay.ErrServerChanged, a failover), the term ends
// as if its lock were lost and a new one starts on the new server.
//
// In poll mode there is no leader: every relay claims rows, and the table
// (SKIP LOCKED, leases, owner locks) coordinates them.
package supervisor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Mode is source.mode.
type Mode string

// The modes.
const (
	ModeAuto        Mode = "auto"
	ModeReplication Mode = "replication"
	ModePoll        Mode = "poll"
)

// Leadership is a held leader lock.
type Leadership interface {
	// Lost is closed when the lock is lost: delivery must stop at once,
	// another relay may already be taking over.
	Lost() <-chan struct{}
	// Release gives the lock up.
	Release()
}

// Runner is a source: it runs until ctx ends.
type Runner interface {
	Run(ctx context.Context) error
}

// Unavailable is implemented by errors that say replication cannot work on
// this server until someone changes its configuration
// (replication.UnavailableError).
type Unavailable interface {
	error
	UnavailableReason() string
}

// Slots is what the watchdog needs to know about the relay's slot.
type Slots interface {
	// Slot reports whether the slot exists, whether a process streams from
	// it, and the WAL it retains.
	Slot(ctx context.Context) (exists, active bool, retained int64, err error)
	// DropSlot drops the slot if it exists and nobody streams from it,
	// and reports whether it did.
	DropSlot(ctx context.Context) (bool, error)
	// EndStaleWalsender ends a process still streaming from the slot (a
	// former leader), and returns its pid, or 0.
	EndStaleWalsender(ctx context.Context) (int32, error)
}

// Standby watches the physical standby the stream decodes on
// (source.standby_url); replication.StandbyWatch implements it.
type Standby interface {
	// Watch runs beside the stream until ctx ends, then returns nil; it
	// returns an error (implementing Unavailable) once the standby is
	// unreachable, or lags its primary, past its bound.
	Watch(ctx context.Context) error
	// WaitHealthy returns nil once the standby is reachable and within its
	// bound again, or ctx's error.
	WaitHealthy(ctx context.Context) error
}

// Config configures a Supervisor. Zero durations take the defaults in
// brackets.
type Config struct {
	Mode Mode
	// Leader blocks until this relay holds the slot's leader lock, or ctx
	// ends. Not used in poll mode.
	Leader func(ctx context.Context) (Leadership, error)
	// Engine builds a fresh engine for a term.
	Engine func() (*relay.Engine, error)
	// Stream builds the replication source feeding e.
	Stream func(e *relay.Engine) (Runner, error)
	// Claim builds the claim source feeding e; all takes every due row
	// (poll mode), otherwise only rows handed to the claim path.
	Claim func(e *relay.Engine, all bool) (Runner, error)
	// Slots watches the relay's slot.
	Slots Slots
	// Standby, when set, watches the standby the stream decodes on
	// (docs/standby.md). In auto mode, once it reports the standby
	// unavailable, delivery moves to the primary — the claim path over
	// every due row — until WaitHealthy returns, then back to the stream on
	// the standby. In replication mode the stream keeps trying the standby,
	// and the report is only logged.
	Standby Standby
	// StandbySlots, when set, is the relay's slot on the standby the stream
	// decodes on: a watchdog of its own drops it when nobody consumes it,
	// a term ends a stale walsender there, and a return from poll mode
	// drops it there. Slots then watches the relay's slot of the same name
	// on the primary, a leftover of decoding there.
	StandbySlots Slots
	// OnStandbyMove is told each move of delivery off the standby (to
	// "primary", with the watch's error) and back (to "standby", err nil).
	OnStandbyMove func(to string, err error)
	// ReplicationRetry is how often auto mode, while polling, tries to
	// return to replication [1m].
	ReplicationRetry time.Duration
	// SlotMaxUnconsumed drops the relay's slot once nobody has streamed
	// from it this long [10m], or once it retains SlotMaxRetained bytes
	// [1 GiB] while nobody does.
	SlotMaxUnconsumed time.Duration
	SlotMaxRetained   int64
	// ShutdownTimeout bounds the drain at the end of a term [30s].
	ShutdownTimeout time.Duration
	// StandBy is the pause after a lost leadership before trying to lead
	// again, giving a healthy standby the first chance [3s].
	StandBy time.Duration
	// OnMode is told the mode a term runs in ("replication", "poll"), and
	// OnLeader whether this relay leads. OnLeadershipLost is called when the
	// lock is lost (this process's link to the database is suspect: the
	// relay resets its pool there).
	OnMode           func(mode string)
	OnLeader         func(leader bool)
	OnLeadershipLost func()
	Logger           zerolog.Logger
}

// lostDrain bounds the drain of a term whose leadership was lost.
const lostDrain = time.Second

// errLeadershipLost ends a term whose leader lock was lost.
var errLeadershipLost = errors.New("leadership lost")

// Supervisor runs the relay. Create it with New and call Run once.
type Supervisor struct {
	cfg Config
	log zerolog.Logger
}

// New validates cfg and fills in defaults.
func New(cfg Config) (*Supervisor, error) {
	switch {
	case cfg.Engine == nil || cfg.Claim == nil:
		return nil, errors.New("supervisor: Engine and Claim are required")
	case cfg.Mode != ModePoll && (cfg.Stream == nil || cfg.Leader == nil):
		return nil, fmt.Errorf("supervisor: mode %s needs Stream and Leader", cfg.Mode)
	case cfg.Mode != ModeAuto && cfg.Mode != ModeReplication && cfg.Mode != ModePoll:
		return nil, fmt.Errorf("supervisor: unknown mode %q", cfg.Mode)
	}
	if cfg.ReplicationRetry <= 0 {
		cfg.ReplicationRetry = time.Minute
	}
	if cfg.SlotMaxUnconsumed <= 0 {
		cfg.SlotMaxUnconsumed = 10 * time.Minute
	}
	if cfg.SlotMaxRetained <= 0 {
		cfg.SlotMaxRetained = 1 << 30
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 30 * time.Second
	}
	if cfg.StandBy <= 0 {
		cfg.StandBy = 3 * time.Second
	}
	if cfg.OnMode == nil {
		cfg.OnMode = func(string) {}
	}
	if cfg.OnLeader == nil {
		cfg.OnLeader = func(bool) {}
	}
	if cfg.OnLeadershipLost == nil {
		cfg.OnLeadershipLost = func() {}
	}
	if cfg.OnStandbyMove == nil {
		cfg.OnStandbyMove = func(string, error) {}
	}
	return &Supervisor{cfg: cfg, log: cfg.Logger}, nil
}

// Run runs the relay until ctx ends, then returns nil after an orderly
// stop. It returns an error when the relay cannot run: a source that cannot
// start, replication unavailable in replication mode, or a worker that
// failed (relay.Group).
func (s *Supervisor) Run(ctx context.Context) error {
	if s.cfg.Mode == ModePoll {
		// Every relay polls; there is no leader. A slot left from running
		// in another mode is still dropped once nobody consumes it.
		return s.beside(ctx, func(ctx context.Context) error {
			for {
				err := s.phase(ctx, nil, s.pollPhase(0))
				if ctx.Err() != nil {
					return nil
				}
				if !errors.Is(err, relay.ErrLeaseLost) {
					if err == nil {
						err = errors.New("the poll phase ended without a cause")
					}
					return err
				}
				s.log.Warn().Err(err).Msg("the claim path's lease was lost: delivery stopped; starting again")
				if !relay.Sleep(ctx, leaseLostPause) {
					return nil
				}
			}
		})
	}
	for {
		leader, err := s.cfg.Leader(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		s.cfg.OnLeader(true)
		// A lost lock ends the term: the watch returns, which fails the
		// term's group and so cancels its context.
		term, termCtx := relay.NewGroup(ctx)
		term.Go("leadership watch", func(ctx context.Context) error {
			select {
			case <-leader.Lost():
				s.cfg.OnLeadershipLost()
				return errLeadershipLost
			case <-ctx.Done():
				return nil
			}
		})
		err = s.lead(termCtx, leader.Lost())
		if werr := term.Stop(); err == nil && !errors.Is(werr, errLeadershipLost) {
			err = werr
		}
		leader.Release()
		s.cfg.OnLeader(false)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, relay.ErrServerChanged) {
			// A failover: the old server's events stayed with the old term;
			// lead again at once, on the new server (docs/failover.md).
			s.log.Warn().Err(err).Msg("the database server changed: the term ended; leading again on the new server")
			continue
		}
		select {
		case <-leader.Lost():
		default:
			if err == nil {
				err = errors.New("the term ended without a cause")
			}
			return err
		}
		// Losing the lock means this process's link to the database is
		// suspect: give a healthy standby the first chance to take over.
		s.log.Warn().Msg("leadership lost: delivery stopped; standing by to take over again")
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(s.cfg.StandBy):
		}
	}
}

// leaseLostPause is the pause before a new phase after the claim path's
// lease (its owner lock) was lost.
const leaseLostPause = time.Second

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
		// A lost leader lock halts the engine the moment it is known.
		select {
		case <-lost:
			engine.Halt()
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
	// From the moment the phase ends, failed attempts go to the claim path
	// instead of waiting in memory for an inline retry.
	engine.BeginDrain()
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
		// 2. the engine drains, within the engine's group: a failed engine
		// ends the wait too.
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
	msg := fmt.Sprintf("stopped: %d delivered, %d handed to the claim path, in %s", d.Delivered, d.Later, took.Round(100*time.Millisecond))
	if d.DeadLettered+d.Held > 0 {
		msg += fmt.Sprintf("; %d dead-lettered, %d held", d.DeadLettered, d.Held)
	}
	if left > 0 {
		msg += fmt.Sprintf("; %d left unsettled (the stream sends them again at the next start, the claim path takes its own over)", left)
	}
	s.log.Info().Int64("delivered", d.Delivered).Int64("handed_off", d.Later).Int64("dead_lettered", d.DeadLettered).
		Int64("held", d.Held).Int("unsettled", left).Str("took", took.String()).Msg(msg)
}

// lead runs a leader's term: the slot watchdog, and phases one after
// another — the stream, or in auto mode, while replication is impossible,
// the claim path over every row — each drained before the next starts.
func (s *Supervisor) lead(ctx context.Context, lost <-chan struct{}) error {
	return s.beside(ctx, func(ctx context.Context) error {
		var pollingSince time.Time
		for {
			err := s.phase(ctx, lost, s.streamPhase)
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, relay.ErrLeaseLost) {
				s.log.Warn().Err(err).Msg("the claim path's lease was lost: delivery stopped; starting again")
				if !relay.Sleep(ctx, leaseLostPause) {
					return nil
				}
				continue
			}
			if gone, ok := errors.AsType[*standbyGone](err); ok {
				if err := s.offStandby(ctx, lost, gone); err != nil {
					return err
				}
				continue
			}
			var unavailable Unavailable
			if !errors.As(err, &unavailable) {
				if err == nil {
					err = errors.New("the stream's phase ended without a cause")
				}
				return err
			}
			if s.cfg.Mode == ModeReplication {
				return fmt.Errorf("replication is unavailable and source.mode is replication: %s", unavailable.UnavailableReason())
			}
			if pollingSince.IsZero() {
				pollingSince = time.Now()
				s.log.Warn().Str("reason", unavailable.UnavailableReason()).Dur("retry_every", s.cfg.ReplicationRetry).
					Msg("replication unavailable: falling back to the claim path over every row")
			}
			// The stream's phase has drained: what it delivered is written,
			// so the claim path cannot take a row the stream still sends.
			pollCtx, cancel := context.WithTimeout(ctx, s.cfg.ReplicationRetry)
			err = s.phase(pollCtx, lost, s.pollPhase(s.cfg.ReplicationRetry))
			cancel()
			if ctx.Err() != nil {
				return nil
			}
			if err != nil && !errors.Is(err, relay.ErrLeaseLost) {
				return err
			}
			// Back to replication through the slot-creation hand-over: a
			// slot left from before polling is dropped, so the new one's
			// snapshot marks every row polling did not finish for the claim
			// path.
			if dropped, err := s.streamSlots().DropSlot(ctx); err != nil {
				s.log.Warn().Err(err).Msg("drop the old slot before returning to replication")
			} else if dropped {
				s.log.Warn().Str("why", "returning from poll mode to replication").Msg("dropped the replication slot; the outbox table keeps the events")
			}
		}
	})
}

// beside runs phases (the caller's loop of phases) with the slot watchdog
// beside it, until ctx ends or either fails, and returns the loop's error,
// else the watchdog's failure.
func (s *Supervisor) beside(ctx context.Context, phases func(ctx context.Context) error) error {
	g, gctx := relay.NewGroup(ctx)
	if s.cfg.Slots != nil {
		g.Go("slot watchdog", func(ctx context.Context) error { s.watchSlot(ctx, s.cfg.Slots); return nil })
	}
	if s.cfg.StandbySlots != nil {
		g.Go("standby slot watchdog", func(ctx context.Context) error { s.watchSlot(ctx, s.cfg.StandbySlots); return nil })
	}
	err := phases(gctx)
	if werr := g.Stop(); err == nil {
		err = werr
	}
	return err
}

// pollPhase builds the workers of a phase where the claim path takes every
// due row (poll mode; in auto mode, while replication is impossible, for d).
func (s *Supervisor) pollPhase(d time.Duration) func(e *relay.Engine) ([]worker, error) {
	return func(e *relay.Engine) ([]worker, error) {
		claim, err := s.cfg.Claim(e, true)
		if err != nil {
			return nil, err
		}
		s.cfg.OnMode("poll")
		l := s.log.Info()
		if d > 0 {
			l = l.Dur("for", d)
		}
		l.Msg("polling: the claim path takes every due row")
		return []worker{{name: "claim path", run: claim.Run}}, nil
	}
}

// streamPhase builds the workers of a phase that streams: the stream and,
// beside it, the claim path over the rows the stream hands off.
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
	s.cfg.OnMode("replication")
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

// standbyGone ends a stream phase whose standby is unavailable.
type standbyGone struct{ err error }

func (e *standbyGone) Error() string { return e.err.Error() }
func (e *standbyGone) Unwrap() error { return e.err }

// errStandbyBack ends the phase that delivers on the primary once the
// standby is healthy again.
var errStandbyBack = errors.New("the standby is back")

// standbyRecheck is the pause, in replication mode, before watching a
// standby found unavailable again.
const standbyRecheck = 5 * time.Second

// watchStandby runs the standby watch beside the stream. In auto mode an
// unavailable standby ends the phase (standbyGone); in replication mode
// it is logged and watched again, the stream trying it meanwhile.
func (s *Supervisor) watchStandby(ctx context.Context) error {
	for {
		err := s.cfg.Standby.Watch(ctx)
		if err == nil || ctx.Err() != nil {
			return nil
		}
		if s.cfg.Mode == ModeAuto {
			return &standbyGone{err: err}
		}
		s.log.Warn().Err(err).Msg("the standby the stream decodes on is unavailable; source.mode is replication, so the stream keeps trying it (auto mode would deliver on the primary meanwhile)")
		if !relay.Sleep(ctx, standbyRecheck) {
			return nil
		}
	}
}

// offStandby runs delivery on the primary — the claim path over every due
// row — from the moment the standby the stream decodes on is found
// unavailable until it is healthy again (or ctx ends), logging and counting
// both moves. The stream's phase has drained: the claim path cannot take a
// row the stream still sends. The watch voided the slot's hand-over before
// it reported, so the stream's next phase makes a new slot on the standby
// through the hand-over, which gives the claim path every row still pending
// then.
func (s *Supervisor) offStandby(ctx context.Context, lost <-chan struct{}, gone *standbyGone) error {
	reason := gone.Error()
	if u, ok := errors.AsType[Unavailable](gone.err); ok {
		reason = u.UnavailableReason()
	}
	s.log.Warn().Str("reason", reason).Msg("the standby the stream decodes on is unavailable: delivery moves to the primary (the claim path takes every due row) until the standby is back")
	s.cfg.OnStandbyMove("primary", gone.err)
	err := s.phase(ctx, lost, func(e *relay.Engine) ([]worker, error) {
		ws, err := s.pollPhase(0)(e)
		if err != nil {
			return nil, err
		}
		return append(ws, worker{name: "standby return watch", run: func(ctx context.Context) error {
			if err := s.cfg.Standby.WaitHealthy(ctx); err != nil {
				return nil // ctx ended
			}
			return errStandbyBack
		}}), nil
	})
	switch {
	case ctx.Err() != nil:
		return nil
	case errors.Is(err, errStandbyBack):
		s.log.Info().Msg("the standby the stream decodes on is back within source.standby_max_lag: delivery returns to it (a new slot there, through the hand-over)")
		s.cfg.OnStandbyMove("standby", nil)
		return nil
	case err == nil, errors.Is(err, relay.ErrLeaseLost):
		return nil
	}
	return err
}

// watchSlot drops the relay's slot once nobody has streamed from it for
// SlotMaxUnconsumed, or once it retains SlotMaxRetained bytes while nobody
// does, in every mode: the table keeps the events, and a slot nobody
// consumes would keep WAL without limit (docs/guarantees.md). It checks
// every few seconds until ctx ends.
func (s *Supervisor) watchSlot(ctx context.Context, slots Slots) {
	every := max(min(s.cfg.SlotMaxUnconsumed/3, 5*time.Second), 100*time.Millisecond)
	tick := time.NewTicker(every)
	defer tick.Stop()
	var inactiveSince time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		exists, active, retained, err := slots.Slot(ctx)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn().Err(err).Msg("check the replication slot")
			}
			continue
		}
		if !exists || active {
			inactiveSince = time.Time{}
			continue
		}
		if inactiveSince.IsZero() {
			inactiveSince = time.Now()
		}
		idle := time.Since(inactiveSince)
		if idle < s.cfg.SlotMaxUnconsumed && retained < s.cfg.SlotMaxRetained {
			continue
		}
		dropped, err := slots.DropSlot(ctx)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn().Err(err).Msg("drop the unconsumed replication slot")
			}
			continue
		}
		if dropped {
			s.log.Warn().Str("why", fmt.Sprintf("not consumed for %s, retaining %d bytes of WAL", idle.Round(time.Second), retained)).
				Msg("dropped the replication slot; the outbox table keeps the events")
			inactiveSince = time.Time{}
		}
	}
}
