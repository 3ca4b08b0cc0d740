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

// The claim path's SQL (docs/architecture.md, "the claim path"): claim a
// batch of due rows with one statement, claim their (event, sink) pairs in
// the ledger before sending, and settle each batch in one synchronous
// transaction, every change conditional on the row or claim still being
// this owner's.

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

type claimOptions struct {
	unordered bool
}

type claimStatements struct {
	// claim[all][shape]: the claim query for poll mode (all) or not, and
	// the table's shape (see claimShape).
	claim [2][3]string
	// newest[shape]: the claim query whose window is the newest due
	// hand-offs (replication mode; see Claim).
	newest       [3]string
	hasReplays   string
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
}

// ownerAlive is true while the session advisory lock of the owner named by
// the SQL expression owner is held in this database.
func ownerAlive(owner string) string {
	return fmt.Sprintf(`EXISTS (
           SELECT FROM pg_locks AS k
            WHERE k.locktype = 'advisory' AND k.granted
              AND k.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
              AND k.classid = %d AND k.objid = hashtext(%s)::oid AND k.objsubid = 2)`, OwnerLockClass, owner)
}

func renderClaim(t tables, opts claimOptions) claimStatements {
	outbox, ledger := t.outbox, t.ledger
	// The ordering check: a row waits while a lower id of its aggregate is
	// unsettled (Unsettled: pending — a NULL status included —, processing
	// or held; done, failed and discarded rows never block). The status is
	// the row's one state: the stream's settlement writes done in the
	// transaction of its delivered ledger rows, so the check reads nothing
	// else (docs/schema.md, "A row's states"). Unsettled is the order
	// index's predicate, so the planner can use it.
	//
	// The check looks for the nearest unsettled row below a run's head,
	// walking the order index down (a scalar subquery with ORDER BY … DESC
	// LIMIT 1: an EXISTS would drop the ORDER BY and walk up from the
	// aggregate's first row). The order index holds only unsettled rows, so
	// the walk never passes the aggregate's settled history
	// (TestClaimCostIndependentOfStreamedHistory).

	// The claim of runs (docs/guarantees.md "Claim runs"): River's
	// JobGetAvailable shape, with the ordering decided once per aggregate
	// over a window of due rows (river's JobSchedule: a per-key decision
	// over the batch, not a correlated subquery per candidate row).
	//
	// win: up to $5 due rows, oldest first, after the cursor ($3, $4),
	// through the claim index (poll mode) or the hand-off index. No lock
	// and no ordering check per row, so the scan costs one index entry a
	// row however many of them wait behind their aggregate.
	// aggs: the window's aggregates, oldest first (newest first in the
	// newest window, see Claim), at most $1, each with
	// its lowest row in the window.
	// heads, starts: where each aggregate's run starts (the ordering
	// check, once per aggregate): its window row when no lower row is
	// unsettled; when the nearest such row is claimable
	// too (concurrent writers leave available_at out of id order, so it
	// may lie outside the window), the aggregate's lowest such row if that
	// is claimable; otherwise no run.
	// pick: from each start up the order index, the aggregate's unsettled
	// rows while they are claimable, at most $1 / aggregates each, and at
	// least claimRunRows: a run ends before a row not due yet, the
	// stream's, held, or processing under another claim.
	// chosen: whole runs, oldest aggregate first, at most $1 rows whose
	// payloads take at most $6 bytes (the first row whatever its size), so
	// each aggregate keeps a prefix; only these rows' sizes are read.
	// locked: chosen rows locked, skipping rows another claimer locked
	// (found by id: "(…) IS TRUE" keeps the planner from reaching them
	// through a partial index whose statistics a hand-over of 200,000
	// rows has just made stale, which scanned all of them for each chosen
	// row: a 30 s claim in make bench's slot-recreated);
	// kept: of each aggregate only the prefix locked without a gap, so
	// that a run never passes a row another relay is claiming.
	// claimed: a claimed row is the claim path's from then on (handoff_at
	// set, as the lease sweeper does), in poll mode too: a relay that
	// streams next diverts the aggregate's new events behind it and its
	// re-stream check skips it (TestPollClaimMakesRowsTheClaimPaths).
	// The checks read every unsettled row (processing ones too), locked or
	// not: a run never starts behind, nor passes, a row another relay has
	// claimed and not settled.
	aggType, aggID := "o.aggregate_type", "o.aggregate_id"
	if opts.unordered {
		aggType, aggID = "NULL::text", "NULL::text"
	}
	claim := func(all bool, replays, trace string, newest bool) string {
		order, rank := "o.available_at, o.id", "min(w.due), min(w.id)"
		if newest {
			// The newest rows, and the aggregates with the newest first.
			order, rank = "o.available_at DESC, o.id DESC", "max(w.due) DESC, max(w.id) DESC"
		}
		which := "\n       AND o.handoff_at IS NOT NULL"
		claimable := "p.status = 'pending' AND p.available_at <= now() AND p.handoff_at IS NOT NULL"
		if all {
			which = ""
			claimable = "p.status = 'pending' AND p.available_at <= now()"
		}
		return fmt.Sprintf(`
WITH win AS MATERIALIZED (
    SELECT o.id, o.available_at AS due, %[5]s AS at, %[6]s AS ai
      FROM %[1]s AS o
     WHERE o.status = 'pending'
       AND o.available_at <= now()%[2]s
       AND (o.available_at, o.id) > ($3::timestamptz, $4::bigint)
     ORDER BY %[9]s
     LIMIT $5),
summary AS (
    SELECT (SELECT count(*) FROM win)::int AS n, last.due AS last_due, last.id AS last_id
      FROM (SELECT NULL) AS one
      LEFT JOIN (SELECT w.due, w.id FROM win AS w ORDER BY w.due DESC, w.id DESC LIMIT 1) AS last ON true),
aggs AS (
    SELECT w.at, w.ai, min(w.id) AS head, row_number() OVER (ORDER BY %[10]s) AS rank
      FROM win AS w
     WHERE w.at IS NOT NULL AND w.ai IS NOT NULL
     GROUP BY w.at, w.ai
     ORDER BY %[10]s
     LIMIT $1),
heads AS MATERIALIZED (
    SELECT a.at, a.ai, a.head, a.rank, b.id AS below, b.ok AS below_ok
      FROM aggs AS a
      LEFT JOIN LATERAL (
           SELECT p.id, (%[7]s) AS ok FROM %[1]s AS p
            WHERE p.aggregate_type = a.at AND p.aggregate_id = a.ai
              AND p.id < a.head
              AND %[11]s
            ORDER BY p.id DESC
            LIMIT 1) AS b ON true),
starts AS MATERIALIZED (
    SELECT h.at, h.ai, h.head, h.rank FROM heads AS h WHERE h.below IS NULL
    UNION ALL
    SELECT h.at, h.ai, f.id, h.rank
      FROM heads AS h
      JOIN LATERAL (
           SELECT p.id, (%[7]s) AS ok FROM %[1]s AS p
            WHERE p.aggregate_type = h.at AND p.aggregate_id = h.ai
              AND %[11]s
            ORDER BY p.id
            LIMIT 1) AS f ON f.ok
     WHERE h.below_ok),
per AS (
    SELECT GREATEST(($1 + count(*) - 1) / GREATEST(count(*), 1), %[8]d) AS n FROM starts),
pick AS (
    SELECT r.id, s.at, s.ai, s.rank, row_number() OVER (PARTITION BY s.at, s.ai ORDER BY r.id) AS rn
      FROM starts AS s
     CROSS JOIN LATERAL (
           SELECT p.id, bool_and(%[7]s) OVER (ORDER BY p.id) AS ok FROM %[1]s AS p
            WHERE p.aggregate_type = s.at AND p.aggregate_id = s.ai
              AND p.id >= s.head
              AND %[11]s
            ORDER BY p.id
            LIMIT (SELECT per.n FROM per)) AS r
     WHERE r.ok
    UNION ALL
    SELECT w.id, NULL, NULL, 0, 1 FROM win AS w WHERE w.at IS NULL OR w.ai IS NULL),
chosen AS (
    SELECT c.id, c.at, c.ai, c.rn
      FROM (SELECT c.id, c.at, c.ai, c.rn,
                   sum((SELECT %[12]s FROM %[1]s AS o WHERE o.id = c.id)) OVER w AS upto,
                   row_number() OVER w AS k
              FROM (SELECT c.id, c.at, c.ai, c.rn, c.rank FROM pick AS c ORDER BY c.rank, c.rn, c.id LIMIT $1) AS c
            WINDOW w AS (ORDER BY c.rank, c.rn, c.id)) AS c
     WHERE c.k = 1 OR c.upto <= $6::bigint),
locked AS (
    SELECT o.id, c.at, c.ai, c.rn
      FROM %[1]s AS o JOIN chosen AS c ON c.id = o.id
     WHERE (o.status = 'pending'
            AND o.available_at <= now()%[2]s) IS TRUE
       FOR UPDATE OF o SKIP LOCKED),
kept AS (
    SELECT l.id
      FROM (SELECT l.id, l.at, l.ai, l.rn,
                   row_number() OVER (PARTITION BY l.at, l.ai ORDER BY l.id) AS lrn
              FROM locked AS l) AS l
     WHERE l.at IS NULL OR l.ai IS NULL OR l.rn = l.lrn),
claimed AS (
UPDATE %[1]s AS o
   SET status = 'processing', locked_at = now(), locked_by = $2,
       handoff_at = coalesce(o.handoff_at, now())
  FROM kept
 WHERE o.id = kept.id
RETURNING o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, o.payload::text,
          o.created_at, COALESCE(o.attempts, 0), o.available_at, %[3]s AS replays, %[4]s AS trace)
SELECT s.n, s.last_due, s.last_id, c.*
  FROM summary AS s LEFT JOIN claimed AS c ON true
 ORDER BY c.id`, outbox, which, replays, trace, aggType, aggID, claimable, claimRunRows, order, rank, Unsettled("p"), payloadBytes("o"))
	}
	shapes := func(all, newest bool) [3]string {
		return [3]string{
			claim(all, "0", "NULL::text", newest),
			claim(all, "COALESCE(o.replays, 0)", "NULL::text", newest),
			claim(all, "COALESCE(o.replays, 0)", "o.trace_context::text", newest),
		}
	}

	return claimStatements{
		claim:  [2][3]string{shapes(false, false), shapes(true, false)},
		newest: shapes(false, true),
		// Whether the outbox has the replays column (migration 006) and
		// the trace_context column (migration 008).
		hasReplays: `SELECT EXISTS (SELECT FROM pg_attribute
                WHERE attrelid = $1::text::regclass AND attname = 'replays' AND NOT attisdropped),
       EXISTS (SELECT FROM pg_attribute
                WHERE attrelid = $1::text::regclass AND attname = 'trace_context' AND NOT attisdropped)`,

		ledgerPairs: ledgerPairsSQL(ledger),

		// The claim before sending is the insert itself (never
		// check-then-insert). An existing pair is taken when it is
		// 'unknown' (held, then released by dlq retry, or left by a send
		// whose outcome was unknown), or 'sending' with its lease ($4 ms)
		// passed, its owner gone (owner lock free), or this owner's own
		// (left by a failed settlement). Taking a 'sending' pair is an
		// unknown outcome; the caller tells that case by the state it read
		// before, or by attempts > 1 when the pair appeared since. Pairs
		// are locked in key order.
		claimPairs: fmt.Sprintf(`
INSERT INTO %[1]s AS l (event_key, action, state, attempts, owner, claimed_at)
SELECT t.k, t.a, 'sending', 1, $3, now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'sending', owner = EXCLUDED.owner, claimed_at = now(), attempts = l.attempts + 1
 WHERE l.state = 'unknown'
    OR (l.state = 'sending'
        AND (l.owner IS NULL OR l.owner = EXCLUDED.owner OR l.claimed_at IS NULL
             OR l.claimed_at < now() - $4::bigint * interval '1 millisecond'
             OR NOT %[2]s))
RETURNING l.event_key, l.action, l.attempts`, ledger, ownerAlive("l.owner")),

		delivered: deliveredSQL(ledger, true),
		release:   releaseSQL(ledger),

		// Our claim's outcome is unknown: held for a person (next attempt
		// NULL), or to be sent again by whoever claims the row next.
		unknown: fmt.Sprintf(`
UPDATE %s AS l
   SET state = 'unknown', detail = t.d, next_attempt_at = now() + t.delay * interval '1 millisecond'
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS t(k, a, d, delay)
 WHERE l.event_key = t.k AND l.action = t.a AND l.owner = $5 AND l.state = 'sending'`, ledger),

		// Every status change is conditional on the row still being ours.
		done: fmt.Sprintf(`
UPDATE %s
   SET status = 'done', processed_at = now(), locked_at = NULL, locked_by = NULL
 WHERE id = ANY($1::bigint[]) AND status = 'processing' AND locked_by = $2`, outbox),

		failed: fmt.Sprintf(`
UPDATE %s AS o
   SET status = 'failed', last_error = t.err, attempts = t.n, processed_at = now(),
       locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $4`, outbox),

		// Back to pending, still the claim path's (handoff_at is kept). A
		// NULL error keeps the previous last_error.
		retry: fmt.Sprintf(`
UPDATE %s AS o
   SET status = 'pending', attempts = t.n, available_at = now() + t.delay * interval '1 millisecond',
       last_error = COALESCE(t.err, o.last_error), locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::int[]) AS t(id, delay, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $5`, outbox),

		held: fmt.Sprintf(`
UPDATE %s AS o
   SET status = 'held', last_error = t.err, attempts = t.n, processed_at = now(),
       locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $4`, outbox),

		// The ids among $1 without a row: deleted since they were claimed
		// (relay.StreamStore.Gone). One probe of the primary key per id.
		missing: fmt.Sprintf(`
SELECT t.id FROM unnest($1::bigint[]) AS t(id)
 WHERE NOT EXISTS (SELECT FROM %s AS o WHERE o.id = t.id OFFSET 0)`, outbox),

		// The aggregates among $1/$2 with no handed-off or held row left
		// unsettled: the stream may deliver their events again. The status
		// list repeats the order index's predicate.
		settled: fmt.Sprintf(`
SELECT t.at, t.ai
  FROM unnest($1::text[], $2::text[]) AS t(at, ai)
 WHERE NOT EXISTS (
       SELECT FROM %s AS o
        WHERE o.aggregate_type = t.at AND o.aggregate_id = t.ai
          AND %s
          AND (o.handoff_at IS NOT NULL OR o.status = 'held'))`, outbox, Unsettled("o")),

		releaseOwned: fmt.Sprintf(`
WITH back AS (
UPDATE %[1]s AS o SET status = 'pending', locked_at = NULL, locked_by = NULL,
       handoff_at = coalesce(o.handoff_at, now())
 WHERE o.status = 'processing' AND o.locked_by = $1
RETURNING o.event_key),
withdrawn AS (
DELETE FROM %[2]s AS l USING back WHERE l.event_key = back.event_key AND l.owner = $1 AND l.state = 'sending')
SELECT count(*) FROM back`, outbox, ledger),

		// A lease is renewed while its rows are being delivered.
		extendRows: fmt.Sprintf(`
UPDATE %s SET locked_at = now()
 WHERE id = ANY($1::bigint[]) AND status = 'processing' AND locked_by = $2`, outbox),
		extendClaims: fmt.Sprintf(`
UPDATE %s AS l SET claimed_at = now()
 WHERE l.event_key = ANY(ARRAY(SELECT o.event_key FROM %s AS o WHERE o.id = ANY($1::bigint[])))
   AND l.owner = $2 AND l.state = 'sending'`, ledger, outbox),

		// Leases: a processing row whose lease ($1 ms) passed, or whose
		// relay owner (locked_by starting with $2) holds no owner lock, goes
		// back to pending with its attempts. Other lockers (a legacy poller)
		// lose rows only by the lease.
		expireLeases: fmt.Sprintf(`
WITH stale AS (
    SELECT o.id, o.locked_by
      FROM %[1]s AS o
     WHERE o.status = 'processing'
       AND (o.locked_at IS NULL
            OR o.locked_at < now() - $1::bigint * interval '1 millisecond'
            OR (starts_with(o.locked_by, $2) AND NOT %[2]s))
       FOR UPDATE SKIP LOCKED)
UPDATE %[1]s AS o
   SET status = 'pending', locked_at = NULL, locked_by = NULL,
       -- A claimed row is never the stream's: it stays the claim path's.
       handoff_at = coalesce(o.handoff_at, now())
  FROM stale
 WHERE o.id = stale.id AND o.status = 'processing'
RETURNING o.id, stale.locked_by`, outbox, ownerAlive("o.locked_by")),

		// A row with a NULL status is pending, and a pending row with a
		// NULL available_at is due (both columns are nullable): the claim
		// query reads status = 'pending' and orders by available_at, so
		// they are written so.
		repairDue: fmt.Sprintf(`
UPDATE %s SET status = COALESCE(status, 'pending'), available_at = COALESCE(available_at, now())
 WHERE (status IS NULL OR (status = 'pending' AND available_at IS NULL))`, outbox),

		lockOwner:   fmt.Sprintf(`SELECT pg_try_advisory_lock(%d, hashtext($1))`, OwnerLockClass),
		unlockOwner: fmt.Sprintf(`SELECT pg_advisory_unlock(%d, hashtext($1))`, OwnerLockClass),
	}
}

// claimStatement returns the claim query for the table's shape (with or
// without the replays and trace_context columns, looked up once) and the
// mode.
func (s *Store) claimStatement(ctx context.Context, all bool) (string, error) {
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	if s.claimKnown {
		return s.pickClaim(all), nil
	}
	if err := s.inspectClaimShape(ctx); err != nil {
		return "", err
	}
	return s.pickClaim(all), nil
}

// inspectClaimShape looks up, once, which optional columns the outbox has.
// s.claimMu is held.
func (s *Store) inspectClaimShape(ctx context.Context) error {
	dbCtx, cancel := context.WithTimeout(relay.Detached(ctx, "the shape is read once for every later claim: a stopping caller must not cut it short; bounded by dbTimeout"), dbTimeout)
	defer cancel()
	var replays, trace bool
	if err := s.pool.QueryRow(dbCtx, s.sql.claim.hasReplays, s.outbox).Scan(&replays, &trace); err != nil {
		return fmt.Errorf("inspect %s: %w", s.outbox, err)
	}
	switch {
	case replays && trace:
		s.claimShape = 2
	case replays:
		s.claimShape = 1
	default:
		s.claimShape = 0
	}
	s.claimKnown = true
	return nil
}

func (s *Store) pickClaim(all bool) string {
	i := 0
	if all {
		i = 1
	}
	return s.sql.claim.claim[i][s.claimShape]
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

// newestClaimStatement is the claim statement of the newest window, in the
// shape claimStatement settled on (Claim has called it first).
func (s *Store) newestClaimStatement() string {
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	return s.sql.claim.newest[s.claimShape]
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
	claimSQL, err := s.claimStatement(ctx, q.All)
	if err != nil {
		return nil, err
	}
	window := max(q.Limit*claimWindowRows, 1000)
	maxBytes := q.MaxBytes
	if maxBytes <= 0 {
		maxBytes = math.MaxInt64
	}
	// With a backlog at the claim path (the last claim's first window was
	// full) in replication mode, a share of each claim goes first to the
	// newest due hand-offs: the fresh events of aggregates the stream
	// diverts behind the backlog (a slot recreated behind 200,000 rows).
	// Their runs start at the aggregate's oldest unsettled row wherever it
	// lies, so the claim path catches up with those aggregates, and gives
	// them back to the stream, without waiting for the whole backlog.
	if !q.All && !q.DueSince.IsZero() {
		// Only the aggregates with rows due since then: the newest window
		// from that point on (docs/architecture.md, "The claim path yields
		// to a lagging stream"). Each run still starts at its aggregate's
		// oldest unsettled row.
		newestSQL := s.newestClaimStatement()
		recent, _, err := s.claimFrom(ctx, newestSQL, q, q.DueSince, 0, window, q.Limit, maxBytes)
		return recent, err
	}
	var newest []*relay.Work
	if !q.All && s.claimBacklog.Load() {
		newestSQL := s.newestClaimStatement()
		share := max(q.Limit/claimNewestShare, 1)
		newest, _, err = s.claimFrom(ctx, newestSQL, q, time.Time{}, 0, share*claimWindowRows, share, max(maxBytes/claimNewestShare, 1))
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

// PrepareClaim implements relay.ClaimStore: one read of the ledger and one
// synchronous insert of the claims for the batch.
func (s *Store) PrepareClaim(ctx context.Context, works []*relay.Work, owner string, lease time.Duration) error {
	keys := make([]string, 0, len(works))
	for _, w := range works {
		if len(w.Pairs) > 0 {
			keys = append(keys, w.Event.EventKey)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	dbCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	known, err := readLedger(dbCtx, s.pool, s.sql.claim.ledgerPairs, keys)
	if err != nil {
		return err
	}
	var claimKeys, claimActions []string
	for _, w := range works {
		for _, p := range w.Pairs {
			prev := known[relay.LedgerKey{EventKey: w.Event.EventKey, Action: p.Sink}]
			p.PrevOwner = prev.owner
			if prev.state == "delivered" {
				p.State = relay.PairDelivered
				continue
			}
			claimKeys, claimActions = append(claimKeys, w.Event.EventKey), append(claimActions, p.Sink)
		}
	}
	if len(claimKeys) == 0 {
		return nil
	}
	claimed := map[relay.LedgerKey]int32{}
	err = s.inTx(dbCtx, s.sql.setSynchronousCommit, func(b *pgx.Batch) {
		b.Queue(s.sql.claim.claimPairs, claimKeys, claimActions, owner, lease.Milliseconds())
	}, func(br pgx.BatchResults) error {
		rows, err := br.Query()
		if err != nil {
			return err
		}
		var k relay.LedgerKey
		var attempts int32
		_, err = pgx.ForEachRow(rows, []any{&k.EventKey, &k.Action, &attempts}, func() error {
			claimed[k] = attempts
			return nil
		})
		return err
	})
	if err != nil {
		return fmt.Errorf("claim %d ledger pairs: %w", len(claimKeys), rowDataError(err))
	}
	for _, w := range works {
		for _, p := range w.Pairs {
			if p.State == relay.PairDelivered {
				continue
			}
			key := relay.LedgerKey{EventKey: w.Event.EventKey, Action: p.Sink}
			attempts, ok := claimed[key]
			prev := known[key]
			switch {
			case !ok:
				p.State = relay.PairBlocked
			case prev.state == "sending" || prev.state == "" && attempts > 1:
				// We took over a claim whose send may have happened.
				p.State, p.Claimed = relay.PairUnknown, true
			default:
				p.Claimed = true
			}
		}
	}
	return nil
}

// SettleClaim implements relay.ClaimStore: one synchronous transaction and
// one round trip, at most one statement per kind, and one that reports the
// rows deleted since they were claimed.
func (s *Store) SettleClaim(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
	r := split(works)
	st := s.sql.claim
	var steps []step
	if len(r.deliveredKeys) > 0 {
		steps = append(steps, exec(fmt.Sprintf("record %d delivered pairs", len(r.deliveredKeys)), st.delivered, r.deliveredKeys, r.deliveredActions, owner))
	}
	if len(r.releaseKeys) > 0 {
		steps = append(steps, exec(fmt.Sprintf("withdraw %d ledger claims", len(r.releaseKeys)), st.release, r.releaseKeys, r.releaseActions, owner))
	}
	if len(r.unknownKeys) > 0 {
		// Held rows' pairs wait for a person (next attempt NULL); the
		// others are sent again when the row is due.
		delays := make([]*int64, len(r.unknownKeys))
		next := map[string]*int64{}
		for i, w := range works {
			if w.Decision.Kind == relay.Later {
				ms := max(time.Until(w.Decision.At), 0).Milliseconds()
				next[works[i].Event.EventKey] = &ms
			}
		}
		for i, k := range r.unknownKeys {
			delays[i] = next[k]
		}
		steps = append(steps, exec(fmt.Sprintf("mark %d ledger pairs unknown", len(r.unknownKeys)), st.unknown, r.unknownKeys, r.unknownActions, r.unknownDetails, delays, owner))
	}
	if len(r.doneIDs) > 0 {
		steps = append(steps, exec(fmt.Sprintf("mark %d rows done", len(r.doneIDs)), st.done, r.doneIDs, owner))
	}
	if len(r.deadIDs) > 0 {
		steps = append(steps, exec(fmt.Sprintf("dead-letter %d rows", len(r.deadIDs)), st.failed, r.deadIDs, r.deadErrs, r.deadN, owner))
	}
	if len(r.heldIDs) > 0 {
		steps = append(steps, exec(fmt.Sprintf("hold %d rows", len(r.heldIDs)), st.held, r.heldIDs, r.heldErrs, r.heldN, owner))
	}
	if len(r.retryIDs) > 0 {
		steps = append(steps, exec(fmt.Sprintf("put %d rows back", len(r.retryIDs)), st.retry, r.retryIDs, r.retryMS, r.retryErrs, r.retryN, owner))
	}
	if len(steps) == 0 {
		return nil, nil
	}
	claimed := make([]int64, len(works))
	for i, w := range works {
		claimed[i] = w.Event.ID
	}
	steps = append(steps, ids("look for deleted rows", st.missing, claimed))
	gone, err := s.runSteps(ctx, s.sql.setSynchronousCommit, steps)
	if err != nil {
		return nil, fmt.Errorf("settle %d claimed rows: %w", len(works), err)
	}
	return gone, nil
}

// SettledAggregates implements relay.ClaimStore. It only reads.
func (s *Store) SettledAggregates(ctx context.Context, aggs []relay.AggregateKey) ([]relay.AggregateKey, error) {
	types, ids := make([]string, len(aggs)), make([]string, len(aggs))
	for i, a := range aggs {
		types[i], ids[i] = a.Type, a.ID
	}
	rows, err := s.pool.Query(ctx, s.sql.claim.settled, types, ids)
	if err != nil {
		return nil, fmt.Errorf("check settled aggregates: %w", err)
	}
	settled, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (relay.AggregateKey, error) {
		var a relay.AggregateKey
		err := row.Scan(&a.Type, &a.ID)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("check settled aggregates: %w", err)
	}
	return settled, nil
}

// ReleaseOwned returns to pending the rows processing under owner, keeping
// their attempts, and withdraws owner's 'sending' claims of them: the claim
// source calls it as it starts, when it has nothing in flight, so that rows
// a claim cut short by a stopping term left claimed do not wait for their
// lease. It returns how many rows it returned.
func (s *Store) ReleaseOwned(ctx context.Context, owner string) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, s.sql.claim.releaseOwned, owner).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("return the rows %s left claimed: %w", owner, err)
	}
	return n, nil
}

// ExtendLeases implements relay.ClaimStore. It renews the ledger claims
// before the rows, in the order every transaction of the relay's that
// writes both takes them (docs/architecture.md, "Lock order"): a renewal
// holding a row while it waited for the pair a settlement held, the
// settlement waiting for that row, was a deadlock.
func (s *Store) ExtendLeases(ctx context.Context, ids []int64, owner string) error {
	_, err := s.runSteps(ctx, "", []step{
		exec("renew ledger claims", s.sql.claim.extendClaims, ids, owner),
		exec("renew row leases", s.sql.claim.extendRows, ids, owner),
	})
	if err != nil {
		return fmt.Errorf("extend the leases of %d rows: %w", len(ids), err)
	}
	return nil
}
