---- tern: disable-tx ----
-- The order index of 003 holds the unsettled rows (pending, processing,
-- held) by aggregate; a row with a NULL status is pending too (the column
-- is nullable: docs/schema.md, "NULL status"), so this index holds it as
-- well, and replaces that one. Every reader of an aggregate's unsettled
-- rows (the claim's ordering check, a new slot's hand-over) then finds such
-- a row through it. Built CONCURRENTLY, like 003; the old index is dropped
-- CONCURRENTLY once this one is valid (a build cut short is dropped and
-- built again by migrate).
SET lock_timeout = {{.LockTimeout}};

CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.UnsettledIndexName}}
    ON {{.Outbox}} (aggregate_type, aggregate_id, id)
    WHERE status IN ('pending', 'processing', 'held') OR status IS NULL;

DROP INDEX CONCURRENTLY IF EXISTS {{.OrderIndex}};
