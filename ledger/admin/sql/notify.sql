-- The dead-letter notifier's store: each channel's mark in the notify
-- table, and the dead letters after it (docs/operations.md).

-- name: NotifyHorizon
-- The notifier's horizon: the start of the oldest transaction of the
-- relay's role open in this database, or now. A row is dead-lettered or
-- held by the relay with processed_at = now(), its transaction's start,
-- and commits later: a row settled before the horizon belongs to a
-- transaction that has ended, and a statement run after this one sees it.
-- Only the relay's role settles rows, so the applications' transactions
-- (however long) do not hold the horizon back; walsenders and autovacuum
-- are not client backends.
SELECT coalesce(min(a.xact_start), now()) AS at
  FROM pg_stat_activity AS a
 WHERE a.datname = current_database() AND a.usename = current_user
   AND a.backend_type = 'client backend' AND a.xact_start IS NOT NULL;

-- name: NotifyMarks
-- The marks of the channels $1. A channel seen for the first time starts
-- at the horizon (h: NotifyHorizon's query). The insert's rows are not
-- visible to the statement's own SELECT, so each channel comes from one
-- side of the UNION.
WITH h AS (
SELECT coalesce(min(a.xact_start), now()) AS at
  FROM pg_stat_activity AS a
 WHERE a.datname = current_database() AND a.usename = current_user
   AND a.backend_type = 'client backend' AND a.xact_start IS NOT NULL),
added AS (
INSERT INTO {{.NotifyState}} AS s (channel, notified_at, notified_id)
SELECT c, h.at, 0 FROM unnest($1::text[]) AS c, h
    ON CONFLICT (channel) DO NOTHING
RETURNING s.channel, s.notified_at, s.notified_id)
SELECT channel, notified_at, notified_id FROM added
UNION ALL
SELECT channel, notified_at, notified_id FROM {{.NotifyState}} WHERE channel = ANY($1::text[]);

-- name: NotifyRead
-- At most $4 dead letters after the mark ($1, $2) settled before the
-- horizon $3, in mark order. The status list and the order repeat the
-- dead-letter index's predicate and columns (migration 015).
SELECT o.id, o.processed_at, o.event_key, o.status, coalesce(o.last_error, '')
  FROM {{.Outbox}} AS o
 WHERE o.status IN ('failed', 'held')
   AND (o.processed_at, o.id) > ($1::timestamptz, $2::bigint)
   AND o.processed_at < $3::timestamptz
 ORDER BY o.processed_at, o.id
 LIMIT $4;

-- name: NotifyClaim
-- Takes channel $1's next notification for relay $5: only while the mark
-- is the one the caller read ($2, $3), and no relay attempted a
-- notification of the channel in the last $4 microseconds.
UPDATE {{.NotifyState}}
   SET attempted_at = now(), attempted_by = $5
 WHERE channel = $1 AND notified_at = $2 AND notified_id = $3
   AND (attempted_at IS NULL OR attempted_at <= now() - $4::bigint * interval '1 microsecond')
RETURNING attempted_at;

-- name: NotifyRecord
-- Moves the mark of channel $1, claimed by $2 at $3, to ($4, $5). A mark
-- never moves back.
UPDATE {{.NotifyState}}
   SET notified_at = CASE WHEN (notified_at, notified_id) < ($4::timestamptz, $5::bigint) THEN $4 ELSE notified_at END,
       notified_id = CASE WHEN (notified_at, notified_id) < ($4::timestamptz, $5::bigint) THEN $5 ELSE notified_id END,
       sent_at = now()
 WHERE channel = $1 AND attempted_by = $2 AND attempted_at = $3;

-- name: NotifyPass
-- Moves the marks of the channels $1 that are before ($2, $3) up to it.
UPDATE {{.NotifyState}} SET notified_at = $2, notified_id = $3
 WHERE channel = ANY($1::text[]) AND (notified_at, notified_id) < ($2::timestamptz, $3::bigint);

-- name: NotifyTableAccess
-- Whether the notify table $1 (a quoted name) exists, the role, and
-- whether the role may read and write it.
SELECT to_regclass($1) IS NOT NULL, current_user,
       coalesce(has_table_privilege(to_regclass($1), 'SELECT')
            AND has_table_privilege(to_regclass($1), 'INSERT')
            AND has_table_privilege(to_regclass($1), 'UPDATE'), false);
