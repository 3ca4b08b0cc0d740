-- The dead-letter queue: dlq list, retry and discard (docs/operations.md).
-- Every status change is conditional on the status the operator saw: a row
-- that moved on in the meantime is left alone and not counted.

-- name: DlqSelectIDs
-- A page of the rows a Selection chooses, by status ($2) read from the
-- status column, through the status index: a page of dead letters reads
-- the dead letters, not the table. $1 is the last id of the page before,
-- $3 the ids, $4 the earliest created_at, $5 a sink the ledger must not
-- show delivered to, $6 the page's size; $7 reads the payload, which a
-- sink's filter reads (relay.Route.Takes).
SELECT o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, CASE WHEN $7 THEN o.payload::text END
  FROM {{.Outbox}} AS o
 WHERE o.id > $1 AND o.status = ANY($2::text[])
   AND ($3::bigint[] IS NULL OR o.id = ANY($3::bigint[]))
   AND ($4::timestamptz IS NULL OR o.created_at >= $4)
   AND ($5::text IS NULL OR NOT EXISTS (
        SELECT 1 FROM {{.Ledger}} AS l WHERE l.event_key = o.event_key AND l.action = $5 AND l.state = 'delivered'))
 ORDER BY o.id
 LIMIT $6;

-- name: DlqSelectIDsWithPending
-- DlqSelectIDs for a selection that takes pending rows: only pending is
-- read otherwise than the status column says (a NULL status is pending).
SELECT o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, CASE WHEN $7 THEN o.payload::text END
  FROM {{.Outbox}} AS o
 WHERE o.id > $1 AND {{.StatusOf "o"}} = ANY($2::text[])
   AND ($3::bigint[] IS NULL OR o.id = ANY($3::bigint[]))
   AND ($4::timestamptz IS NULL OR o.created_at >= $4)
   AND ($5::text IS NULL OR NOT EXISTS (
        SELECT 1 FROM {{.Ledger}} AS l WHERE l.event_key = o.event_key AND l.action = $5 AND l.state = 'delivered'))
 ORDER BY o.id
 LIMIT $6;

-- name: DlqListRows
-- The rows with ids $1; $2 reads their payloads (a sink has a filter).
SELECT o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, coalesce(o.status, ''),
       coalesce(o.attempts, 0)::int4, coalesce(o.replays, 0)::int4, o.last_error,
       o.created_at, o.available_at, o.processed_at, CASE WHEN $2 THEN o.payload::text END
  FROM {{.Outbox}} AS o WHERE o.id = ANY($1::bigint[]) ORDER BY o.id;

-- name: DlqListLedgerRows
SELECT event_key, action, state, attempts, delivered_at, detail
  FROM {{.Ledger}} WHERE event_key = ANY($1::text[]) ORDER BY event_key, action;

-- name: DlqRetry
-- Makes the dead letters, held and discarded rows among ids $1 deliverable
-- again in one statement: status pending, attempts 0, available_at and
-- handoff_at now (the claim path takes diverted rows in replication mode
-- as in poll mode), last_error, processed_at and the claim cleared. The
-- ledger rows of the sinks $2 (NULL: every sink) that are not 'delivered'
-- — 'sending' claims and 'unknown' outcomes — are deleted, so the claim
-- path claims afresh; delivered pairs stay, so a sink that has the event
-- does not get it again. Only rows still failed, held or discarded change.
WITH reset AS (
    UPDATE {{.Outbox}} AS o
       SET status = 'pending', attempts = 0, available_at = now(), handoff_at = now(),
           last_error = NULL, processed_at = NULL, locked_at = NULL, locked_by = NULL
     WHERE o.id = ANY($1::bigint[]) AND o.status IN ('failed', 'held', 'discarded')
    RETURNING o.event_key),
cleared AS (
    DELETE FROM {{.Ledger}} AS l USING reset AS r
     WHERE l.event_key = r.event_key AND l.state <> 'delivered'
       AND ($2::text[] IS NULL OR l.action = ANY($2::text[]))
    RETURNING 1)
SELECT (SELECT count(*) FROM reset), (SELECT count(*) FROM cleared);

-- name: DlqDiscard
-- Settles the dead letters and held rows among ids $1 without delivering
-- them (docs/schema.md, "A row's states"); the ledger is left as it is.
-- Only rows still failed or held change.
UPDATE {{.Outbox}}
   SET status = 'discarded', processed_at = now(), locked_at = NULL, locked_by = NULL
 WHERE id = ANY($1::bigint[]) AND status IN ('failed', 'held');
