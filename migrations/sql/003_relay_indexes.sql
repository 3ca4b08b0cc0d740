---- tern: disable-tx ----
-- Built CONCURRENTLY so writers are never blocked. A build that fails (lock
-- timeout, cancel) leaves an INVALID index that IF NOT EXISTS would skip:
-- migrate drops such an index before every attempt, so the retry rebuilds it.
SET lock_timeout = {{.LockTimeout}};

-- Per-aggregate ordering: "is a lower id of this aggregate still unsettled?"
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.OrderIndexName}}
    ON {{.Outbox}} (aggregate_type, aggregate_id, id)
    WHERE status IN ('pending', 'processing', 'held');

-- The claim query: "pending, due, oldest first … FOR UPDATE SKIP LOCKED".
-- The seed index (status, available_at, created_at) cannot serve it without a
-- sort; this partial index can, and stays small because done rows leave it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.ClaimIndexName}}
    ON {{.Outbox}} (available_at, id)
    WHERE status = 'pending';
