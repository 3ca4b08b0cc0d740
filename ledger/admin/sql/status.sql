-- outbox-relay status: what the database shows of the relays, their slot,
-- their rows and their progress (docs/operations-health.md, "What
-- outbox-relay status can know"). Every statement only reads.

-- name: StatusCheckpoint
SELECT confirmed_lsn::text, updated_at FROM {{.Checkpoint}} WHERE slot_name = $1;

-- name: StatusCountRows
-- The outbox's rows by status, a NULL status read as pending
-- (docs/schema.md, "A row's states").
SELECT {{.StatusOf "o"}}, count(*) FROM {{.Outbox}} AS o GROUP BY 1;

-- name: StatusOldestPending
SELECT extract(epoch FROM now() - min(o.created_at))::float8 FROM {{.Outbox}} AS o WHERE {{.Pending "o"}};

-- name: StatusDeliveredLastHour
SELECT action, count(*) FROM {{.Ledger}}
 WHERE state = 'delivered' AND delivered_at >= now() - interval '1 hour'
 GROUP BY action;

-- name: StatusSinksDown
-- Per configured sink ($1), the pending rows whose last_error says the
-- sink was down: the engine writes each sink's reason as
-- "sink <name>: <reason>", and a sink that was down as the failure's class
-- ("sink-down: …") or as its open circuit ("circuit open: sink is down").
WITH down AS (
SELECT s.name, count(*) AS waiting, max(o.id) AS newest
  FROM {{.Outbox}} AS o, unnest($1::text[]) AS s(name)
 WHERE o.status = 'pending' AND o.last_error IS NOT NULL
   AND (position('sink ' || s.name || ': sink-down: ' IN o.last_error) > 0
        OR position('sink ' || s.name || ': circuit open: sink is down' IN o.last_error) > 0)
 GROUP BY s.name)
SELECT down.name, down.waiting, coalesce(o.last_error, '') FROM down JOIN {{.Outbox}} AS o ON o.id = down.newest;

-- name: StatusSlot
-- The slot $1 on the server it is on. The retained WAL is measured up to
-- the server's current position; on a standby the last replayed one.
-- to_jsonb(s) ->> 'invalidation_reason' is NULL before 17, which lacks the
-- column.
SELECT coalesce(active_pid, 0), coalesce(wal_status, ''), to_jsonb(s) ->> 'invalidation_reason', confirmed_flush_lsn::text,
       CASE WHEN wal_status <> 'lost' AND to_jsonb(s) ->> 'invalidation_reason' IS NULL THEN
       pg_wal_lsn_diff(w.lsn, restart_lsn)::bigint END,
       CASE WHEN wal_status <> 'lost' AND to_jsonb(s) ->> 'invalidation_reason' IS NULL THEN
       greatest(pg_wal_lsn_diff(w.lsn, confirmed_flush_lsn), 0)::bigint END
  FROM pg_replication_slots s,
       (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END AS lsn) AS w
 WHERE slot_name = $1;

-- name: StatusSession
-- The session of pid $1 (scanSession reads its columns).
SELECT a.pid, coalesce(a.application_name, ''), a.backend_start, coalesce(host(a.client_addr), '')
  FROM pg_stat_activity a WHERE a.pid = $1;

-- name: StatusRelaySessions
-- The sessions of relays in this database (a walsender of a logical slot
-- is connected to its database too). The operator commands
-- (application_name $1…) and this session are not relays.
SELECT a.pid, coalesce(a.application_name, ''), a.backend_start, coalesce(host(a.client_addr), '')
  FROM pg_stat_activity a
 WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
   AND a.application_name LIKE 'outbox-relay%' AND a.application_name NOT LIKE $1 || '%'
 ORDER BY a.backend_start, a.pid;

-- name: StatusLockHolder
-- The session holding the session advisory lock whose classid and objid
-- are $1 and $2 (one bigint key, objsubid 1) in this database.
SELECT a.pid, coalesce(a.application_name, ''), a.backend_start, coalesce(host(a.client_addr), '')
  FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.classid::bigint = $1 AND l.objid::bigint = $2 AND l.objsubid = 1
 LIMIT 1;

-- name: StatusRowsWaiting
-- Rows that have waited longer than $1 seconds: the stream's (pending, not
-- diverted, while the slot exists: $2) by their age, the claim path's
-- by how long they have been due. Without a slot (or with one that cannot
-- be read: a standby that is down, whose rows auto mode delivers from the
-- primary) every pending row is the claim path's. A row that waits behind
-- an earlier event of its aggregate is not one its path could take.
SELECT count(*) FILTER (WHERE stream AND created_at < now() - make_interval(secs => $1)),
       extract(epoch FROM now() - min(created_at) FILTER (WHERE stream AND created_at < now() - make_interval(secs => $1)))::float8,
       count(*) FILTER (WHERE NOT stream AND due < now() - make_interval(secs => $1)),
       extract(epoch FROM now() - min(due) FILTER (WHERE NOT stream AND due < now() - make_interval(secs => $1)))::float8
  FROM (SELECT o.created_at, coalesce(o.available_at, o.created_at) AS due, $2 AND o.handoff_at IS NULL AS stream
          FROM {{.Outbox}} AS o
         WHERE {{.Pending "o"}}
           AND NOT {{.WaitsForEarlier "o"}}) AS w;

-- name: StatusCheckpointAge
SELECT extract(epoch FROM now() - updated_at)::float8 FROM {{.Checkpoint}} WHERE slot_name = $1;

-- name: StatusClaimActivity
-- How long ago the claim path last claimed or settled a row: the latest
-- locked_at, processed_at, or ledger claimed_at or delivered_at.
SELECT extract(epoch FROM now() - greatest(
         (SELECT greatest(max(locked_at), max(processed_at)) FROM {{.Outbox}}),
         (SELECT greatest(max(claimed_at), max(delivered_at)) FROM {{.Ledger}})))::float8;
