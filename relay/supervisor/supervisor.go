// Package supervisor runs the relay's sources over the delivery core
// (docs/architecture.md): it owns the modes (auto, replication, poll),
// leadership of the slot, the watchdog that drops a slot nobody consumes,
// and each leadership term's start and orderly stop.
//
// A term, in replication and auto modes, begins when this relay takes the
// slot's leader lock and ends when ctx ends or the lock is lost. It runs
// phases one after another, each on a fresh engine: the stream
// (relay/replication) beside the claim path for the rows the stream
// diverts (relay/claim); in auto mode, while replication is impossible, the
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
	case cfg.Terms == nil:
		return nil, errors.New("supervisor: Terms is required")
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
	if cfg.Observer == nil {
		cfg.Observer = NopObserver{}
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
		s.cfg.Observer.Leading(true)
		// A lost lock ends the term: the watch returns, which fails the
		// term's group and so cancels its context.
		term, termCtx := relay.NewGroup(ctx)
		term.Go("leadership watch", func(ctx context.Context) error {
			select {
			case <-leader.Lost():
				s.cfg.Observer.LeadershipLost()
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
		s.cfg.Observer.Leading(false)
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
