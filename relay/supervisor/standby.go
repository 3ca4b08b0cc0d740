package supervisor

import (
	"context"
	"errors"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

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
	s.cfg.Observer.StandbyMove("primary", gone.err)
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
		s.cfg.Observer.StandbyMove("standby", nil)
		return nil
	case err == nil, errors.Is(err, relay.ErrLeaseLost):
		return nil
	}
	return err
}
