package ledger

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The claim path's upkeep: leases, NULL due times, the stuck-rows alarm, the
// owner lock and the NOTIFY wake-up. The claim source (relay/claim) runs
// them on timers.

// ExpireLeases returns to pending the processing rows whose lease passed,
// or whose relay owner (locked_by starting with OwnerPrefix) holds no owner
// lock, keeping their attempts. Their ledger claims are taken over when the
// rows are claimed again. Safe to run concurrently from every relay.
func (s *Store) ExpireLeases(ctx context.Context, lease time.Duration) ([]relay.Lease, error) {
	rows, err := s.pool.Query(ctx, s.sql.claim.expireLeases, lease.Milliseconds(), OwnerPrefix)
	if err != nil {
		return nil, fmt.Errorf("return expired leases: %w", err)
	}
	var (
		out   []relay.Lease
		id    int64
		owner pgtype.Text
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &owner}, func() error {
		out = append(out, relay.Lease{ID: id, OldOwner: owner.String})
		return nil
	})
	if err != nil {
		return out, fmt.Errorf("return expired leases: %w", err)
	}
	return out, nil
}

// RepairDue makes pending rows with a NULL available_at (the column is
// nullable) due now, and returns how many it changed: the claim query
// orders by available_at and would never reach them.
func (s *Store) RepairDue(ctx context.Context) (int64, error) {
	tag, err := s.pool.Exec(ctx, s.sql.claim.repairDue)
	if err != nil {
		return 0, fmt.Errorf("make rows with a NULL available_at due: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Stuck counts the rows pending, not the claim path's, and due longer than
// after ago, and returns the age of the oldest. It never
// claims them: only a diversion, the slot hand-over or `outbox-relay
// reconcile` makes a row the claim path's. It reads the pending scan's
// watch list (scan.go), so its cost follows the write rate.
func (s *Store) Stuck(ctx context.Context, after time.Duration) (rows int64, oldest time.Duration, err error) {
	stuck, err := s.StuckRows(ctx, after)
	if err != nil {
		return 0, 0, err
	}
	if len(stuck) > 0 {
		oldest = time.Since(stuck[0].Due)
	}
	return int64(len(stuck)), oldest, nil
}

// StuckRows returns the rows Stuck counts, oldest first.
func (s *Store) StuckRows(ctx context.Context, after time.Duration) ([]relay.StuckRow, error) {
	watch, err := s.scanPending(ctx)
	if err != nil {
		return nil, fmt.Errorf("measure rows pending longer than %s: %w", after, err)
	}
	var out []relay.StuckRow
	now := time.Now()
	for _, w := range watch { // oldest first
		if now.Sub(w.due) > after {
			out = append(out, relay.StuckRow{ID: w.id, Due: w.due})
		}
	}
	return out, nil
}

// pingTimeout bounds one check of a dedicated connection; one that does
// not answer is taken as lost, and with it its lock.
const pingTimeout = 3 * time.Second

// dedicatedConfig is cfg for a connection of its own (not from the pool)
// with TCP keepalives on both ends, named purpose in pg_stat_activity
// unless the configuration names it.
func dedicatedConfig(cfg *pgx.ConnConfig, purpose string) *pgx.ConnConfig {
	cc := cfg.Copy()
	if cc.RuntimeParams == nil {
		cc.RuntimeParams = map[string]string{}
	}
	if cc.RuntimeParams["application_name"] == "" {
		cc.RuntimeParams["application_name"] = "outbox-relay " + purpose
	}
	// The server's side of the keepalive: it ends the session, and frees
	// its locks, soon after this host disappears.
	cc.RuntimeParams["tcp_keepalives_idle"] = fmt.Sprint(relay.KeepaliveIdle.Seconds())
	cc.RuntimeParams["tcp_keepalives_interval"] = fmt.Sprint(relay.KeepaliveInterval.Seconds())
	cc.RuntimeParams["tcp_keepalives_count"] = fmt.Sprint(relay.KeepaliveCount)
	cc.DialFunc = relay.Dial
	if cc.ConnectTimeout == 0 {
		cc.ConnectTimeout = relay.ConnectTimeout
	}
	return cc
}

// ownerLock is a held owner lock: the session advisory lock
// pg_advisory_lock(OwnerLockClass, hashtext(owner)) on a dedicated
// connection. While it is held, other relays leave the owner's rows and
// ledger claims alone until their lease passes.
type ownerLock struct {
	s     *Store
	owner string
	conn  *pgx.Conn
	pid   uint32
}

// LockOwner opens a dedicated connection and takes the owner lock on it.
// It returns an error wrapping relay.ErrLockTaken when another session holds
// it (or the lock of an id with the same hash).
func (s *Store) LockOwner(ctx context.Context, owner string) (relay.Lock, error) {
	conn, err := pgx.ConnectConfig(ctx, dedicatedConfig(s.pool.Config().ConnConfig, "owner lock"))
	if err != nil {
		return nil, fmt.Errorf("connect for the owner lock: %w", err)
	}
	// Once sent, the query runs to its answer even if ctx ends: a query cut
	// short leaves pgx closing the session in the background, holding the
	// lock if the server granted it, and the owner's next attempt would
	// find it taken.
	lockCtx, cancel := context.WithTimeout(relay.Detached(ctx, "a lock query cut short would leave its session holding the lock; bounded by pingTimeout"), pingTimeout)
	defer cancel()
	var locked bool
	if err := conn.QueryRow(lockCtx, s.sql.claim.lockOwner, owner).Scan(&locked); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("take the owner lock of %s: %w", owner, err)
	}
	if !locked {
		// A session of this process that it lost may still hold it.
		ended, err := fenceStaleHolder(lockCtx, conn, catalog.Get("OwnerLockHolder"), []any{owner}, 0, zerolog.Nop())
		if err == nil && ended {
			err = conn.QueryRow(lockCtx, s.sql.claim.lockOwner, owner).Scan(&locked)
		}
		if err != nil || !locked {
			conn.Close(context.Background())
			return nil, fmt.Errorf("owner %s: %w", owner, relay.ErrLockTaken)
		}
	}
	return &ownerLock{s: s, owner: owner, conn: conn, pid: conn.PgConn().PID()}, nil
}

// Ping checks that the lock's connection is alive (and with it the lock).
func (l *ownerLock) Ping(ctx context.Context) error {
	pctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	err := l.conn.Ping(pctx)
	if err != nil && ctx.Err() == nil {
		lostSession(l.pid)
	}
	return err
}

// Release unlocks and closes the connection. Safe to call once. When the
// unlock gets no answer, the close may not reach the server either (a
// network that swallows packets), whose session then keeps the lock: it is
// remembered as lost, so this process's next LockOwner ends it
// (TestOwnerLockReleasedIntoABlackHoleIsTakenAgain).
func (l *ownerLock) Release() {
	ctx, cancel := context.WithTimeout(context.Background(), pingTimeout)
	defer cancel()
	if _, err := l.conn.Exec(ctx, l.s.sql.claim.unlockOwner, l.owner); err != nil {
		lostSession(l.pid)
	}
	l.conn.Close(ctx)
}

// Listen LISTENs on channel on a dedicated connection and calls notified for
// every notification, until ctx ends or the connection fails; it calls
// notified once when it starts listening (for notifications missed before).
func (s *Store) Listen(ctx context.Context, channel string, notified func()) error {
	conn, err := pgx.ConnectConfig(ctx, dedicatedConfig(s.pool.Config().ConnConfig, "listen"))
	if err != nil {
		return fmt.Errorf("connect for LISTEN: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), pingTimeout)
		conn.Close(closeCtx)
		cancel()
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+relay.QuoteIdentifier(channel)); err != nil {
		return fmt.Errorf("LISTEN %s: %w", channel, err)
	}
	notified()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		notified()
	}
}

// reconcileBatch bounds the rows one reconcile statement marks, so a large
// backlog is marked in short transactions.
const reconcileBatch = 10_000

// Reconcile marks for the claim path (handoff_at = now()) every row that is
// still pending, not diverted, and was created more than olderThan ago,
// and returns how many it marked. It is `outbox-relay reconcile
// --older-than D`: the repair for rows a slot will never stream (the slot
// was dropped and recreated by someone else while the relay was down). The
// claim path then delivers them; pairs the ledger shows delivered are
// skipped, so a row the stream delivered whose status an earlier version
// left pending (docs/operations.md, "what the relay writes back") is
// settled done without being sent.
//
// Run it with olderThan well above the stream's lag: a row the stream is
// still delivering when it is marked may reach a sink from both paths. It
// marks in batches of 10,000 rows, each its own transaction, so an error
// leaves earlier batches marked; it is safe to repeat. olderThan must be
// positive.
//
// It refuses, with an error wrapping ErrHandOverUnfinished, while a slot's
// hand-over has not been recorded (docs/architecture.md, "Slot
// creation"): the relay delivers those rows itself, each aggregate's
// before its new events, and a row reconcile took from it would be
// overtaken by the aggregate's next streamed event. Each batch locks the
// checkpoint table against writes (SHARE) for its duration, so that no
// slot's creation (BeginSlot) slips between the check and the marking.
func (s *Store) Reconcile(ctx context.Context, olderThan time.Duration) (int64, error) {
	if olderThan <= 0 {
		return 0, errors.New("reconcile: older-than must be positive")
	}
	lock, unfinished, divert := s.sql.claim.reconcileLock, s.sql.claim.reconcileUnfinished, s.sql.claim.reconcileDivert
	var marked int64
	for {
		var n int64
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, lock); err != nil {
				return err
			}
			rows, err := tx.Query(ctx, unfinished)
			if err != nil {
				return err
			}
			slots, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return err
			}
			if len(slots) > 0 {
				return fmt.Errorf("%w: slot %s: the relay delivers the rows pending before it (or, if it is not running, hands them over again when it starts), each aggregate's before its new events; run reconcile once the hand-over is recorded (the relay logs \"hand-over done\"), or, if no relay will use that slot again, delete its row from %s",
					ErrHandOverUnfinished, strings.Join(slots, ", "), s.tables.checkpoint)
			}
			tag, err := tx.Exec(ctx, divert, olderThan.Milliseconds(), reconcileBatch)
			n = tag.RowsAffected()
			return err
		})
		if err != nil {
			return marked, fmt.Errorf("reconcile: %w", err)
		}
		marked += n
		if n < reconcileBatch {
			return marked, nil
		}
	}
}

// ErrHandOverUnfinished says a slot's hand-over has not been recorded yet:
// Reconcile refuses to take rows from it.
var ErrHandOverUnfinished = errors.New("a slot's hand-over has not finished")

// NewOwner returns a fresh owner id, "outbox-relay:<host>:<pid>:<random>":
// the name of one relay process in locked_by, in the ledger's claims and in
// its owner lock.
func NewOwner() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s%s:%d:%08x", OwnerPrefix, host, os.Getpid(), rand.Uint32())
}
