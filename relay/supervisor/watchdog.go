package supervisor

import (
	"context"
	"fmt"
	"time"
)

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
