-- doctor's checks of the publication, the relay's slot and the settings
-- that bound what a slot retains (docs/operations.md). Every statement
-- only reads.

-- name: SlotPublication
-- Whether publication $1 covers table $2 (a quoted name), publishes every
-- table, publishes inserts, and publishes anything besides.
SELECT EXISTS (SELECT 1 FROM pg_publication_rel r WHERE r.prpubid = p.oid AND r.prrelid = to_regclass($2)),
       p.puballtables, p.pubinsert, p.pubupdate OR p.pubdelete OR p.pubtruncate
  FROM pg_publication p WHERE p.pubname = $1;

-- name: SlotState
-- The slot $1, the session streaming from it and its last reply.
SELECT s.slot_type, coalesce(s.plugin, ''), coalesce(s.database, ''), coalesce(s.database = current_database(), false),
       coalesce(s.wal_status, ''), coalesce(to_jsonb(s) ->> 'invalidation_reason', ''), s.active, coalesce(s.active_pid, 0),
       -- an invalidated slot retains nothing, whatever restart_lsn says (18 keeps it)
       CASE WHEN s.wal_status <> 'lost' AND to_jsonb(s) ->> 'invalidation_reason' IS NULL
            THEN pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint END,
       coalesce(a.application_name, ''), a.backend_start, coalesce(host(a.client_addr), ''),
       extract(epoch FROM now() - r.reply_time)::float8
  FROM pg_replication_slots s
  LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
  LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
 WHERE s.slot_name = $1;

-- name: SlotHandOverRecorded
-- Whether the checkpoint records the relay's hand-over for slot $1.
SELECT EXISTS (SELECT FROM {{.Checkpoint}} WHERE slot_name = $1 AND handover_lsn IS NOT NULL);

-- name: SlotStreamOwnedRows
-- The rows still the stream's (ledger.StreamOwned).
SELECT count(*) FROM {{.Outbox}} AS o WHERE {{.StreamOwned "o"}};

-- name: SlotMaxWALKeepSize
SELECT setting::bigint FROM pg_settings WHERE name = 'max_slot_wal_keep_size';

-- name: SlotIdleTimeout
SELECT setting::bigint FROM pg_settings WHERE name = 'idle_replication_slot_timeout';
