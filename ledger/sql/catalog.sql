-- Statements that read or act on the server's catalogs and functions, not
-- on the relay's tables: the slot, the leader and owner locks' sessions,
-- the WAL positions and the standbys (docs/architecture.md, "Modes";
-- docs/failover.md).

-- name: ServerTimeline
-- The server's system identifier (pg_control_system(), which every role
-- may call) and the timeline it writes WAL on: the first eight hex digits
-- of the current WAL file's name, unlike pg_control_checkpoint() right
-- from the moment a promoted standby accepts writes. Both: a different
-- cluster behind the same host name may well be on the same timeline
-- number.
SELECT (SELECT system_identifier FROM pg_control_system())::text,
       ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int

-- name: WALFlushPosition
SELECT pg_current_wal_flush_lsn()::text

-- name: LogStandbySnapshot
SELECT pg_log_standby_snapshot()

-- name: StandbySlots
-- synchronized_standby_slots ("" before PostgreSQL 17, which lacks it).
SELECT coalesce(current_setting('synchronized_standby_slots', true), '')

-- name: StandbysBehind
-- Of the physical slots $1, those whose standby has not confirmed the WAL
-- position $2.
SELECT coalesce(array_agg(slot_name ORDER BY slot_name), '{}')
  FROM pg_replication_slots
 WHERE slot_name = ANY($1) AND slot_type = 'physical' AND (restart_lsn IS NULL OR restart_lsn < $2::pg_lsn)

-- name: SlotState
-- Whether slot $1 exists, whether a process streams from it, and the WAL
-- it retains: from its restart_lsn to the server's current position, on a
-- standby its replayed one.
SELECT count(*) > 0, coalesce(bool_or(active), false),
       coalesce(max(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END - restart_lsn), 0)::bigint
  FROM pg_replication_slots WHERE slot_name = $1

-- name: SlotRetained
-- Whether slot $1 exists, and the WAL it retains on the primary.
SELECT count(*) > 0, coalesce(max(pg_current_wal_lsn() - restart_lsn), 0)::bigint
  FROM pg_replication_slots WHERE slot_name = $1

-- name: DropIdleSlot
-- Drops slot $1 if it exists and nobody streams from it.
SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active

-- name: SlotWalsender
-- The backend streaming from slot $1.
SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1 AND active

-- name: TerminateBackend
SELECT pg_terminate_backend($1)

-- name: BackendAlive
SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)

-- name: TryLeaderLock
SELECT pg_try_advisory_lock($1)

-- name: LeaderLockHeld
-- Whether this session holds the leader lock $1: the lock is ours only
-- while the session lives; checking pg_locks also catches a session that
-- was reset.
SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
   AND granted AND ((classid::bigint << 32) | objid::bigint) = $1)

-- name: LeaderLockHolder
-- The session holding the single-bigint advisory lock $1 (the leader
-- lock), its state and how long it has been in it.
SELECT a.pid, coalesce(a.state, ''), coalesce(extract(epoch FROM now() - a.state_change), 0)::float8
  FROM pg_locks AS k JOIN pg_stat_activity AS a USING (pid)
 WHERE k.locktype = 'advisory' AND k.granted AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND k.objsubid = 1 AND ((k.classid::bigint << 32) | k.objid::bigint) = $1
 LIMIT 1

-- name: OwnerLockHolder
-- The session holding the owner lock of owner $1 (OwnerLockClass), its
-- state and how long it has been in it.
SELECT a.pid, coalesce(a.state, ''), coalesce(extract(epoch FROM now() - a.state_change), 0)::float8
  FROM pg_locks AS k JOIN pg_stat_activity AS a USING (pid)
 WHERE k.locktype = 'advisory' AND k.granted AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND k.objsubid = 2 AND k.classid = {{.OwnerLockClass}} AND k.objid = hashtext($1)::oid
 LIMIT 1
