package ledger

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The claim path (docs/architecture.md, "The claim path") claims a batch
// of due rows with one statement (sql/claim_runs.sql), here; claimsettle.go
// claims their (event, sink) pairs in the ledger before sending and
// settles each batch.

// dbTimeout bounds one database round trip of the claim path.
const dbTimeout = 30 * time.Second

// OwnerLockClass is the first key of every owner lock:
// pg_advisory_lock(OwnerLockClass, hashtext(owner)). It is "obxr" in ASCII.
// In pg_locks the lock shows as locktype 'advisory', classid
// OwnerLockClass, objid hashtext(owner) (as oid) and objsubid 2 (the
// two-key form), so it cannot collide with single-bigint advisory locks
// such as tern's migration lock.
const OwnerLockClass = 0x6f627872

// OwnerPrefix starts every relay owner id. The lease sweeper treats a row
// locked by an owner with this prefix whose owner lock is free as abandoned
// at once; rows locked by anyone else (a legacy poller) only after their
// lease.
const OwnerPrefix = "outbox-relay:"

// claimOptions are the claim's settings that change its statement.
type claimOptions struct {
	// unordered drops the ordering check (ordering: none).
	unordered bool
}

// claimStatements are the claim path's SQL texts (sql/claim.sql,
// sql/claim_runs.sql, sql/upkeep.sql).
type claimStatements struct {
	// claim[all]: the claim of runs in replication mode (the rows
	// diverted to the claim path) or in poll mode (all: every due row).
	claim [2]string
	// newest: the claim of runs whose window is the newest diverted rows
	// (replication mode; see Claim).
	newest       string
	ledgerPairs  string
	claimPairs   string
	delivered    string
	release      string
	unknown      string
	done         string
	failed       string
	retry        string
	held         string
	missing      string
	settled      string
	extendRows   string
	releaseOwned string
	extendClaims string
	expireLeases string
	repairDue    string
	lockOwner    string
	unlockOwner  string

	reconcileLock, reconcileUnfinished, reconcileDivert string
}

// claimRunRows is the longest run a claim takes of one aggregate when
// limit / aggregates is less: an aggregate keeps that many rows in flight
// however many aggregates share the backlog, so a hot aggregate moves at
// the sink's pace, not one row per claim round.
const claimRunRows = 16

// claimWindowRows is how many due rows one claim statement looks at per
// row it may claim: the window in which it finds runs. Rows of aggregates
// held back (in flight elsewhere, behind a held or scheduled row) fill
// part of it; the second window of a claim looks past them.
const claimWindowRows = 4

// claimNewestShare: with a backlog at the claim path in replication mode,
// one claim's limit divided by this is what its newest window may take
// (Claim).
const claimNewestShare = 4

// claimCursor is where the last second window ended, so that successive
// claims look further into a backlog whose front is held back, and wrap
// around at its end.
type claimCursor struct {
	mu  sync.Mutex
	due time.Time
	id  int64
	set bool
}

// claimWindow is what one claim statement saw: whether its window was
// full, and the window's last row.
type claimWindow struct {
	full bool
	due  time.Time
	id   int64
}

// Claim implements relay.ClaimStore: it claims runs of due rows, each an
// aggregate's next unsettled rows in id order (docs/guarantees.md "Claim
// runs"), returned in id order. It looks at the oldest due rows first and,
// when that window was full and gave fewer than q.Limit rows, at a second
// window further on (where the previous claim's second window ended), so
// that aggregates held back at the front of a backlog do not starve the
// rows behind them. Each statement takes at most the bytes q.MaxBytes
// leaves (a claim full by its bytes looks no further: ClaimQuery.Full).
func (s *Store) Claim(ctx context.Context, q relay.ClaimQuery) ([]*relay.Work, error) {
	claimSQL := s.sql.claim.claim[0]
	if q.All {
		claimSQL = s.sql.claim.claim[1]
	}
	window := max(q.Limit*claimWindowRows, 1000)
	maxBytes := q.MaxBytes
	if maxBytes <= 0 {
		maxBytes = math.MaxInt64
	}
	// With a backlog at the claim path (the last claim's first window was
	// full) in replication mode, a share of each claim goes first to the
	// newest due diversions: the fresh events of aggregates the stream
	// diverts behind the backlog (a slot recreated behind 200,000 rows).
	// Their runs start at the aggregate's oldest unsettled row wherever it
	// lies, so the claim path catches up with those aggregates, and gives
	// them back to the stream, without waiting for the whole backlog.
	if !q.All && !q.DueSince.IsZero() {
		// Only the aggregates with rows due since then: the newest window
		// from that point on (docs/architecture.md, "The claim path yields
		// to a lagging stream"). Each run still starts at its aggregate's
		// oldest unsettled row.
		recent, _, err := s.claimFrom(ctx, s.sql.claim.newest, q, q.DueSince, 0, window, q.Limit, maxBytes)
		return recent, err
	}
	var newest []*relay.Work
	if !q.All && s.claimBacklog.Load() {
		share := max(q.Limit/claimNewestShare, 1)
		var err error
		newest, _, err = s.claimFrom(ctx, s.sql.claim.newest, q, time.Time{}, 0, share*claimWindowRows, share, max(maxBytes/claimNewestShare, 1))
		if err != nil {
			return nil, err
		}
		if q.Full(newest) {
			return newest, nil
		}
	}
	first, win, err := s.claimFrom(ctx, claimSQL, q, time.Time{}, 0, window, q.Limit-len(newest), maxBytes-relay.PayloadBytes(newest))
	if err != nil {
		if len(newest) > 0 {
			// The newest window's rows are claimed: hand them on.
			return newest, nil
		}
		return nil, err
	}
	s.claimBacklog.Store(win.full)
	first = mergeByID(newest, first)
	if q.Full(first) || !win.full {
		if !win.full {
			s.setCursor(claimWindow{})
		}
		return first, nil
	}
	c := &s.claimCursor
	c.mu.Lock()
	fromDue, fromID := win.due, win.id
	if c.set && (c.due.After(fromDue) || c.due.Equal(fromDue) && c.id > fromID) {
		fromDue, fromID = c.due, c.id
	}
	c.mu.Unlock()
	second, win2, err := s.claimFrom(ctx, claimSQL, q, fromDue, fromID, window, q.Limit-len(first), maxBytes-relay.PayloadBytes(first))
	if err != nil {
		// The first statement's rows are claimed: hand them on.
		return first, nil
	}
	s.setCursor(win2)
	return mergeByID(first, second), nil
}

// mergeByID returns the works of a and b in id order.
func mergeByID(a, b []*relay.Work) []*relay.Work {
	if len(a) == 0 {
		return b
	}
	out := append(a, b...)
	slices.SortFunc(out, func(x, y *relay.Work) int { return cmp.Compare(x.Event.ID, y.Event.ID) })
	return out
}

// setCursor remembers where a second window ended; a window that was not
// full reached the backlog's end, and the next one starts at the front.
func (s *Store) setCursor(w claimWindow) {
	c := &s.claimCursor
	c.mu.Lock()
	defer c.mu.Unlock()
	c.set, c.due, c.id = w.full, w.due, w.id
}

// claimFrom runs one claim statement over the window of up to window due
// rows after (fromDue, fromID), claiming at most limit rows whose payloads
// take at most maxBytes (the first row whatever its size).
func (s *Store) claimFrom(ctx context.Context, claimSQL string, q relay.ClaimQuery,
	fromDue time.Time, fromID int64, window, limit int, maxBytes int64) ([]*relay.Work, claimWindow, error) {
	dbCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	// The rows' leases begin with the statement (locked_at = now()), not
	// before this moment.
	leased := time.Now()
	cursorDue := pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
	if !fromDue.IsZero() {
		cursorDue = pgtype.Timestamptz{Time: fromDue, Valid: true}
	}
	var (
		out               []*relay.Work
		win               claimWindow
		seen              int32
		lastDue           pgtype.Timestamptz
		lastID, id        pgtype.Int8
		key               pgtype.Text
		created, availAt  pgtype.Timestamptz
		attempts, replays pgtype.Int4
	)
	// The claim commits without waiting for its WAL to be flushed: nothing
	// is sent before PrepareClaim's synchronous commit, which flushes the
	// WAL past it, and a claim lost in a crash before that leaves the rows
	// pending, as if never claimed. A round trip per claim no longer waits
	// for an fsync.
	err := s.inTx(dbCtx, s.sql.setClaim, func(b *pgx.Batch) {
		b.Queue(claimSQL, limit, q.Owner, cursorDue, fromID, window, maxBytes)
	}, func(br pgx.BatchResults) error {
		rows, err := br.Query()
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			ev := &relay.Event{Status: "processing"}
			if err := rows.Scan(&seen, &lastDue, &lastID, &id, &key, &ev.EventType, &ev.AggregateType, &ev.AggregateID,
				&ev.Payload, &created, &attempts, &availAt, &replays, &ev.TraceContext); err != nil {
				return err
			}
			win = claimWindow{full: int(seen) >= window, due: lastDue.Time, id: lastID.Int64}
			if !id.Valid {
				continue // nothing claimed: the summary alone
			}
			ev.ID, ev.EventKey = id.Int64, key.String
			ev.CreatedAt, ev.AvailableAt, ev.Attempts = created.Time, availAt.Time, int(attempts.Int32)
			out = append(out, &relay.Work{Event: ev, Replay: int(replays.Int32), ClaimedAt: leased})
		}
		return rows.Err()
	})
	if err != nil {
		// A commit whose answer was lost may have claimed the rows all the
		// same; the sweeper returns them once this owner is gone or their
		// lease passed.
		return nil, claimWindow{}, fmt.Errorf("claim rows: %w", err)
	}
	return out, win, nil
}
