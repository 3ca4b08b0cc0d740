-- The figures the relay's metrics read (docs/operations.md, "Metrics").

-- name: StatsDiverted
-- The rows diverted to the claim path and pending, the age of the oldest,
-- and the planner's estimate of the outbox's rows.
SELECT (SELECT count(*) FROM {{.Outbox}} WHERE status = 'pending' AND handoff_at IS NOT NULL),
       coalesce((SELECT extract(epoch FROM now() - min(created_at)) FROM {{.Outbox}} WHERE status = 'pending' AND handoff_at IS NOT NULL), 0)::float8,
       greatest((SELECT reltuples FROM pg_class WHERE oid = to_regclass({{.OutboxLiteral}})), 0)::float8

-- name: StatsStatuses
SELECT status, count(*) FROM {{.Outbox}} WHERE status IN ('processing', 'failed', 'held', 'discarded') GROUP BY status
