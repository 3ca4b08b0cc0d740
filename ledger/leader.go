package ledger

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
)

// LeaderLockKey is the session advisory lock that makes one relay the
// leader for a slot: a 64-bit FNV-1a hash of "outbox-relay:" and the slot
// name, so relays of different slots never contend. `status` and `doctor`
// compute the same key to find the leader in pg_locks.
func LeaderLockKey(slot string) int64 {
	h := fnv.New64a()
	h.Write([]byte("outbox-relay:" + slot))
	return int64(h.Sum64())
}

// The leader pings its lock connection every second; a ping that does not
// answer within two ends the term. The connection's keepalives (see
// dedicatedConfig) let the server notice a dead leader host after about
// 11 s, which frees the lock for a standby.
const (
	pingEvery         = time.Second
	leaderPingTimeout = 2 * time.Second
)

// Leader is held leadership: a session advisory lock on its own connection.
type Leader struct {
	conn *pgx.Conn
	key  int64
	lost chan struct{}
	stop context.CancelFunc
	done chan struct{}
	log  zerolog.Logger
}

// AcquireLeader blocks until this process holds the leader lock for slot,
// trying every second, or until ctx is done. The lock lives on a dedicated
// connection with TCP keepalives on both ends; once acquired, the connection
// is pinged every second and Lost is closed at the first failed ping — the
// caller must then stop delivering at once, because another relay may
// already be taking over.
func AcquireLeader(ctx context.Context, connString, slot string, log zerolog.Logger) (*Leader, error) {
	base, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("leader lock: %w", err)
	}
	base.RuntimeParams["application_name"] = "outbox-relay leader " + slot
	cfg := dedicatedConfig(base, "leader")

	key := LeaderLockKey(slot)
	waiting := false
	for {
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err == nil {
			var got bool
			for err == nil && !got {
				if err = conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", key).Scan(&got); err != nil || got {
					break
				}
				if !waiting {
					log.Info().Str("slot", slot).Msg("another relay leads this slot; standing by")
					waiting = true
				}
				select {
				case <-ctx.Done():
					err = ctx.Err()
				case <-time.After(pingEvery):
				}
			}
			if got {
				return startLeader(conn, key, log), nil
			}
			conn.Close(context.Background())
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		log.Warn().Err(err).Msg("leader lock connection failed; retrying")
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
}

func startLeader(conn *pgx.Conn, key int64, log zerolog.Logger) *Leader {
	ctx, cancel := context.WithCancel(context.Background())
	l := &Leader{conn: conn, key: key, lost: make(chan struct{}), stop: cancel, done: make(chan struct{}), log: log}
	go l.ping(ctx)
	return l
}

func (l *Leader) ping(ctx context.Context) {
	defer close(l.done)
	tick := time.NewTicker(pingEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		pctx, cancel := context.WithTimeout(ctx, leaderPingTimeout)
		var held bool
		// The lock is ours only while this session lives; checking pg_locks
		// also catches a session that was reset.
		err := l.conn.QueryRow(pctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
			AND granted AND ((classid::bigint << 32) | objid::bigint) = $1)`, l.key).Scan(&held)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil || !held {
			if err == nil {
				err = errors.New("the advisory lock is no longer held")
			}
			l.log.Error().Err(err).Msg("lost the leader lock: stopping delivery")
			close(l.lost)
			return
		}
	}
}

// Lost is closed when leadership is lost.
func (l *Leader) Lost() <-chan struct{} { return l.lost }

// Release gives up leadership: it stops the pings and closes the lock
// connection, which frees the lock for a standby.
func (l *Leader) Release() {
	l.stop()
	<-l.done
	l.conn.Close(context.Background())
}

// TerminateStaleWalsender ends another backend still streaming from slot —
// a former leader that lost its lock but not its replication connection —
// so this leader can start replication. It returns the pid ended, or 0.
func TerminateStaleWalsender(ctx context.Context, connString, slot string) (int32, error) {
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var pid *int32
	if err := conn.QueryRow(ctx, `SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1 AND active`, slot).Scan(&pid); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, nil
		}
		return 0, fmt.Errorf("look up slot %s: %w", slot, err)
	}
	if pid == nil {
		return 0, nil
	}
	if _, err := conn.Exec(ctx, `SELECT pg_terminate_backend($1)`, *pid); err != nil {
		return 0, fmt.Errorf("end walsender %d on slot %s: %w", *pid, slot, err)
	}
	return *pid, nil
}

// Slots watches and drops one replication slot: the supervisor's view of
// the relay's slot.
type Slots struct {
	pool *pgxpool.Pool
	slot string
	url  string
}

// NewSlots returns the view of slot over pool; connString opens the
// connection that ends a stale walsender.
func NewSlots(pool *pgxpool.Pool, connString, slot string) *Slots {
	return &Slots{pool: pool, slot: slot, url: connString}
}

// Slot reports whether the slot exists, whether a process streams from it,
// and the WAL it retains (pg_current_wal_lsn - restart_lsn).
func (s *Slots) Slot(ctx context.Context) (exists, active bool, retained int64, err error) {
	err = s.pool.QueryRow(ctx, `SELECT count(*) > 0, coalesce(bool_or(active), false),
		coalesce(max(pg_current_wal_lsn() - restart_lsn), 0)::bigint FROM pg_replication_slots WHERE slot_name = $1`,
		s.slot).Scan(&exists, &active, &retained)
	if err != nil {
		return false, false, 0, fmt.Errorf("look up slot %s: %w", s.slot, err)
	}
	return exists, active, retained, nil
}

// DropSlot drops the slot if it exists and nobody streams from it, and
// reports whether it did.
func (s *Slots) DropSlot(ctx context.Context) (bool, error) {
	tag, err := s.pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, s.slot)
	if err != nil {
		return false, fmt.Errorf("drop slot %s: %w", s.slot, err)
	}
	return tag.RowsAffected() > 0, nil
}

// EndStaleWalsender ends another backend still streaming from the slot (see
// TerminateStaleWalsender).
func (s *Slots) EndStaleWalsender(ctx context.Context) (int32, error) {
	return TerminateStaleWalsender(ctx, s.url, s.slot)
}
