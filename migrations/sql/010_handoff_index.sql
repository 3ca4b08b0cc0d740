---- tern: disable-tx ----
-- The claim query in replication mode takes only rows handed to the claim
-- path. Rows the stream delivered stay pending (their status is derived from
-- the delivered record), so the claim index (available_at, id) WHERE status =
-- 'pending' holds them too; this one holds only the rows the claim path owns,
-- and stays small. Built CONCURRENTLY, like 003.
SET lock_timeout = {{.LockTimeout}};

CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.DivertedIndexName}}
    ON {{.Outbox}} (available_at, id)
    WHERE status = 'pending' AND handoff_at IS NOT NULL;
