-- A new slot's hand-over (docs/architecture.md, "Slot creation"): the rows
-- pending in the slot's snapshot, which the slot will never stream, are
-- delivered by the relay (or, on a standby, diverted to the claim path),
-- and the checkpoint records when that is done.

-- name: BeginSlot
-- The hand-over record: a slot being created has none yet.
INSERT INTO {{.Checkpoint}} AS c (slot_name, confirmed_lsn, updated_at, handover_lsn)
VALUES ($1, '0/0', now(), NULL)
    ON CONFLICT (slot_name) DO UPDATE SET handover_lsn = NULL, updated_at = now()

-- name: HandedOver
UPDATE {{.Checkpoint}} SET handover_lsn = $2::text::pg_lsn, confirmed_lsn = GREATEST(confirmed_lsn, $2::text::pg_lsn), updated_at = now()
 WHERE slot_name = $1

-- name: HandOverDone
SELECT handover_lsn IS NOT NULL FROM {{.Checkpoint}} WHERE slot_name = $1

-- name: HandOverRead
-- A slice of a hand-over's rows, read again to be delivered: those still
-- the stream's (pending, not diverted).
SELECT o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, o.payload::text,
       o.created_at, COALESCE(o.attempts, 0), o.available_at, o.trace_context::text
  FROM {{.Outbox}} AS o
 WHERE o.id = ANY($1::bigint[]) AND {{.StreamOwned "o"}} IS TRUE

-- name: PayloadSizes
-- The payload bytes of the rows $1, which a hand-over's slices are cut by
-- before their payloads are read.
SELECT o.id, {{.PayloadBytes "o"}} FROM {{.Outbox}} AS o WHERE o.id = ANY($1::bigint[])

-- name: SnapshotPending
-- The rows pending in a new slot's snapshot, not diverted: the rows the
-- slot will never stream, to deliver (or, on a standby, to divert to the
-- claim path).
SELECT o.id, o.aggregate_type, o.aggregate_id FROM {{.Outbox}} AS o
 WHERE {{.StreamOwned "o"}}

-- name: SnapshotPendingAmong
-- Which of the aggregates $1, $2 (in pairs) have rows in a new slot's
-- snapshot, asked by the stream while SnapshotPending runs: the order
-- index (aggregate_type, aggregate_id, id) answers, and the index of rows
-- with a NULL status (migration 013) adds those.
SELECT DISTINCT o.aggregate_type, o.aggregate_id FROM {{.Outbox}} AS o
 WHERE (o.aggregate_type, o.aggregate_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))
   AND {{.StreamOwned "o"}}

-- name: MaxID
SELECT COALESCE(max(id), 0) FROM {{.Outbox}}

-- name: SnapshotEarly
-- The rows pending in a new slot's snapshot with an id in ($1, $2] (the
-- newest ids), of those whose aggregate has no other row pending there (or
-- none): what NewestUnblocked feeds before the whole read ends. The ids
-- are a range of the primary key, whatever the backlog: ORDER BY id DESC
-- LIMIT was planned as a scan of every pending row and a sort, and a range
-- open above with the claim index's predicate as a scan of that whole
-- index or, without statistics (a backlog just written), of the table. A
-- range closed on both sides is planned on the primary key either way, and
-- the status is tested as IS TRUE, which no partial index's predicate
-- matches. An aggregate's count stops one past its rows among them.
WITH newest AS MATERIALIZED (
SELECT o.id, o.aggregate_type, o.aggregate_id FROM {{.Outbox}} AS o
 WHERE o.id > $1 AND o.id <= $2 AND {{.StreamOwned "o"}} IS TRUE),
counts AS (
SELECT aggregate_type, aggregate_id, count(*) AS n FROM newest
 WHERE aggregate_type IS NOT NULL AND aggregate_id IS NOT NULL
 GROUP BY aggregate_type, aggregate_id),
complete AS (
SELECT c.aggregate_type, c.aggregate_id FROM counts AS c
 WHERE (SELECT count(*) FROM (SELECT FROM {{.Outbox}} AS o
         WHERE o.aggregate_type = c.aggregate_type AND o.aggregate_id = c.aggregate_id
           AND {{.StreamOwned "o"}}
         LIMIT c.n + 1) AS r) = c.n)
SELECT n.id, n.aggregate_type, n.aggregate_id FROM newest AS n
 WHERE n.aggregate_type IS NULL OR n.aggregate_id IS NULL
    OR (n.aggregate_type, n.aggregate_id) IN (SELECT aggregate_type, aggregate_id FROM complete)
 ORDER BY n.id

-- name: DivertByID
-- The rows $1 still the stream's, diverted to the claim path, due now at
-- the latest (a standby's hand-over).
UPDATE {{.Outbox}} AS o SET status = 'pending', handoff_at = now(), available_at = COALESCE(o.available_at, now())
 WHERE o.id = ANY($1::bigint[]) AND {{.StreamOwned "o"}} IS TRUE
