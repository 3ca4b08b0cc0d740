-- The stream's statements (docs/architecture.md, "One event's path").
--
-- Each row change reports, from its own snapshot, the ids it could not see
-- at all: the walsender may send a transaction before the committing
-- backend has left the proc array (with synchronous replication, until a
-- standby confirms it), so a fast delivery can settle a row no other
-- session sees yet. A separate check would run in a later snapshot and
-- could see the row then, hiding the miss.
--
-- Batch statements find their rows by key whatever the statistics say
-- (docs/performance.md, "Plans that do not depend on statistics"): an
-- outbox row by its id (the transaction turns sequential scans off, so the
-- join with the batch probes the primary key per row), a ledger pair by
-- (event_key, action), and every NOT EXISTS probes per row (OFFSET 0 keeps
-- it a subplan instead of an anti-join, which on a table grown since its
-- last ANALYZE, or with a plan cached while it was small, hashed or sorted
-- the whole table for each batch).

-- name: StreamDeliveredNew
-- The stream's usual write: a pair it delivered and did not claim has no
-- ledger row. A plain INSERT of the pairs the ledger lacks costs less per
-- row than ON CONFLICT's speculative insertion, and half the WAL records
-- for the walsender to decode (docs/performance.md). A pair with another
-- row than a delivered one (a claim) raises a unique violation, and
-- SettleStream writes the batch again with DeliveredPairs.
INSERT INTO {{.Ledger}} (event_key, action, state, attempts, claimed_at, delivered_at)
SELECT t.k, t.a, 'delivered', 1, now(), now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
 WHERE NOT EXISTS (SELECT FROM {{.Ledger}} AS l WHERE l.event_key = t.k AND l.action = t.a AND l.state = 'delivered' OFFSET 0)

-- name: StreamDone
-- Delivered to every sink it is routed to (or routed to none): the row's
-- status is done, written in the transaction of its delivered ledger rows,
-- so that no reader ever asks the ledger whether a row is delivered
-- (docs/schema.md, "A row's states").
WITH t AS (SELECT * FROM unnest($1::bigint[]) AS t(id)),
changed AS (
UPDATE {{.Outbox}} AS o
   SET status = 'done', processed_at = now()
  FROM t
 WHERE o.id = t.id AND {{.StreamOwned "o"}} IS TRUE
RETURNING o.id)
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM {{.Outbox}} v WHERE v.id = t.id OFFSET 0)

-- name: StreamDivert
-- Diverted: the row becomes the claim path's, due at available_at, its
-- status written pending (pending.go).
WITH t AS (SELECT * FROM unnest($1::bigint[], $2::timestamptz[], $3::text[], $4::int[]) AS t(id, avail, err, n)),
changed AS (
UPDATE {{.Outbox}} AS o
   SET status = 'pending',
       handoff_at = now(),
       available_at = COALESCE(t.avail, now()),
       last_error = COALESCE(NULLIF(t.err, ''), o.last_error),
       attempts = GREATEST(COALESCE(o.attempts, 0), t.n)
  FROM t
 WHERE o.id = t.id AND {{.StreamOwned "o"}} IS TRUE
RETURNING o.id)
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM {{.Outbox}} v WHERE v.id = t.id OFFSET 0)

-- name: StreamDeadLetter
WITH t AS (SELECT * FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)),
changed AS (
UPDATE {{.Outbox}} AS o
   SET status = 'failed', last_error = t.err, attempts = GREATEST(COALESCE(o.attempts, 0), t.n),
       processed_at = now(), locked_at = NULL, locked_by = NULL
  FROM t
 WHERE o.id = t.id AND {{.StreamOwned "o"}} IS TRUE
RETURNING o.id)
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM {{.Outbox}} v WHERE v.id = t.id OFFSET 0)

-- name: StreamHold
WITH t AS (SELECT * FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)),
changed AS (
UPDATE {{.Outbox}} AS o
   SET status = 'held', last_error = t.err, attempts = GREATEST(COALESCE(o.attempts, 0), t.n),
       processed_at = now()
  FROM t
 WHERE o.id = t.id AND {{.StreamOwned "o"}} IS TRUE
RETURNING o.id)
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM {{.Outbox}} v WHERE v.id = t.id OFFSET 0)

-- name: StreamPairsUnknown
-- A pair whose outcome is unknown at a sink that holds such events:
-- 'unknown' (never claimed again but by dlq retry). A pair the ledger
-- shows delivered has a known outcome and is left alone.
INSERT INTO {{.Ledger}} AS l (event_key, action, state, attempts, detail)
SELECT t.k, t.a, 'unknown', 1, t.d
  FROM (SELECT DISTINCT ON (k, a) k, a, d FROM unnest($1::text[], $2::text[], $3::text[]) AS u(k, a, d) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'unknown', detail = EXCLUDED.detail
 WHERE l.state <> 'delivered'

-- name: Restreamed
-- A row is still the stream's while it is pending and not diverted. One
-- probe of the outbox's primary key per id, and one of the ledger's by its
-- prefix event_key per row, whatever the statistics (as `o.id = ANY($1)`
-- the planner scanned the outbox for a few hundred ids). Planned at each
-- call.
SELECT o.id,
       {{.StreamOwned "o"}} IS TRUE,
       d.actions
  FROM (SELECT DISTINCT id FROM unnest($1::bigint[]) AS u(id)) AS t
 CROSS JOIN LATERAL (SELECT o.id, o.status, o.handoff_at, o.event_key FROM {{.Outbox}} AS o WHERE o.id = t.id OFFSET 0) AS o
  LEFT JOIN LATERAL (
       SELECT array_agg(l.action ORDER BY l.action) AS actions
         FROM {{.Ledger}} AS l
        WHERE l.event_key = o.event_key AND l.state = 'delivered') AS d ON true

-- name: StreamGone
-- The ids among $1 whose row does not exist although its insert is
-- visible: the row was deleted, not waiting to become visible. A row read
-- from the table (xid 0: a hand-over's, a claimed one) was visible when
-- read; a streamed row's inserting transaction ($2, a 32-bit xid widened
-- with the snapshot's epoch) is asked of the snapshot.
WITH s AS (SELECT pg_current_snapshot() AS snap),
e AS (SELECT snap, pg_snapshot_xmax(snap)::text::bigint AS xmax FROM s)
SELECT t.id
  FROM unnest($1::bigint[], $2::bigint[]) AS t(id, xid), e
 WHERE NOT EXISTS (SELECT FROM {{.Outbox}} AS o WHERE o.id = t.id)
   AND (t.xid = 0 OR pg_visible_in_snapshot(
         (((e.xmax >> 32) - CASE WHEN t.xid > (e.xmax & 4294967295) THEN 1 ELSE 0 END) << 32 | t.xid)::text::xid8,
         e.snap))

-- name: StreamClaimPairs
-- The claim before sending is the insert itself (never
-- check-then-insert). Only an 'unknown' pair (held, then released by dlq
-- retry) may be claimed again.
INSERT INTO {{.Ledger}} AS l (event_key, action, state, attempts, owner, claimed_at)
SELECT t.k, t.a, 'sending', 1, $3, now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'sending', owner = EXCLUDED.owner, claimed_at = now(), attempts = l.attempts + 1
 WHERE l.state = 'unknown'
RETURNING l.event_key, l.action

-- name: DivertedAggregates
-- Read at every stream session's start, before its first event. Pending
-- rows may be a large backlog the stream owns (a slot recreated behind it:
-- every fresh event waits for this read): the diverted ones are read
-- through the diversion index (its predicate repeated), the claimed and
-- held ones through the status index.
SELECT aggregate_type, aggregate_id
  FROM {{.Outbox}}
 WHERE status = 'pending' AND handoff_at IS NOT NULL
   AND aggregate_type IS NOT NULL AND aggregate_id IS NOT NULL
UNION
SELECT aggregate_type, aggregate_id
  FROM {{.Outbox}}
 WHERE status IN ('processing', 'held') AND (handoff_at IS NOT NULL OR status = 'held')
   AND aggregate_type IS NOT NULL AND aggregate_id IS NOT NULL
