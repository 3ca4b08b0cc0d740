-- The pending scan (scan.go): the rows still the stream's that it has not
-- settled, watched by id. A row's due time is the later of created_at and
-- available_at (a NULL available_at counts as created_at), so a scheduled
-- row is not stuck before it is due.

-- name: ScanStart
SELECT min(o.id) FROM {{.Outbox}} AS o WHERE {{.StreamOwned "o"}}

-- name: ScanTop
SELECT max(id) FROM {{.Outbox}}

-- name: ScanRange
-- The rows of the id range ($1, $2] still the stream's. It finds its rows
-- by id alone: the status test is wrapped in "(…) IS TRUE", which no index
-- serves, or the planner (before the outbox's first ANALYZE) combined the
-- ids with the status index's entries for every pending row, the claim
-- path's backlog included (TestPendingScanReadsItsIdsBeforeStatistics).
SELECT o.id, GREATEST(o.created_at, COALESCE(o.available_at, o.created_at)), true FROM {{.Outbox}} AS o WHERE o.id > $1 AND o.id <= $2 AND ({{.StreamOwned "o"}}) IS TRUE

-- name: ScanRecheck
-- The watch list's ids $1 still watched: a claimed row stays watched, as
-- the claim path may put it back. The ids may lie far apart (a row stuck
-- for hours among the last second's): a probe of the primary key each,
-- whatever the statistics (as "o.id = ANY($1)" the planner scanned the
-- whole outbox before its first ANALYZE).
SELECT o.id, GREATEST(o.created_at, COALESCE(o.available_at, o.created_at)), {{.Pending "o"}}
  FROM (SELECT DISTINCT id FROM unnest($1::bigint[]) AS u(id)) AS t
 CROSS JOIN LATERAL (SELECT * FROM {{.Outbox}} AS o WHERE o.id = t.id OFFSET 0) AS o
 WHERE (({{.Pending "o"}} OR o.status = 'processing') AND o.handoff_at IS NULL) IS TRUE
