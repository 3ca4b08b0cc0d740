-- doctor's failover checks: what the primary can tell about a failover to
-- a physical standby (docs/failover.md).

-- name: FailoverPhysicalStandbys
-- Physical slots, and physical walsenders (no database) without one: the
-- slot ("" for none), whether it streams, whether the standby reports its
-- xmin (hot_standby_feedback) and its application_name.
SELECT s.slot_name, s.active, (s.xmin IS NOT NULL OR r.backend_xmin IS NOT NULL), coalesce(r.application_name, '')
  FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
 WHERE s.slot_type = 'physical'
UNION ALL
SELECT '', true, r.backend_xmin IS NOT NULL, coalesce(r.application_name, '')
  FROM pg_stat_replication r JOIN pg_stat_activity a USING (pid)
 WHERE a.datname IS NULL AND NOT EXISTS (SELECT FROM pg_replication_slots s WHERE s.active_pid = r.pid)
 ORDER BY 1;

-- name: FailoverSlotEnabled
-- The failover property of slot $1 (17+).
SELECT coalesce((to_jsonb(s) ->> 'failover')::bool, false) FROM pg_replication_slots s WHERE slot_name = $1;

-- name: SynchronizedStandbySlots
SELECT coalesce(current_setting('synchronized_standby_slots', true), '');

-- name: CurrentDatabase
SELECT current_database();
