-- doctor's checks of decoding on a standby (source.standby_url) and of
-- what the primary shows of it (docs/failover.md). Every statement only
-- reads.

-- name: StandbySettings
-- On the standby: its version, whether it is in recovery, its settings
-- and its cluster's system identifier.
SELECT current_setting('server_version_num')::int, pg_is_in_recovery(),
       current_setting('wal_level'), current_setting('hot_standby_feedback')::bool,
       current_setting('primary_slot_name'), (SELECT system_identifier FROM pg_control_system())::text;

-- name: StandbySystemIdentifier
SELECT (SELECT system_identifier FROM pg_control_system())::text;

-- name: StandbyPrimaryLeftoverSlot
-- On the primary: the slot $1, which must not be there while the relay
-- decodes on the standby.
SELECT active, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
  FROM pg_replication_slots WHERE slot_name = $1;

-- name: StandbyPhysicalSlot
-- On the primary: the standby's physical slot $1, whether it streams and
-- whether it holds back an xmin (hot_standby_feedback).
SELECT active, xmin IS NOT NULL OR catalog_xmin IS NOT NULL
  FROM pg_replication_slots WHERE slot_name = $1 AND slot_type = 'physical';

-- name: StandbyMayLogSnapshot
SELECT has_function_privilege('pg_log_standby_snapshot()', 'EXECUTE');

-- name: StandbySlot
-- On the standby: the relay's slot $1 and the WAL it retains.
SELECT s.active, coalesce(s.wal_status, ''), coalesce((to_jsonb(s) ->> 'conflicting')::bool, false),
       coalesce(to_jsonb(s) ->> 'invalidation_reason', ''),
       pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END, s.restart_lsn)::bigint
  FROM pg_replication_slots s WHERE s.slot_name = $1;

-- name: StandbyPrimaryFlushLSN
SELECT pg_current_wal_flush_lsn()::text;

-- name: StandbyReplayedLSN
SELECT pg_last_wal_replay_lsn()::text;
