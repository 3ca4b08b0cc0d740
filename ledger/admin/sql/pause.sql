-- The pauses table: one row per paused sink (docs/operations.md).

-- name: PauseSink
-- Pauses sink $1 for reason $2, by $3. A second pause keeps the first
-- one's time, reason and author: the sink has been paused since then. The
-- last column says the sink was paused already.
INSERT INTO {{.Pauses}} AS p (sink, reason, paused_by) VALUES ($1, $2, $3)
ON CONFLICT (sink) DO UPDATE SET sink = p.sink
RETURNING paused_at, reason, paused_by, xmax <> 0;

-- name: ResumeSink
DELETE FROM {{.Pauses}} WHERE sink = $1 RETURNING paused_at;

-- name: ListPauses
SELECT sink, paused_at, reason, paused_by FROM {{.Pauses}} ORDER BY sink;

-- name: PausedSinks
-- The engine's read of the paused sinks (relay.PauseStore).
SELECT sink FROM {{.Pauses}};
