// Package claim is the claim path's source (docs/architecture.md): the
// durable path that delivers the rows the stream diverted, the rows
// marked when a slot was created, and — in poll mode — every due pending
// row.
//
// A Source loops: claim a batch of due rows — runs of each aggregate's
// next rows in id order (docs/guarantees.md, "Claim runs") — with one
// `… FOR UPDATE SKIP LOCKED) UPDATE … RETURNING` (the store's Claim) and
// hand it to the delivery core (relay.Engine), which sends each run's rows
// one after another in the aggregate's lane, and which
// claims each (event, sink) pair in the ledger before sending, sends, and
// settles the rows through the same policy as the stream's events. The
// Source claims again at once after a full batch, and otherwise after
// PollInterval, or sooner when a settlement, a NOTIFY or Kick wakes it.
// While the stream lags, it yields to it: a full claim at most once a
// second, and in between only the aggregates with recent rows (claimLoop).
//
// # Owners
//
// Every Source has an owner id (ledger.NewOwner) and holds a session
// advisory lock for it on a dedicated connection (the store's LockOwner)
// for its lifetime, and until the engine has settled every row it claimed.
// An owner is "gone" when that lock is free: its process died, or its
// connection did. A processing row whose owner is gone, or whose lease
// (LockTimeout) passed, goes back to pending (the sweeper); a 'sending'
// ledger claim in that state may be taken over, which counts as an unknown
// outcome. The engine renews the leases of the rows it is still delivering,
// so a slow delivery is never taken over. A legacy poller (mode: poll)
// holds no such lock, so its rows are taken back only when their lease
// passes. Age alone never moves a row that is not the claim path's.
package claim

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Store is what the claim source needs from the database besides what the
// engine writes through relay.ClaimStore.
type Store interface {
	relay.ClaimStore
	// ReleaseOwned returns to pending the rows processing under owner (it
	// has nothing in flight when it calls it).
	ReleaseOwned(ctx context.Context, owner string) (int64, error)
	// LockOwner takes owner's lock on a dedicated connection; an error
	// wrapping relay.ErrLockTaken means another live session holds it.
	LockOwner(ctx context.Context, owner string) (relay.Lock, error)
	// ExpireLeases returns to pending the processing rows whose lease
	// passed or whose relay owner is gone.
	ExpireLeases(ctx context.Context, lease time.Duration) ([]relay.Lease, error)
	// RepairDue makes pending rows with a NULL available_at due now.
	RepairDue(ctx context.Context) (int64, error)
	// StuckRows returns the rows pending and not the claim path's, due
	// longer than after ago, oldest first.
	StuckRows(ctx context.Context, after time.Duration) ([]relay.StuckRow, error)
	// Listen calls notified for every NOTIFY on channel until ctx ends or
	// the connection fails.
	Listen(ctx context.Context, channel string, notified func()) error
}

// Config configures a Source. Zero values take the defaults in brackets.
type Config struct {
	Engine *relay.Engine
	Store  Store
	// All claims every due pending row (poll mode); otherwise only rows
	// diverted to the claim path (handoff_at IS NOT NULL).
	All bool
	// BatchSize is the most rows one claim takes [500].
	BatchSize int
	// PollInterval is the wait after a claim that was not full [1s]; a
	// settlement, a NOTIFY or Kick ends it early.
	PollInterval time.Duration
	// LockTimeout is the lease on processing rows and 'sending' ledger
	// claims [5m].
	LockTimeout time.Duration
	// SweepAfter raises the alarm for rows pending (and not the claim
	// path's) this long after they were due [30s].
	SweepAfter time.Duration
	// Owner names this relay in locked_by and in ledger claims; the
	// engine's owner.
	Owner string
	// Notify is a channel to LISTEN on; a notification wakes the claim
	// loop. Empty: no LISTEN.
	Notify string
	Logger zerolog.Logger
}

// Stats counts the claim source's work; safe to read concurrently. The
// engine counts deliveries and outcomes.
type Stats struct {
	// Claimed counts rows claimed.
	Claimed atomic.Int64
	// TakenOver counts expired or orphaned leases the sweeper reset.
	TakenOver atomic.Int64
	// Yielded counts the claims limited to recent rows because the stream
	// lagged.
	Yielded atomic.Int64
}

// Source runs the claim path. Create it with New and call Run once.
type Source struct {
	cfg       Config
	log       zerolog.Logger
	wake      chan struct{}
	ownerHeld atomic.Bool

	stuckRows   atomic.Int64
	oldestStuck atomic.Int64 // nanoseconds
	lastAlarm   time.Time    // sweeper goroutine only
	started     time.Time    // set by Run before the sweeper starts

	// Stats are the claim source's counters.
	Stats Stats
}

// New validates cfg and returns a Source. It does not connect.
func New(cfg Config) (*Source, error) {
	switch {
	case cfg.Engine == nil:
		return nil, errors.New("claim path: no engine")
	case cfg.Store == nil:
		return nil, errors.New("claim path: no store")
	case cfg.Owner == "":
		return nil, errors.New("claim path: no owner")
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 500
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = time.Second
	}
	if cfg.LockTimeout <= 0 {
		cfg.LockTimeout = 5 * time.Minute
	}
	if cfg.SweepAfter <= 0 {
		cfg.SweepAfter = 30 * time.Second
	}
	if cfg.Notify != "" {
		if err := relay.ValidateIdentifier(cfg.Notify); err != nil {
			return nil, fmt.Errorf("claim path: notify channel: %w", err)
		}
	}
	c := &Source{cfg: cfg, log: cfg.Logger.With().Str("path", "claim").Logger(), wake: make(chan struct{}, 1)}
	cfg.Engine.OnClaimSettled(c.Kick)
	return c, nil
}

// Kick wakes the claim loop now instead of at the end of its poll interval.
// It never blocks; safe to call from any goroutine, before or during Run.
func (c *Source) Kick() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// OldestUnclaimedAge is the age, at the last sweep, of the oldest row that
// is pending, not the claim path's, and was due more than SweepAfter ago;
// 0 when there is none.
func (c *Source) OldestUnclaimedAge() time.Duration { return time.Duration(c.oldestStuck.Load()) }

// StuckRows is how many rows OldestUnclaimedAge looked at.
func (c *Source) StuckRows() int64 { return c.stuckRows.Load() }

// Run takes the owner lock, then claims batches and hands them to the
// engine until ctx is done. Beside the loop it runs, in a relay.Group, the
// lease sweeper (every 5 × PollInterval, at least 1 s), the owner-lock
// keeper and, with Notify, the listener. When ctx is done it claims
// nothing new and holds the owner lock until every row it claimed is
// settled or the engine has stopped — the phase that owns both drains the
// engine, halts and stops it — so that no row it claimed is taken over by
// another relay while it may still be sent; then it stops its helpers,
// releases the lock and returns nil.
//
// The owner lock is the claim path's lease: when its connection is lost,
// other relays may return this owner's rows and send them. Run then stops
// claiming and returns an error wrapping relay.ErrLeaseLost, on which the
// phase halts the engine at once (docs/operations-health.md, "a lost
// lock"). It returns an error too when it cannot start: the owner lock
// cannot be taken (database unreachable, or another live session holds
// the same owner). Other database errors while running are logged and
// retried. Run is not safe to call twice.
func (c *Source) Run(ctx context.Context) error {
	lock, err := c.cfg.Store.LockOwner(ctx, c.cfg.Owner)
	if err != nil {
		return fmt.Errorf("claim path: %w", err)
	}
	c.ownerHeld.Store(true)
	c.started = time.Now()
	if n, err := c.cfg.Store.ReleaseOwned(ctx, c.cfg.Owner); err != nil {
		// A stop meanwhile (the term ended) is no failure: the next
		// term, or the lease, returns the rows.
		if ctx.Err() == nil {
			c.log.Warn().Err(err).Msg("return rows this relay left claimed; their lease returns them")
		}
	} else if n > 0 {
		c.log.Info().Int64("rows", n).Msg("returned rows this relay had claimed and not settled to pending")
	}
	c.log.Info().Str("owner", c.cfg.Owner).Bool("all_due_rows", c.cfg.All).Msg("claim path running")

	helpers, helpersCtx := relay.NewGroup(relay.Detached(ctx, "the owner lock is held while the rows claimed may still be sent: until they are settled or the engine has stopped; helpers.Stop ends them"))
	defer helpers.Stop()
	helpers.Go("owner lock", func(ctx context.Context) error { return c.keepOwner(ctx, lock) })
	helpers.Go("lease sweeper", func(ctx context.Context) error { c.sweepLoop(ctx); return nil })
	if c.cfg.Notify != "" {
		helpers.Go("listener", func(ctx context.Context) error { c.listen(ctx); return nil })
	}
	claimCtx, stopClaiming := context.WithCancel(ctx)
	defer stopClaiming()
	// A helper's failure (a lost owner lock) stops the claims at once.
	// AfterFunc forwards it, not a worker: stopClaiming only cancels.
	stopOnFailure := context.AfterFunc(helpersCtx, stopClaiming)
	defer stopOnFailure()
	c.claimLoop(claimCtx)

	if err := helpers.Failed(); err == nil {
		if err := c.cfg.Engine.WaitPathSettled(helpersCtx, relay.PathClaim); err != nil && !errors.Is(err, relay.ErrEngineStopped) && helpers.Failed() == nil {
			c.log.Warn().Err(err).Msg("claimed rows still unsettled when stopping; the sweeper of the next owner returns them")
		}
	}
	if err := helpers.Stop(); err != nil {
		return fmt.Errorf("claim path: %w", err)
	}
	c.log.Info().Msg("claim path stopped")
	return nil
}

// The claim path yields to a lagging stream (docs/architecture.md, "The
// claim path yields to a lagging stream"): in replication mode, while the
// walsender's last reported lag is at least yieldLag and was reported
// within yieldFresh, the claim path makes a full claim at most once per
// yieldEvery; in between, every yieldPoll (or sooner when a settlement
// wakes it), it claims only runs of aggregates with rows due within
// yieldRecent: the fresh events the stream diverted to it.
const (
	yieldLag    = 250 * time.Millisecond
	yieldFresh  = time.Second
	yieldEvery  = time.Second
	yieldRecent = 10 * time.Second
	yieldPoll   = 100 * time.Millisecond
)

// streamLags reports whether the claim path yields to the stream now.
func (c *Source) streamLags() bool {
	if c.cfg.All {
		return false // poll mode: no stream
	}
	lag, at := c.cfg.Engine.StreamLag()
	return lag >= yieldLag && time.Since(at) <= yieldFresh
}

// claimLoop claims batches until ctx is done.
func (c *Source) claimLoop(ctx context.Context) {
	failures := 0
	var lastFull time.Time
	for ctx.Err() == nil {
		again := false
		wait := c.cfg.PollInterval
		if c.ownerHeld.Load() {
			// A claim's rows wait in memory for the engine's room: their
			// bytes are bounded as well as their count (docs/performance.md,
			// "Memory").
			q := relay.ClaimQuery{All: c.cfg.All, Limit: c.cfg.BatchSize, MaxBytes: c.cfg.Engine.ReadBytes(), Owner: c.cfg.Owner}
			if time.Since(lastFull) < yieldEvery && c.streamLags() {
				q.DueSince = time.Now().Add(-yieldRecent)
				wait = min(wait, yieldPoll)
				c.Stats.Yielded.Add(1)
			} else {
				lastFull = time.Now()
			}
			full, err := c.claimBatch(ctx, q)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				failures++
				delay := relay.RetryDelay(failures)
				c.log.Warn().Err(err).Dur("retry_in", delay).Msg("claim a batch; retrying")
				if !relay.Sleep(ctx, delay) {
					return
				}
				continue
			}
			failures = 0
			again = full
		}
		if again {
			continue
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-c.wake:
			timer.Stop()
		case <-timer.C:
		}
	}
}

// claimBatch claims one batch and hands it to the engine, and reports
// whether the batch was full (relay.ClaimQuery.Full). Rows the engine does
// not take (ctx ended, the ledger claims failed) are put back.
func (c *Source) claimBatch(ctx context.Context, q relay.ClaimQuery) (full bool, err error) {
	works, err := c.cfg.Store.Claim(ctx, q)
	if err != nil || len(works) == 0 {
		return false, err
	}
	c.Stats.Claimed.Add(int64(len(works)))
	full = q.Full(works)
	notTaken, err := c.cfg.Engine.SubmitClaimed(ctx, works)
	if err != nil {
		c.putBack(ctx, notTaken)
		return full, err
	}
	return full, nil
}

// putBack returns claimed rows the engine did not take to pending, due
// again shortly, without counting an attempt. A row it cannot put back
// stays processing until the sweeper finds its lease passed or its owner
// gone.
func (c *Source) putBack(ctx context.Context, works []*relay.Work) {
	if len(works) == 0 {
		return
	}
	at := time.Now().Add(relay.RetryDelay(1))
	for _, w := range works {
		for _, p := range w.Pairs {
			p.Outcome = relay.Outcome{Kind: relay.Deferred}
		}
		w.Decision = relay.Decision{Kind: relay.Later, At: at, Attempts: w.Event.Attempts}
	}
	wctx, cancel := context.WithTimeout(relay.Detached(ctx, "rows the engine did not take are put back after ctx ended; bounded by the timeout"), 30*time.Second)
	defer cancel()
	if _, err := c.cfg.Store.SettleClaim(wctx, works, c.cfg.Owner); err != nil {
		c.log.Warn().Err(err).Int("rows", len(works)).Msg("put claimed rows back; the sweeper returns them when their lease passes")
	}
}
