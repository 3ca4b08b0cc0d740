// Package claim is the claim path (SPEC §2, §3): the durable path that
// delivers the rows the stream handed off (handoff_at set), the rows marked
// when a slot was created, and — in poll mode — every due pending row.
//
// A Claimer loops: claim a batch of due rows with one
// `WITH locked AS (SELECT … FOR UPDATE SKIP LOCKED) UPDATE … RETURNING`,
// deliver them concurrently (rows of one batch belong to distinct
// aggregates), and settle the batch in one transaction. The idempotency
// ledger makes each (event, sink) side effect happen once: a pair is
// claimed ('sending', with an owner and a lease) before it is sent, and
// pairs already 'delivered' are skipped.
//
// # Owners
//
// Every Claimer has an owner id (Config.Owner, made by NewOwner) and holds a
// session advisory lock for it on a dedicated connection for its lifetime:
//
//	pg_advisory_lock(1868724338, hashtext(owner))   -- 1868724338 = 0x6f627872, "obxr"
//
// which pg_locks shows as locktype 'advisory', classid 1868724338, objid
// hashtext(owner)::oid, objsubid 2, in the outbox's database. An owner is
// "gone" when that lock is free: its process died, or its connection did
// (the connection uses TCP keepalives, idle 5 s, interval 2 s, count 3, on
// both ends). A 'processing' row whose owner is gone, or whose lease
// (LockTimeout) passed, goes back to pending; a 'sending' ledger claim in
// that state may be taken over, which counts as an unknown outcome. Only
// owners that start with OwnerPrefix lose rows because their lock is free:
// a legacy poller (mode: poll) holds no such lock, so its rows are taken
// back only when their lease passes. Age alone never moves a row that is
// not the claim path's (see OldestUnclaimedAge).
package claim

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// OwnerPrefix starts every relay owner id (NewOwner). The lease sweeper
// treats a row locked by an owner with this prefix whose owner lock is free
// as abandoned at once; rows locked by anyone else (a legacy poller) only
// after LockTimeout.
const OwnerPrefix = "outbox-relay:"

// NewOwner returns a fresh owner id, "outbox-relay:<host>:<pid>:<random>".
// The engine and the Claimer of one process should share it: the Claimer's
// owner lock then covers the engine's ledger claims too.
func NewOwner() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s%s:%d:%08x", OwnerPrefix, host, os.Getpid(), rand.Uint32())
}

// Config configures a Claimer. Zero values take the defaults in brackets.
type Config struct {
	// Pool serves the claim, delivery and settlement statements. The
	// owner lock and LISTEN use dedicated connections made from its
	// connection config.
	Pool *pgxpool.Pool
	// Outbox and Ledger are the tables migrate created or adopted
	// [integration_outbox, integration_idempotency].
	Outbox, Ledger relay.QualifiedName
	// Routes are the sinks, the same as the engine's: Events globs
	// (path.Match; a NULL event_type matches only "*"), Nudge and Hold.
	Routes []relay.Route
	// All claims every due pending row (poll mode); otherwise only rows
	// handed to the claim path (handoff_at IS NOT NULL).
	All bool
	// Unordered turns off per-aggregate ordering (ordering: none).
	Unordered bool
	// BatchSize is the most rows one claim takes [500].
	BatchSize int
	// PollInterval is the wait after a claim that was not full [1s]; a
	// NOTIFY or Kick ends it early.
	PollInterval time.Duration
	// LockTimeout is the lease on processing rows and 'sending' ledger
	// claims [5m].
	LockTimeout time.Duration
	// MaxAttempts fails a row once this many counted attempts failed [10].
	MaxAttempts int
	// Backoff is the delay after n attempts, Backoff[n-1] (the last entry
	// repeats), plus 0–10% jitter [1s 5s 30s 2m 5m 15m 30m 1h].
	Backoff []time.Duration
	// SweepAfter raises the alarm for rows pending (and not the claim
	// path's) this long after they were due [30s].
	SweepAfter time.Duration
	// Owner names this instance in locked_by and in ledger claims; it must
	// start with OwnerPrefix [NewOwner()].
	Owner string
	// Notify is a channel to LISTEN on; a notification wakes the claim
	// loop. Empty: no LISTEN.
	Notify string
	// OnAggregateSettled is called (engine.Undiverted) for an aggregate
	// whose last handed-off or held row the claim path settled, with the
	// DivertSeq value read before the table was checked. Optional.
	OnAggregateSettled func(a relay.AggregateKey, seq uint64)
	// DivertSeq is engine.DivertSeq. Optional.
	DivertSeq func() uint64
	Logger    zerolog.Logger
}

// Stats counts the claim path's work; safe to read concurrently.
type Stats struct {
	// Claimed counts rows claimed.
	Claimed atomic.Int64
	// Delivered counts (row, sink) pairs delivered.
	Delivered atomic.Int64
	// Retried counts rows put back to pending after a counted attempt.
	Retried atomic.Int64
	// Failed counts rows dead-lettered (permanent error or max_attempts).
	Failed atomic.Int64
	// Held counts rows held for a person (unknown outcome, hold sink).
	Held atomic.Int64
	// TakenOver counts expired or orphaned leases the sweeper reset plus
	// 'sending' ledger claims taken over.
	TakenOver atomic.Int64
}

// Claimer runs the claim path. Create it with New and call Run once.
type Claimer struct {
	cfg    Config
	log    zerolog.Logger
	sql    statements
	routes []*route

	// The routing arrays of the ordering check, one entry per sink.
	sinkNames []string
	sinkEvery []bool
	sinkRegex []*string

	wake      chan struct{}
	ownerHeld atomic.Bool
	// claimSQL is the claim query Run chose for the table's shape.
	claimSQL string

	stuckRows   atomic.Int64
	oldestStuck atomic.Int64 // nanoseconds
	lastAlarm   time.Time    // sweeper goroutine only

	// Stats are the claim path's counters.
	Stats Stats
}

// route is one sink and its circuit.
type route struct {
	relay.Route
	name string

	mu        sync.Mutex
	openUntil time.Time
	downCount int
}

// New validates cfg and returns a Claimer. It does not connect.
func New(cfg Config) (*Claimer, error) {
	if cfg.Pool == nil {
		return nil, errors.New("claim path: no connection pool")
	}
	def := migrations.DefaultNames()
	if cfg.Outbox.Name == "" {
		cfg.Outbox = def.Outbox
	}
	if cfg.Ledger.Name == "" {
		cfg.Ledger = def.Ledger
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
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 10
	}
	if len(cfg.Backoff) == 0 {
		cfg.Backoff = []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 2 * time.Minute,
			5 * time.Minute, 15 * time.Minute, 30 * time.Minute, time.Hour}
	}
	if cfg.SweepAfter <= 0 {
		cfg.SweepAfter = 30 * time.Second
	}
	if cfg.Owner == "" {
		cfg.Owner = NewOwner()
	}
	if !strings.HasPrefix(cfg.Owner, OwnerPrefix) || cfg.Owner == OwnerPrefix || !utf8.ValidString(cfg.Owner) {
		return nil, fmt.Errorf("claim path: owner %q must start with %q (NewOwner makes one): the sweeper recognises relay owners by it", cfg.Owner, OwnerPrefix)
	}
	if cfg.Notify != "" {
		if err := relay.ValidateIdentifier(cfg.Notify); err != nil {
			return nil, fmt.Errorf("claim path: notify channel: %w", err)
		}
	}

	c := &Claimer{
		cfg:  cfg,
		log:  cfg.Logger.With().Str("component", "claim").Logger(),
		sql:  render(cfg.Outbox.Quoted(), cfg.Ledger.Quoted(), cfg.All, cfg.Unordered),
		wake: make(chan struct{}, 1),
	}
	names := map[string]bool{}
	for _, r := range cfg.Routes {
		if r.Sink == nil {
			return nil, errors.New("claim path: a route has no sink")
		}
		name := r.Sink.Name()
		if names[name] {
			return nil, fmt.Errorf("claim path: two sinks named %q", name)
		}
		names[name] = true
		filter, err := newSinkFilter(r.Events)
		if err != nil {
			return nil, fmt.Errorf("claim path: sink %s: %w", name, err)
		}
		c.routes = append(c.routes, &route{Route: r, name: name})
		c.sinkNames = append(c.sinkNames, name)
		c.sinkEvery = append(c.sinkEvery, filter.everyType)
		c.sinkRegex = append(c.sinkRegex, filter.regex)
	}
	return c, nil
}

// Owner returns the owner id the Claimer writes in locked_by and in the
// ledger.
func (c *Claimer) Owner() string { return c.cfg.Owner }

// Kick wakes the claim loop now instead of at the end of its poll interval.
// It never blocks; safe to call from any goroutine, before or during Run.
func (c *Claimer) Kick() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// OldestUnclaimedAge is the age, at the last sweep, of the oldest row that
// is pending, not the claim path's, and was due more than SweepAfter ago;
// 0 when there is none.
func (c *Claimer) OldestUnclaimedAge() time.Duration {
	return time.Duration(c.oldestStuck.Load())
}

// StuckRows is how many rows OldestUnclaimedAge looked at.
func (c *Claimer) StuckRows() int64 { return c.stuckRows.Load() }

// Run takes the owner lock, then claims, delivers and settles batches until
// ctx is done: after a full batch it claims again at once; otherwise it
// waits PollInterval, or less when Kick or a NOTIFY wakes it. Beside the
// loop it runs the lease sweeper (every 5 × PollInterval, at least 1 s),
// the owner-lock keeper and, with Notify, the listener; it stops them
// before returning.
//
// When ctx is done Run sends nothing new, waits for deliveries in flight,
// settles them on a fresh context and releases the owner lock; it returns
// nil. It returns an error only when it cannot start: the outbox table
// cannot be inspected, or the owner lock cannot be taken (database
// unreachable, or another live session holds the same owner). Database errors while running are logged and retried, with
// claiming paused while the owner lock is lost. Run is not safe to call
// twice.
func (c *Claimer) Run(ctx context.Context) error {
	var replays bool
	if err := c.cfg.Pool.QueryRow(ctx, c.sql.hasReplays, c.cfg.Outbox.Quoted()).Scan(&replays); err != nil {
		return fmt.Errorf("claim path: inspect %s: %w", c.cfg.Outbox, err)
	}
	c.claimSQL = c.sql.claim
	if replays {
		c.claimSQL = c.sql.claimReplays
	}
	conn, err := c.lockOwner(ctx)
	if err != nil {
		return err
	}
	c.ownerHeld.Store(true)
	c.log.Info().Str("owner", c.cfg.Owner).Bool("all_due_rows", c.cfg.All).Str("outbox", c.cfg.Outbox.String()).
		Msg("claim path running")

	// The helpers outlive ctx until the last batch is settled: the owner
	// lock must be held while our rows are still 'processing'.
	helpers, stopHelpers := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { c.keepOwner(helpers, conn) })
	wg.Go(func() { c.sweepLoop(helpers) })
	if c.cfg.Notify != "" {
		wg.Go(func() { c.listen(helpers) })
	}
	c.claimLoop(ctx)
	stopHelpers()
	wg.Wait()
	c.log.Info().Msg("claim path stopped")
	return nil
}

// claimLoop runs batches until ctx is done.
func (c *Claimer) claimLoop(ctx context.Context) {
	failures := 0
	for ctx.Err() == nil {
		again := false
		if c.ownerHeld.Load() {
			n, err := c.runBatch(ctx)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				failures++
				wait := retryDelay(failures)
				c.log.Warn().Err(err).Dur("retry_in", wait).Msg("claim a batch; retrying")
				if !sleep(ctx, wait) {
					return
				}
				continue
			}
			failures = 0
			// A batch that settled anything may have unblocked the next
			// event of each aggregate it touched: claim again at once, and
			// sleep only after a claim that found nothing due.
			again = n > 0
		}
		if again {
			continue
		}
		timer := time.NewTimer(c.cfg.PollInterval)
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

// backoff returns the delay after attempts counted attempts, with 0–10%
// jitter.
func (c *Claimer) backoff(attempts int) time.Duration {
	b := c.cfg.Backoff
	d := b[min(max(attempts-1, 0), len(b)-1)]
	return d + rand.N(d/10+1)
}

// retryDelay is the backoff for the claim path's own database retries:
// 100 ms doubling to 6.4 s, plus up to 25%.
func retryDelay(attempt int) time.Duration {
	d := 100 * time.Millisecond << min(max(attempt-1, 0), 6)
	return d + rand.N(d/4+1)
}

// sleep waits d or until ctx is done; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
