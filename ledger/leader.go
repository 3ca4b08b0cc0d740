package ledger

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
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
//
// A leader cut off by a network that swallows packets (its socket stays
// open, the server keeps its session and lock) cannot end its session
// itself. Two rules keep such a session from holding the slot
// (docs/operations.md, "leadership"): a relay ends its own lock sessions it
// has lost (their pids are remembered), and a standby ends a leader's lock
// session that has not been used (pinged) for LeaderStaleAfter, by which
// time that leader has stopped delivering: its pings have failed for far
// longer than the 3 s after which it steps down.
const (
	pingEvery         = time.Second
	leaderPingTimeout = 2 * time.Second
	// LeaderStaleAfter is how long a leader's lock session may go unused
	// before a standby ends it and takes over.
	LeaderStaleAfter = 10 * time.Second
)

// Leader is held leadership: a session advisory lock on its own connection.
type Leader struct {
	conn *pgx.Conn
	pid  uint32
	key  int64
	lost chan struct{}
	// pings runs the ping loop from AcquireLeader to Release.
	pings *relay.Group
	log   zerolog.Logger
}

// AcquireLeader blocks until this process holds the leader lock for slot,
// trying every second, or until ctx is done. The lock lives on a dedicated
// connection with TCP keepalives on both ends; once acquired, the connection
// is pinged every second and Lost is closed at the first failed ping — the
// caller must then stop delivering at once, because another relay may
// already be taking over. While the lock is held by a session this process
// lost, or by one unused for LeaderStaleAfter, it ends that session first.
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
				if err = conn.QueryRow(ctx, catalog.Get("TryLeaderLock"), key).Scan(&got); err != nil || got {
					break
				}
				if ended, ferr := fenceStaleHolder(ctx, conn, catalog.Get("LeaderLockHolder"), []any{key}, LeaderStaleAfter, log.With().Str("lock", "leader "+slot).Logger()); ferr != nil {
					log.Warn().Err(ferr).Msg("look at the leader lock's holder")
				} else if ended {
					continue
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
	l := &Leader{conn: conn, pid: conn.PgConn().PID(), key: key, lost: make(chan struct{}), log: log}
	// The pings run until Release, whatever the context AcquireLeader was
	// given.
	l.pings, _ = relay.NewGroup(context.Background())
	l.pings.Go("leader ping", func(ctx context.Context) error {
		defer func() {
			// A ping loop that ends before Release — the lock lost, or a
			// panic — ends the leadership.
			if ctx.Err() == nil {
				close(l.lost)
			}
		}()
		return l.ping(ctx)
	})
	return l
}

// errLockLost is the ping loop's failure when a check of the lock fails.
var errLockLost = errors.New("lost the leader lock")

// ping checks the lock every pingEvery until ctx ends (Release), and
// returns nil then. It returns why at the first check that fails: the lock
// is lost.
func (l *Leader) ping(ctx context.Context) error {
	tick := time.NewTicker(pingEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		pctx, cancel := context.WithTimeout(ctx, leaderPingTimeout)
		var held bool
		err := l.conn.QueryRow(pctx, catalog.Get("LeaderLockHeld"), l.key).Scan(&held)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil || !held {
			if err == nil {
				err = errors.New("the advisory lock is no longer held")
			}
			// The session may live on at the server (a network that
			// swallows packets): remember it as ours and lost.
			lostSession(l.pid)
			l.log.Error().Err(err).Msg("lost the leader lock: stopping delivery")
			return fmt.Errorf("%w: %w", errLockLost, err)
		}
	}
}

// Lost is closed when leadership is lost.
func (l *Leader) Lost() <-chan struct{} { return l.lost }

// Release gives up leadership: it stops the pings and closes the lock
// connection, which frees the lock for a standby.
func (l *Leader) Release() {
	if err := l.pings.Stop(); err != nil && !errors.Is(err, errLockLost) {
		// A loss was logged when it happened; anything else was not.
		l.log.Error().Err(err).Msg("the leader's ping loop failed")
	}
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
	if err := conn.QueryRow(ctx, catalog.Get("SlotWalsender"), slot).Scan(&pid); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, nil
		}
		return 0, fmt.Errorf("look up slot %s: %w", slot, err)
	}
	if pid == nil {
		return 0, nil
	}
	if _, err := conn.Exec(ctx, catalog.Get("TerminateBackend"), *pid); err != nil {
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
// and the WAL it retains: from its restart_lsn to the server's current
// position, on a standby (the slot the stream decodes from there,
// docs/standby.md) its replayed one.
func (s *Slots) Slot(ctx context.Context) (exists, active bool, retained int64, err error) {
	err = s.pool.QueryRow(ctx, catalog.Get("SlotState"), s.slot).Scan(&exists, &active, &retained)
	if err != nil {
		return false, false, 0, fmt.Errorf("look up slot %s: %w", s.slot, err)
	}
	return exists, active, retained, nil
}

// DropSlot drops the slot if it exists and nobody streams from it, and
// reports whether it did.
func (s *Slots) DropSlot(ctx context.Context) (bool, error) {
	tag, err := s.pool.Exec(ctx, catalog.Get("DropIdleSlot"), s.slot)
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

// lost holds the backend pids of lock sessions this process has lost: it
// closed its side, but the server may keep them (and their locks) until TCP
// gives up, which behind a network that swallows packets takes hours.
var lost = struct {
	sync.Mutex
	pids map[uint32]time.Time
}{pids: map[uint32]time.Time{}}

// lostSession remembers pid as a session of this process that it lost.
func lostSession(pid uint32) {
	if pid == 0 {
		return
	}
	lost.Lock()
	defer lost.Unlock()
	lost.pids[pid] = time.Now()
	for p, at := range lost.pids {
		if time.Since(at) > time.Hour {
			delete(lost.pids, p)
		}
	}
}

func isLostSession(pid uint32) bool {
	lost.Lock()
	defer lost.Unlock()
	_, ok := lost.pids[pid]
	return ok
}

// fenceStaleHolder looks at the session holding an advisory lock, found by
// holderSQL with lockArgs (LeaderLockHolder or OwnerLockHolder): one this
// process lost is ended at once; with staleAfter > 0, one that has been
// idle that long is ended too. It reports whether it ended one.
func fenceStaleHolder(ctx context.Context, conn *pgx.Conn, holderSQL string, lockArgs []any, staleAfter time.Duration, log zerolog.Logger) (bool, error) {
	var pid uint32
	var idle float64
	var state string
	err := conn.QueryRow(ctx, holderSQL, lockArgs...).Scan(&pid, &state, &idle)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	idleFor := time.Duration(idle * float64(time.Second))
	switch {
	case isLostSession(pid):
		log.Warn().Uint32("pid", pid).Msg("the lock is held by a session of this relay that it lost (its network swallowed packets): ending it")
	case staleAfter > 0 && state == "idle" && idleFor >= staleAfter:
		log.Warn().Uint32("pid", pid).Dur("unused_for", idleFor.Round(time.Second)).
			Msg("the lock's holder has not used its session for longer than its leader would stay leader: ending it")
	default:
		return false, nil
	}
	var ended bool
	if err := conn.QueryRow(ctx, catalog.Get("TerminateBackend"), int32(pid)).Scan(&ended); err != nil {
		return false, fmt.Errorf("end session %d: %w", pid, err)
	}
	if ended {
		// pg_terminate_backend only signals: wait for the lock to go.
		for i := 0; i < 50; i++ {
			var alive bool
			if err := conn.QueryRow(ctx, catalog.Get("BackendAlive"), int32(pid)).Scan(&alive); err != nil || !alive {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return ended, nil
}
