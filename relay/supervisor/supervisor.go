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
	"golang.org/x/sync/errgroup"

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
	// Startup, when set, runs beside the sources at the start of each
	// phase, mode "replication" or "poll" (marking done the rows the
	// stream delivered, for the claim path in poll mode and for tools that
	// read the status column).
	Startup func(ctx context.Context, mode string)
	// Slots watches the relay's slot.
	Slots Slots
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
	return &Supervisor{cfg: cfg, log: cfg.Logger}, nil
}

// Run runs the relay until ctx ends, then returns nil after an orderly
// stop. It returns an error when the relay cannot run: a source that cannot
// start, or replication unavailable in replication mode.
func (s *Supervisor) Run(ctx context.Context) error {
	if s.cfg.Mode == ModePoll {
		// Every relay polls; there is no leader. A slot left from running
		// in another mode is still dropped once nobody consumes it.
		g, gctx := errgroup.WithContext(ctx)
		if s.cfg.Slots != nil {
			g.Go(func() error { s.watchSlot(gctx); return nil })
		}
		g.Go(func() error {
			return s.phase(gctx, nil, func(ctx context.Context, e *relay.Engine) error { return s.poll(ctx, e, 0) })
		})
		return g.Wait()
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
		termCtx, endTerm := context.WithCancel(ctx)
		watched := make(chan struct{})
		go func() {
			defer close(watched)
			select {
			case <-leader.Lost():
				s.cfg.OnLeadershipLost()
				endTerm()
			case <-termCtx.Done():
			}
		}()
		err = s.lead(termCtx, leader.Lost())
		endTerm()
		<-watched
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
		if err != nil {
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

// phase runs one phase: a fresh engine, and body over it until ctx ends or
// body returns; then the orderly stop described in the package doc. A phase
// whose lock was lost (lost closed) stops delivering at once: the drain
// that finishes in-flight deliveries is cut short, so that the window in
// which two relays could both deliver stays below LeaderStaleAfter
// (docs/operations.md, "leadership").
func (s *Supervisor) phase(ctx context.Context, lost <-chan struct{}, body func(ctx context.Context, e *relay.Engine) error) error {
	drain := s.cfg.ShutdownTimeout
	engine, err := s.cfg.Engine()
	if err != nil {
		return err
	}
	engineCtx, stopEngine := context.WithCancel(context.WithoutCancel(ctx))
	defer stopEngine()
	engineDone := make(chan error, 1)
	go func() { engineDone <- engine.Run(engineCtx) }()
	// From the moment the term ends, failed attempts go to the claim path
	// instead of waiting in memory for an inline retry.
	stopDraining := context.AfterFunc(ctx, engine.BeginDrain)
	defer stopDraining()

	bodyErr := body(ctx, engine)

	select {
	case <-lost:
		drain = min(drain, lostDrain)
	default:
	}
	if errors.Is(bodyErr, relay.ErrServerChanged) {
		// What is in flight came from the old server: its outcomes cannot
		// be written to the new one.
		drain = min(drain, lostDrain)
	}
	drainCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), drain)
	defer cancel()
	if err := engine.Drain(drainCtx); err != nil {
		s.log.Warn().Err(err).Msg("shutdown_timeout passed with events in flight; the stream sends them again at the next start and the ledger keeps them from being delivered twice")
	}
	stopEngine()
	if err := <-engineDone; err != nil && !errors.Is(err, context.Canceled) && bodyErr == nil {
		bodyErr = err
	}
	if bodyErr != nil && errors.Is(bodyErr, context.Canceled) {
		bodyErr = nil
	}
	return bodyErr
}

// lead runs a leader's term: the slot watchdog, and phases one after
// another — the stream, or in auto mode, while replication is impossible,
// the claim path over every row — each drained before the next starts.
func (s *Supervisor) lead(ctx context.Context, lost <-chan struct{}) error {
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { s.watchSlot(gctx); return nil })
	g.Go(func() error {
		var pollingSince time.Time
		for {
			err := s.phase(gctx, lost, s.stream)
			var unavailable Unavailable
			if gctx.Err() != nil || !errors.As(err, &unavailable) {
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
			err = s.phase(gctx, lost, func(ctx context.Context, e *relay.Engine) error { return s.poll(ctx, e, s.cfg.ReplicationRetry) })
			if err != nil || gctx.Err() != nil {
				return err
			}
			// Back to replication through the slot-creation hand-over: a
			// slot left from before polling is dropped, so the new one's
			// snapshot marks every row polling did not finish for the claim
			// path.
			if dropped, err := s.cfg.Slots.DropSlot(gctx); err != nil {
				s.log.Warn().Err(err).Msg("drop the old slot before returning to replication")
			} else if dropped {
				s.log.Warn().Str("why", "returning from poll mode to replication").Msg("dropped the replication slot; the outbox table keeps the events")
			}
		}
	})
	err := g.Wait()
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// poll runs the claim path over every due row for d (0: until ctx ends).
func (s *Supervisor) poll(ctx context.Context, e *relay.Engine, d time.Duration) error {
	claim, err := s.cfg.Claim(e, true)
	if err != nil {
		return err
	}
	s.cfg.OnMode("poll")
	if d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	s.log.Info().Msg("polling: the claim path takes every due row")
	var g errgroup.Group
	if s.cfg.Startup != nil {
		g.Go(func() error { s.cfg.Startup(ctx, "poll"); return nil })
	}
	err = claim.Run(ctx)
	g.Wait()
	if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

// stream runs the stream and, beside it, the claim path over the rows the
// stream hands off, until ctx ends or replication fails for good.
func (s *Supervisor) stream(ctx context.Context, e *relay.Engine) error {
	if pid, err := s.cfg.Slots.EndStaleWalsender(ctx); err != nil {
		s.log.Warn().Err(err).Msg("could not check the slot for a stale walsender")
	} else if pid != 0 {
		s.log.Warn().Int32("pid", pid).Msg("ended a stale walsender still holding the slot (a former leader)")
	}
	source, err := s.cfg.Stream(e)
	if err != nil {
		return err
	}
	claim, err := s.cfg.Claim(e, false)
	if err != nil {
		return err
	}
	s.cfg.OnMode("replication")

	streamCtx, stopStream := context.WithCancel(ctx)
	defer stopStream()
	var g errgroup.Group
	g.Go(func() error { return claim.Run(streamCtx) })
	if s.cfg.Startup != nil {
		g.Go(func() error { s.cfg.Startup(streamCtx, "replication"); return nil })
	}
	srcErr := source.Run(streamCtx)
	// The stream stopped (ctx, or replication unavailable): the claim path
	// stops with it, after settling the rows it claimed.
	stopStream()
	if err := g.Wait(); err != nil && srcErr == nil {
		srcErr = err
	}
	if srcErr != nil && errors.Is(srcErr, context.Canceled) {
		return nil
	}
	return srcErr
}

// watchSlot drops the relay's slot once nobody has streamed from it for
// SlotMaxUnconsumed, or once it retains SlotMaxRetained bytes while nobody
// does, in every mode: the table keeps the events, and a slot nobody
// consumes would keep WAL without limit (docs/guarantees.md). It checks
// every few seconds until ctx ends.
func (s *Supervisor) watchSlot(ctx context.Context) {
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
		exists, active, retained, err := s.cfg.Slots.Slot(ctx)
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
		dropped, err := s.cfg.Slots.DropSlot(ctx)
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
