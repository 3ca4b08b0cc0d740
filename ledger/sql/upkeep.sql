-- The claim path's upkeep: leases, owner locks, rows a writer left
-- without a status, and reconcile (docs/operations.md, "reconcile").

-- name: ExpireLeases
-- A processing row whose lease ($1 ms) passed, or whose relay owner
-- (locked_by starting with $2) holds no owner lock, goes back to pending
-- with its attempts. Other lockers (a legacy poller) lose rows only by the
-- lease.
WITH stale AS (
    SELECT o.id, o.locked_by
      FROM {{.Outbox}} AS o
     WHERE o.status = 'processing'
       AND (o.locked_at IS NULL
            OR o.locked_at < now() - $1::bigint * interval '1 millisecond'
            OR (starts_with(o.locked_by, $2) AND NOT {{.OwnerAlive "o.locked_by"}}))
       FOR UPDATE SKIP LOCKED)
UPDATE {{.Outbox}} AS o
   SET status = 'pending', locked_at = NULL, locked_by = NULL,
       -- A claimed row is never the stream's: it stays the claim path's.
       handoff_at = coalesce(o.handoff_at, now())
  FROM stale
 WHERE o.id = stale.id AND o.status = 'processing'
RETURNING o.id, stale.locked_by

-- name: RepairDue
-- A row with a NULL status is pending, and a pending row with a NULL
-- available_at is due (both columns are nullable): the claim query reads
-- status = 'pending' and orders by available_at, so they are written so.
UPDATE {{.Outbox}} SET status = COALESCE(status, 'pending'), available_at = COALESCE(available_at, now())
 WHERE (status IS NULL OR (status = 'pending' AND available_at IS NULL))

-- name: LockOwner
-- The owner lock of owner $1 (OwnerLockClass).
SELECT pg_try_advisory_lock({{.OwnerLockClass}}, hashtext($1))

-- name: UnlockOwner
SELECT pg_advisory_unlock({{.OwnerLockClass}}, hashtext($1))

-- name: ReconcileLock
-- Each reconcile batch locks the checkpoint table against writes for its
-- duration, so that no slot's creation slips between the check and the
-- diverting.
LOCK TABLE {{.Checkpoint}} IN SHARE MODE

-- name: ReconcileUnfinished
-- The slots whose hand-over is not recorded: reconcile takes no row from
-- them.
SELECT slot_name FROM {{.Checkpoint}} WHERE handover_lsn IS NULL ORDER BY slot_name

-- name: ReconcileDivert
-- Up to $2 rows still the stream's and created more than $1 ms ago,
-- diverted to the claim path, due now at the latest.
WITH batch AS (
    SELECT o.id FROM {{.Outbox}} AS o
     WHERE {{.StreamOwned "o"}}
       AND o.created_at < now() - $1::bigint * interval '1 millisecond'
     ORDER BY o.id
     LIMIT $2
       FOR UPDATE)
UPDATE {{.Outbox}} AS o SET status = 'pending', handoff_at = now(), available_at = COALESCE(o.available_at, now())
  FROM batch
 WHERE o.id = batch.id AND {{.StreamOwned "o"}} IS TRUE
