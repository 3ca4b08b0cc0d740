-- outbox-relay verify: the window's rows with their ledger rows, the
-- ledger rows whose outbox row is gone, and the copies at a sink whose row
-- is outside the window (docs/operations.md). Routing is decided in Go
-- (relay.Route.Takes), never in SQL. Every statement only reads.

-- name: VerifySlice
-- At most $3 rows with ids $1 to $2 and their ledger rows in one
-- statement: one snapshot. The LATERAL aggregate probes the ledger's
-- primary key once per row (TestVerify_PlansUseIndexes) and sums the row's
-- ledger rows up as bitmasks over the configured sinks' names ($4), cheap
-- to decode a million times; a sink not configured is named. $5 reads the
-- payload, which a sink's filter reads.
SELECT o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, CASE WHEN $5 THEN o.payload::text END,
       o.status, o.last_error, o.created_at,
       GREATEST(o.created_at, coalesce(o.available_at, o.created_at)),
       l.delivered, l.pending, l.unknown
  FROM {{.Outbox}} AS o
 CROSS JOIN LATERAL (
       SELECT coalesce(bit_or(1::int8 << (array_position($4::text[], x.action) - 1)) FILTER (WHERE x.state = 'delivered'), 0) AS delivered,
              coalesce(bit_or(1::int8 << (array_position($4::text[], x.action) - 1)) FILTER (WHERE x.state <> 'delivered'), 0) AS pending,
              array_agg(x.action) FILTER (WHERE x.action <> ALL ($4::text[])) AS unknown
         FROM {{.Ledger}} AS x
        WHERE x.event_key = o.event_key) AS l
 WHERE o.id >= $1 AND o.id <= $2
 ORDER BY o.id
 LIMIT $3;

-- name: VerifyFirstAfter
SELECT id, created_at FROM {{.Outbox}} WHERE id >= $1 ORDER BY id LIMIT 1;

-- name: VerifyBounds
SELECT min(id), max(id), clock_timestamp() FROM {{.Outbox}};

-- name: VerifyOrphansFirst
-- The ledger by key, a slice of $3 rows from ($1, $2) (included) at a
-- time: the ledger rows of the slice written since $4 (of sink $5; NULL:
-- any) whose key no outbox row has (one probe of the outbox's unique index
-- per such row: OFFSET 0 keeps the NOT EXISTS from becoming an anti-join
-- that reads the whole outbox), then the slice's last key, the walk's next
-- cursor (the last column true).
WITH slice AS MATERIALIZED (
     SELECT l.event_key, l.action, coalesce(l.delivered_at, l.claimed_at) AS at
       FROM {{.Ledger}} AS l
      WHERE (l.event_key, l.action) >= ($1::text, $2::text)
      ORDER BY l.event_key, l.action
      LIMIT $3)
SELECT s.event_key, s.action, s.at, false
  FROM slice AS s
 WHERE s.at >= $4 AND ($5::text IS NULL OR s.action = $5)
   AND NOT EXISTS (SELECT FROM {{.Outbox}} AS o WHERE o.event_key = s.event_key OFFSET 0)
UNION ALL
(SELECT event_key, action, NULL::timestamptz, true FROM slice ORDER BY event_key DESC, action DESC LIMIT 1);

-- name: VerifyOrphansNext
-- VerifyOrphansFirst for a slice after ($1, $2) (excluded).
WITH slice AS MATERIALIZED (
     SELECT l.event_key, l.action, coalesce(l.delivered_at, l.claimed_at) AS at
       FROM {{.Ledger}} AS l
      WHERE (l.event_key, l.action) > ($1::text, $2::text)
      ORDER BY l.event_key, l.action
      LIMIT $3)
SELECT s.event_key, s.action, s.at, false
  FROM slice AS s
 WHERE s.at >= $4 AND ($5::text IS NULL OR s.action = $5)
   AND NOT EXISTS (SELECT FROM {{.Outbox}} AS o WHERE o.event_key = s.event_key OFFSET 0)
UNION ALL
(SELECT event_key, action, NULL::timestamptz, true FROM slice ORDER BY event_key DESC, action DESC LIMIT 1);

-- name: VerifyUnrecorded
-- The copies at sink $2 whose row is outside the window, by key ($1): each
-- key's row (a probe of the unique index on event_key) and whether the
-- ledger shows it delivered to the sink (a probe of its primary key).
-- OFFSET 0 keeps each probe a probe: without it the planner joins a few
-- thousand keys by hashing the whole outbox, and the whole ledger.
SELECT k.key, o.id, o.status, o.last_error,
       EXISTS (SELECT FROM {{.Ledger}} AS l WHERE l.event_key = k.key AND l.action = $2 AND l.state = 'delivered' OFFSET 0)
  FROM unnest($1::text[]) AS k(key)
  LEFT JOIN LATERAL (SELECT x.id, x.status, x.last_error FROM {{.Outbox}} AS x WHERE x.event_key = k.key OFFSET 0) AS o ON true;

-- name: VerifyWindowStart
-- The earliest created_at of the rows with ids $1 to $2.
SELECT min(created_at) FROM {{.Outbox}} WHERE id >= $1 AND id <= $2;
