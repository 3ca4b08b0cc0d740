package claim

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

const (
	// alarmEvery limits the stuck-rows warning to one line a minute.
	alarmEvery = time.Minute
	// logResetsMax bounds the per-row lines of one lease sweep.
	logResetsMax = 100
)

// sweepInterval is 5 × PollInterval, at least 1 s.
func (c *Claimer) sweepInterval() time.Duration {
	return max(5*c.cfg.PollInterval, time.Second)
}

// sweepLoop runs a sweep at once (a restarted relay returns its dead
// predecessor's rows without waiting) and then every sweepInterval until
// ctx is done.
func (c *Claimer) sweepLoop(ctx context.Context) {
	tick := time.NewTicker(c.sweepInterval())
	defer tick.Stop()
	for {
		c.sweep(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// sweep returns expired or orphaned leases to pending, makes NULL
// available_at rows due (poll mode), and measures the rows nobody claims.
// Errors are logged: the next sweep tries again.
func (c *Claimer) sweep(ctx context.Context) {
	if n, err := c.expireLeases(ctx); err != nil && ctx.Err() == nil {
		c.log.Warn().Err(err).Msg("sweep expired leases; trying again at the next sweep")
	} else if n > 0 {
		c.Kick()
	}
	if c.cfg.All {
		if tag, err := c.cfg.Pool.Exec(ctx, c.sql.repairDue); err != nil && ctx.Err() == nil {
			c.log.Warn().Err(err).Msg("make pending rows with a NULL available_at due")
		} else if n := tag.RowsAffected(); n > 0 {
			c.log.Info().Int64("rows", n).Msg("pending rows had a NULL available_at: made them due now")
		}
	}
	if err := c.measureStuck(ctx); err != nil && ctx.Err() == nil {
		c.log.Warn().Err(err).Msg("measure rows pending longer than sweep_after")
	}
}

// expireLeases returns to pending the 'processing' rows whose lease passed
// or whose relay owner is gone, keeping their attempts, and logs each.
// Their ledger claims are taken over when the rows are claimed again.
func (c *Claimer) expireLeases(ctx context.Context) (int, error) {
	rows, err := c.cfg.Pool.Query(ctx, c.sql.expireLeases, c.cfg.LockTimeout.Milliseconds(), OwnerPrefix)
	if err != nil {
		return 0, fmt.Errorf("return expired leases: %w", err)
	}
	var (
		id    int64
		owner *string
		n     int
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &owner}, func() error {
		n++
		c.Stats.TakenOver.Add(1)
		if n <= logResetsMax {
			c.log.Warn().Int64("id", id).Str("old_owner", orUnknown(deref(owner))).
				Msg("lease passed or owner gone: row returned to pending")
		}
		return nil
	})
	if n > logResetsMax {
		c.log.Warn().Int("rows", n).Msg("lease passed or owner gone: rows returned to pending (first ones logged above)")
	}
	if err != nil {
		return n, fmt.Errorf("return expired leases: %w", err)
	}
	return n, nil
}

// measureStuck updates StuckRows and OldestUnclaimedAge and warns, at most
// once a minute, while there are such rows. It never claims them: only a
// hand-off, the slot hand-over or `outbox-relay reconcile` makes a row the
// claim path's.
func (c *Claimer) measureStuck(ctx context.Context) error {
	var (
		count  int64
		oldest float64
	)
	if err := c.cfg.Pool.QueryRow(ctx, c.sql.stuck, c.cfg.SweepAfter.Milliseconds()).Scan(&count, &oldest); err != nil {
		return err
	}
	age := time.Duration(oldest * float64(time.Second))
	c.stuckRows.Store(count)
	c.oldestStuck.Store(int64(age))
	if count > 0 && time.Since(c.lastAlarm) >= alarmEvery {
		c.lastAlarm = time.Now()
		l := c.log.Warn().Int64("rows", count).Dur("oldest_age", age.Round(time.Second)).Dur("sweep_after", c.cfg.SweepAfter)
		if c.cfg.All {
			l.Msg("rows pending longer than sweep_after: the claim path is not keeping up or its sinks are failing")
		} else {
			l.Msg("rows pending longer than sweep_after that the stream has not delivered: if the slot was dropped and recreated while the relay was down, run outbox-relay reconcile --older-than D")
		}
	}
	return nil
}
