package claim

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

const (
	// alarmEvery limits the stuck-rows warning to one line a minute.
	alarmEvery = time.Minute
	// logResetsMax bounds the per-row lines of one lease sweep.
	logResetsMax = 100
	// ownerPingEvery is how often the owner-lock connection is checked.
	ownerPingEvery = time.Second
)

// sweepInterval is 5 × PollInterval, at least 1 s.
func (c *Source) sweepInterval() time.Duration { return max(5*c.cfg.PollInterval, time.Second) }

// sweepLoop runs a sweep at once (a restarted relay returns its dead
// predecessor's rows without waiting) and then every sweepInterval until
// ctx is done.
func (c *Source) sweepLoop(ctx context.Context) {
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
// available_at rows due, and measures the rows nobody claims. Errors are
// logged: the next sweep tries again.
func (c *Source) sweep(ctx context.Context) {
	store := c.cfg.Store
	expired, err := store.ExpireLeases(ctx, c.cfg.LockTimeout)
	if err != nil && ctx.Err() == nil {
		c.log.Warn().Err(err).Msg("sweep expired leases; trying again at the next sweep")
	}
	for i, l := range expired {
		c.Stats.TakenOver.Add(1)
		if i < logResetsMax {
			c.log.Warn().Int64("id", l.ID).Str("old_owner", orUnknown(l.OldOwner)).Msg("lease passed or owner gone: row returned to pending")
		}
	}
	if len(expired) > logResetsMax {
		c.log.Warn().Int("rows", len(expired)).Msg("lease passed or owner gone: rows returned to pending (first ones logged above)")
	}
	if len(expired) > 0 {
		c.Kick()
	}
	if n, err := store.RepairDue(ctx); err != nil && ctx.Err() == nil {
		c.log.Warn().Err(err).Msg("make pending rows with a NULL available_at due")
	} else if n > 0 {
		c.log.Info().Int64("rows", n).Msg("pending rows had a NULL available_at: made them due now")
		c.Kick()
	}
	if err := c.measureStuck(ctx); err != nil && ctx.Err() == nil {
		c.log.Warn().Err(err).Msg("measure rows pending longer than sweep_after")
	}
}

// measureStuck updates StuckRows and OldestUnclaimedAge and warns, at most
// once a minute, while there are such rows, saying what they wait for
// (stuckAdvice). The warning waits until the source has run for
// SweepAfter: rows already pending that long when the relay attached (a
// backlog written while it was down) are the stream's to deliver first,
// and a clean start warns about nothing.
func (c *Source) measureStuck(ctx context.Context) error {
	// The engine's view first: a row settled after it and before the scan
	// is still counted in flight, never as one the stream passed.
	view := c.cfg.Engine.StreamView()
	rows, err := c.cfg.Store.StuckRows(ctx, c.cfg.SweepAfter)
	if err != nil {
		return err
	}
	var age time.Duration
	if len(rows) > 0 {
		age = time.Since(rows[0].Due)
	}
	count := int64(len(rows))
	c.stuckRows.Store(count)
	c.oldestStuck.Store(int64(age))
	if count > 0 && time.Since(c.started) >= c.cfg.SweepAfter && time.Since(c.lastAlarm) >= alarmEvery {
		c.lastAlarm = time.Now()
		l := c.log.Warn().Int64("rows", count).Dur("oldest_age", age.Round(time.Second)).Dur("sweep_after", c.cfg.SweepAfter)
		if c.cfg.All {
			l.Msg("rows pending longer than sweep_after: the claim path is not keeping up or its sinks are failing")
		} else {
			w := classifyStuck(view, rows)
			l.Int("in_flight", w.inFlight).Int("not_received", w.notReceived).Int("catching_up", w.catchingUp).
				Int("never_streamed", w.neverStreamed).Strs("sinks_down", view.SinksDown).
				Msg("rows pending longer than sweep_after: " + w.advice(view, time.Now()))
		}
	}
	return nil
}

// stuckWait counts stuck rows by what they wait for.
type stuckWait struct {
	// inFlight: in the engine's lanes, waiting for their sinks.
	inFlight int
	// notReceived: committed after the stream's session began and not
	// received yet: the stream is behind them (back-pressure from the
	// sinks holds it), or no session has begun.
	notReceived int
	// catchingUp: committed before the session began, which the stream
	// has not decoded past yet.
	catchingUp int
	// neverStreamed: committed before the session began, which the stream
	// has decoded past, and not in flight: the slot was made after them
	// (dropped and made again while the relay was down). Only reconcile
	// diverts them to the claim path.
	neverStreamed int
}

func classifyStuck(v relay.StreamView, rows []relay.StuckRow) stuckWait {
	var w stuckWait
	for _, r := range rows {
		switch {
		case v.InFlight[r.ID]:
			w.inFlight++
		case v.Started.IsZero() || !r.Due.Before(v.Started):
			w.notReceived++
		case !v.CaughtUp:
			w.catchingUp++
		default:
			w.neverStreamed++
		}
	}
	return w
}

// advice says what the rows wait for and what to do, the reconcile advice
// only for rows the stream never saw.
func (w stuckWait) advice(v relay.StreamView, now time.Time) string {
	var parts []string
	if w.neverStreamed > 0 {
		since := now.Sub(v.Started).Truncate(time.Minute) + time.Minute
		parts = append(parts, fmt.Sprintf("%d were committed before the stream's session began, which it has decoded past without them: "+
			"the slot was made after them (dropped and made again while the relay was down?); "+
			"run outbox-relay reconcile --older-than %s to hand them to the claim path", w.neverStreamed, since))
	}
	if w.inFlight > 0 {
		sinks := "their sinks are slow or failing"
		if len(v.SinksDown) > 0 {
			sinks = "sinks down: " + strings.Join(v.SinksDown, ", ")
		}
		parts = append(parts, fmt.Sprintf("%d are in flight in the lanes, waiting for their sinks (%s); they clear as the sinks answer", w.inFlight, sinks))
	}
	if w.notReceived > 0 {
		what := "the stream has not received them yet: it is behind them (full lanes slow it: each event waits up to delivery.lane_block_max for room, then goes to the claim path; or the walsender is still decoding); they clear as it catches up"
		if v.Started.IsZero() {
			what = "no stream session has begun on this relay yet: they wait for the stream (its log says why it does not stream)"
		}
		parts = append(parts, fmt.Sprintf("%d %s", w.notReceived, what))
	}
	if w.catchingUp > 0 {
		parts = append(parts, fmt.Sprintf("%d were committed before the stream's session began, and the stream is still catching up on the WAL before it", w.catchingUp))
	}
	return strings.Join(parts, "; ")
}

// keepOwner checks the owner-lock connection every second until ctx is
// done, then releases it. A failed check means the lock went with its
// session: other claimers may now return this owner's rows and send them.
// keepOwner then releases what is left of it and returns an error wrapping
// relay.ErrLeaseLost; the claim path stops, and the phase halts the engine
// and starts again with the lock taken afresh.
func (c *Source) keepOwner(ctx context.Context, lock relay.Lock) error {
	defer lock.Release()
	tick := time.NewTicker(ownerPingEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		err := lock.Ping(ctx)
		if err == nil || ctx.Err() != nil {
			continue
		}
		c.ownerHeld.Store(false)
		c.log.Error().Err(err).Str("owner", c.cfg.Owner).
			Msg("lost the owner-lock connection: delivery of the claim path stops (other relays may return this owner's rows)")
		return fmt.Errorf("owner lock of %s: %w: %v", c.cfg.Owner, relay.ErrLeaseLost, err)
	}
}

// listen LISTENs on Config.Notify and kicks the claim loop on every
// notification, until ctx is done. A failed connection is reopened with
// backoff; each (re)start kicks once, for notifications missed meanwhile.
func (c *Source) listen(ctx context.Context) {
	for attempt := 1; ; attempt++ {
		started := time.Now()
		err := c.cfg.Store.Listen(ctx, c.cfg.Notify, c.Kick)
		if ctx.Err() != nil {
			return
		}
		if time.Since(started) > time.Minute {
			attempt = 1
		}
		wait := min(relay.RetryDelay(attempt), 30*time.Second)
		c.log.Warn().Err(err).Str("channel", c.cfg.Notify).Dur("retry_in", wait).
			Msg("LISTEN connection failed; polling every poll_interval until it is back")
		if !relay.Sleep(ctx, wait) {
			return
		}
	}
}

func orUnknown(owner string) string {
	if owner == "" {
		return "unknown owner"
	}
	return owner
}
