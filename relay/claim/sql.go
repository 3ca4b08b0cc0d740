package claim

import "fmt"

// ownerLockClass is the first key of every owner lock:
// pg_advisory_lock(ownerLockClass, hashtext(owner)). It is "obxr" in ASCII.
// In pg_locks the lock shows as locktype 'advisory', classid
// ownerLockClass, objid hashtext(owner) (as oid) and objsubid 2 (the
// two-key form), so it cannot collide with single-bigint advisory locks
// such as tern's migration lock.
const ownerLockClass = 0x6f627872

// statements is every SQL text the Claimer runs, rendered once with the
// configured names quoted as identifiers.
type statements struct {
	claim         string // for an outbox without the replays column
	claimReplays  string // with it: Delivery.Replay
	hasReplays    string
	ledgerPairs   string
	claimPairs    string
	setSyncCommit string
	delivered     string
	release       string
	unknown       string
	done          string
	failed        string
	retry         string
	held          string
	settled       string
	expireLeases  string
	stuck         string
	repairDue     string
	lockOwner     string
	unlockOwner   string
}

// ownerAlive is true while the session advisory lock of the owner named by
// the SQL expression owner is held in this database.
func ownerAlive(owner string) string {
	return fmt.Sprintf(`EXISTS (
           SELECT FROM pg_locks AS k
            WHERE k.locktype = 'advisory' AND k.granted
              AND k.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
              AND k.classid = %d AND k.objid = hashtext(%s)::oid AND k.objsubid = 2)`, ownerLockClass, owner)
}

// render builds the statements. all claims every due pending row (poll
// mode); otherwise only rows handed to the claim path. unordered drops the
// per-aggregate ordering check.
func render(outbox, ledger string, all, unordered bool) statements {
	handoff := "\n       AND o.handoff_at IS NOT NULL"
	if all {
		handoff = ""
	}
	// The ordering check: a row waits while a lower id of its aggregate is
	// unsettled (pending, processing or held — failed and done rows never
	// block), unless the ledger shows that row delivered to every sink it is
	// routed to (SPEC §3; with mark_done: off such rows stay pending).
	// Routing in SQL mirrors the engine's: $3 sink names, $4 "takes every
	// type", $5 the sink's globs as one regex (see globToRegex). The status
	// list repeats the order index's predicate so the planner can use it.
	ordering := fmt.Sprintf(`
       AND (o.aggregate_type IS NULL OR o.aggregate_id IS NULL OR NOT EXISTS (
            SELECT FROM %[1]s AS p
             WHERE p.aggregate_type = o.aggregate_type
               AND p.aggregate_id = o.aggregate_id
               AND p.id < o.id
               AND p.status IN ('pending', 'processing', 'held')
               AND EXISTS (
                   SELECT FROM unnest($3::text[], $4::bool[], $5::text[]) AS s(sink, every_type, re)
                    WHERE (s.every_type OR p.event_type ~ s.re)
                      AND NOT EXISTS (
                          SELECT FROM %[2]s AS l
                           WHERE l.event_key = p.event_key AND l.action = s.sink
                             AND l.state = 'delivered'))))`, outbox, ledger)
	if unordered {
		ordering = ""
	}

	// River's JobGetAvailable shape: lock a batch of due rows, skipping rows
	// another claimer (or a legacy poller) has locked, then mark them ours.
	// The partial index (available_at, id) WHERE status = 'pending' serves
	// the scan in order. payload::text is jsonb's text, byte for byte what
	// the stream decodes. replays is the replays column where it exists.
	claim := func(replays string) string {
		return fmt.Sprintf(`
WITH locked AS (
    SELECT o.id
      FROM %[1]s AS o
     WHERE o.status = 'pending'
       AND o.available_at <= now()%[2]s%[3]s
     ORDER BY o.available_at, o.id
     LIMIT $1
       FOR UPDATE SKIP LOCKED)
UPDATE %[1]s AS o
   SET status = 'processing', locked_at = now(), locked_by = $2
  FROM locked
 WHERE o.id = locked.id
RETURNING o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, o.payload::text,
          o.created_at, COALESCE(o.attempts, 0), o.available_at, %[4]s`, outbox, handoff, ordering, replays)
	}

	return statements{
		claim:        claim("0"),
		claimReplays: claim("COALESCE(o.replays, 0)"),
		// Whether the outbox has the replays column (migration 006).
		hasReplays: `SELECT EXISTS (SELECT FROM pg_attribute
                WHERE attrelid = $1::text::regclass AND attname = 'replays' AND NOT attisdropped)`,

		// A prefix scan of the ledger's primary key (event_key, action).
		ledgerPairs: fmt.Sprintf(`
SELECT event_key, action, state, owner FROM %s WHERE event_key = ANY($1::text[])`, ledger),

		// The claim before sending is the insert itself (never
		// check-then-insert). An existing pair is taken when it is
		// 'unknown' (held, then released by dlq retry), or 'sending' with
		// its lease ($4 ms) passed, its owner gone (owner lock free), or
		// this owner's own (left by a failed settlement). Taking a
		// 'sending' pair is an unknown outcome; the caller tells that case
		// by the state it read before, or by attempts > 1 when the pair
		// appeared since. Pairs are locked in key order.
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

		// Explicitly synchronous even where the role or database default is
		// off: a claim lost in a crash would be sent again.
		setSyncCommit: `SELECT set_config('synchronous_commit', 'on', true)
 WHERE current_setting('synchronous_commit') <> 'remote_apply'`,

		// A pair already delivered is left as it is.
		delivered: fmt.Sprintf(`
INSERT INTO %s AS l (event_key, action, state, attempts, owner, claimed_at, delivered_at)
SELECT t.k, t.a, 'delivered', 1, $3, now(), now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'delivered', delivered_at = now()
 WHERE l.state <> 'delivered'`, ledger),

		// Withdraw our claims whose send is known not to have reached the
		// sink, so whoever delivers next claims afresh.
		release: fmt.Sprintf(`
DELETE FROM %s AS l
 USING unnest($1::text[], $2::text[]) AS t(k, a)
 WHERE l.event_key = t.k AND l.action = t.a AND l.owner = $3 AND l.state = 'sending'`, ledger),

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
   SET status = 'held', last_error = t.err, attempts = t.n, locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $4`, outbox),

		// The aggregates among $1/$2 with no handed-off or held row left
		// unsettled: the stream may deliver their events again. The status
		// list repeats the order index's predicate.
		settled: fmt.Sprintf(`
SELECT t.at, t.ai
  FROM unnest($1::text[], $2::text[]) AS t(at, ai)
 WHERE NOT EXISTS (
       SELECT FROM %s AS o
        WHERE o.aggregate_type = t.at AND o.aggregate_id = t.ai
          AND o.status IN ('pending', 'processing', 'held')
          AND (o.handoff_at IS NOT NULL OR o.status = 'held'))`, outbox),

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

		// The alarm: rows nobody has claimed for $1 ms since they were due,
		// other than the claim path's own. Age counts from the later of
		// created_at and available_at, so a scheduled row is not stuck
		// before it is due. The claim index serves the range.
		stuck: fmt.Sprintf(`
SELECT count(*), COALESCE(EXTRACT(EPOCH FROM max(now() - GREATEST(created_at, available_at))), 0)::float8
  FROM %s
 WHERE status = 'pending' AND handoff_at IS NULL
   AND available_at < now() - $1::bigint * interval '1 millisecond'
   AND GREATEST(created_at, available_at) < now() - $1::bigint * interval '1 millisecond'`, outbox),

		// A pending row with a NULL available_at is never "due" to the
		// claim query; poll mode makes it due now.
		repairDue: fmt.Sprintf(`
UPDATE %s SET available_at = now() WHERE status = 'pending' AND available_at IS NULL`, outbox),

		lockOwner:   fmt.Sprintf(`SELECT pg_try_advisory_lock(%d, hashtext($1))`, ownerLockClass),
		unlockOwner: fmt.Sprintf(`SELECT pg_advisory_unlock(%d, hashtext($1))`, ownerLockClass),
	}
}
