-- outbox-relay event: one event's outbox row, its ledger rows and the
-- earlier event of its aggregate it waits behind. Every statement only
-- reads.

-- name: EventByID
-- The outbox row with id $1; $2 reads its payload (a sink has a filter).
SELECT o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, o.status,
       coalesce(o.attempts, 0)::int4, coalesce(o.replays, 0)::int4, o.last_error,
       o.created_at, o.available_at, o.handoff_at, o.locked_at, o.locked_by, o.processed_at,
       octet_length(o.payload::text)::int8, CASE WHEN $2 THEN o.payload::text END
  FROM {{.Outbox}} AS o WHERE o.id = $1;

-- name: EventByKey
-- EventByID for the row whose event_key is $1.
SELECT o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, o.status,
       coalesce(o.attempts, 0)::int4, coalesce(o.replays, 0)::int4, o.last_error,
       o.created_at, o.available_at, o.handoff_at, o.locked_at, o.locked_by, o.processed_at,
       octet_length(o.payload::text)::int8, CASE WHEN $2 THEN o.payload::text END
  FROM {{.Outbox}} AS o WHERE o.event_key = $1;

-- name: EventLedgerRowsLeft
-- The ledger rows of an event key $1 the outbox no longer holds.
SELECT count(*) FROM {{.Ledger}} WHERE event_key = $1;

-- name: EventLedgerRows
SELECT action, state, attempts, owner, claimed_at, delivered_at, next_attempt_at, detail
  FROM {{.Ledger}} WHERE event_key = $1 ORDER BY action;

-- name: EventWaitsBehind
-- The oldest earlier event ($3: the event's id) of the aggregate $1, $2
-- that is not settled: the head of the line the event waits in
-- (docs/guarantees.md, "per-aggregate order").
SELECT p.id, p.event_key, p.status FROM {{.Outbox}} AS p
 WHERE p.aggregate_type = $1 AND p.aggregate_id = $2 AND p.id < $3
   AND {{.Unsettled "p"}}
 ORDER BY p.id LIMIT 1;
