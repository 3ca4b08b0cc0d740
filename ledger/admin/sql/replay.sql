-- outbox-relay replay (docs/operations.md).

-- name: Replay
-- Makes the settled rows among ids $1 (done, failed, held, discarded)
-- deliverable again and counts the replay, in one statement: status
-- pending, attempts 0, available_at and handoff_at now, last_error,
-- processed_at and the claim cleared, replays incremented. Every ledger
-- row of the sinks $2 (NULL: every sink) is deleted, delivered or not, so
-- the claim path delivers to those sinks again; the other sinks keep their
-- delivered rows and are skipped. Pending and processing rows are on their
-- way and are not touched.
WITH was AS (
    SELECT o.id
      FROM {{.Outbox}} AS o
     WHERE o.id = ANY($1::bigint[]) AND o.status IN ('done', 'failed', 'held', 'discarded')
       FOR UPDATE),
replayed AS (
    UPDATE {{.Outbox}} AS o
       SET status = 'pending', attempts = 0, available_at = now(), handoff_at = now(),
           last_error = NULL, processed_at = NULL, locked_at = NULL, locked_by = NULL,
           replays = coalesce(o.replays, 0) + 1
      FROM was
     WHERE o.id = was.id
    RETURNING o.id, o.event_key),
cleared AS (
    DELETE FROM {{.Ledger}} AS l USING replayed AS r
     WHERE l.event_key = r.event_key
       AND ($2::text[] IS NULL OR l.action = ANY($2::text[]))
    RETURNING 1)
SELECT (SELECT count(*) FROM replayed), (SELECT count(*) FROM cleared);
