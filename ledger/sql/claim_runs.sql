-- The claim of runs (docs/guarantees.md, "Claim runs"), rendered three
-- times: replication mode's window of the rows diverted to the claim path,
-- oldest first; the same window newest first (Claim's share for the
-- aggregates the stream diverts behind a backlog); and poll mode's window
-- of every due row. Each reads its window through its own partial index
-- (the diversion index, or the claim index in poll mode) in the index's
-- order, so the switches stay in the text: a parameter could not pick the
-- index nor the order.

-- name: ClaimRuns
-- River's JobGetAvailable shape, with the ordering decided once per
-- aggregate over a window of due rows (river's JobSchedule: a per-key
-- decision over the batch, not a correlated subquery per candidate row).
--
-- The ordering check: a row waits while a lower id of its aggregate is
-- unsettled (Unsettled: pending, a NULL status included, processing or
-- held; done, failed and discarded rows never block). The status is the
-- row's one state: the stream's settlement writes done in the transaction
-- of its delivered ledger rows, so the check reads nothing else
-- (docs/schema.md, "A row's states"). Unsettled is the order index's
-- predicate, so the planner can use it. The check looks for the nearest
-- unsettled row below a run's head, walking the order index down (a scalar
-- subquery with ORDER BY … DESC LIMIT 1: an EXISTS would drop the ORDER BY
-- and walk up from the aggregate's first row). The order index holds only
-- unsettled rows, so the walk never passes the aggregate's settled history
-- (TestClaimCostIndependentOfStreamedHistory).
--
-- win: up to $5 due rows, oldest first (newest first in the newest
-- window), after the cursor ($3, $4), through the claim index (poll mode)
-- or the diversion index. No lock and no ordering check per row, so the
-- scan costs one index entry a row however many of them wait behind their
-- aggregate. With ordering: none the rows have no aggregate.
-- aggs: the window's aggregates, oldest first (newest first in the newest
-- window), at most $1, each with its lowest row in the window.
-- heads, starts: where each aggregate's run starts (the ordering check,
-- once per aggregate): its window row when no lower row is unsettled;
-- when the nearest such row is claimable too (concurrent writers leave
-- available_at out of id order, so it may lie outside the window), the
-- aggregate's lowest such row if that is claimable; otherwise no run.
-- pick: from each start up the order index, the aggregate's unsettled rows
-- while they are claimable, at most $1 / aggregates each, and at least
-- ClaimRunRows: a run ends before a row not due yet, the stream's, held,
-- or processing under another claim.
-- chosen: whole runs, oldest aggregate first, at most $1 rows whose
-- payloads take at most $6 bytes (the first row whatever its size), so
-- each aggregate keeps a prefix; only these rows' sizes are read.
-- locked: chosen rows locked, skipping rows another claimer locked (found
-- by id: "(…) IS TRUE" keeps the planner from reaching them through a
-- partial index whose statistics a hand-over has just made stale, which
-- scanned all of them for each chosen row).
-- kept: of each aggregate only the prefix locked without a gap, so that a
-- run never passes a row another relay is claiming.
-- claimed: a claimed row is the claim path's from then on (handoff_at set,
-- as the lease sweeper does), in poll mode too: a relay that streams next
-- diverts the aggregate's new events behind it and its re-stream check
-- skips it (TestPollClaimMakesRowsTheClaimPaths).
-- The checks read every unsettled row (processing ones too), locked or
-- not: a run never starts behind, nor passes, a row another relay has
-- claimed and not settled.
WITH win AS MATERIALIZED (
    SELECT o.id, o.available_at AS due, {{if .Unordered}}NULL::text AS at, NULL::text AS ai{{else}}o.aggregate_type AS at, o.aggregate_id AS ai{{end}}
      FROM {{.Outbox}} AS o
     WHERE o.status = 'pending'
       AND o.available_at <= now(){{if not .PollMode}}
       AND o.handoff_at IS NOT NULL{{end}}
       AND (o.available_at, o.id) > ($3::timestamptz, $4::bigint)
     ORDER BY {{if .Newest}}o.available_at DESC, o.id DESC{{else}}o.available_at, o.id{{end}}
     LIMIT $5),
summary AS (
    SELECT (SELECT count(*) FROM win)::int AS n, last.due AS last_due, last.id AS last_id
      FROM (SELECT NULL) AS one
      LEFT JOIN (SELECT w.due, w.id FROM win AS w ORDER BY w.due DESC, w.id DESC LIMIT 1) AS last ON true),
aggs AS (
    SELECT w.at, w.ai, min(w.id) AS head, row_number() OVER (ORDER BY {{if .Newest}}max(w.due) DESC, max(w.id) DESC{{else}}min(w.due), min(w.id){{end}}) AS rank
      FROM win AS w
     WHERE w.at IS NOT NULL AND w.ai IS NOT NULL
     GROUP BY w.at, w.ai
     ORDER BY {{if .Newest}}max(w.due) DESC, max(w.id) DESC{{else}}min(w.due), min(w.id){{end}}
     LIMIT $1),
heads AS MATERIALIZED (
    SELECT a.at, a.ai, a.head, a.rank, b.id AS below, b.ok AS below_ok
      FROM aggs AS a
      LEFT JOIN LATERAL (
           SELECT p.id, (p.status = 'pending' AND p.available_at <= now(){{if not .PollMode}} AND p.handoff_at IS NOT NULL{{end}}) AS ok FROM {{.Outbox}} AS p
            WHERE p.aggregate_type = a.at AND p.aggregate_id = a.ai
              AND p.id < a.head
              AND {{.Unsettled "p"}}
            ORDER BY p.id DESC
            LIMIT 1) AS b ON true),
starts AS MATERIALIZED (
    SELECT h.at, h.ai, h.head, h.rank FROM heads AS h WHERE h.below IS NULL
    UNION ALL
    SELECT h.at, h.ai, f.id, h.rank
      FROM heads AS h
      JOIN LATERAL (
           SELECT p.id, (p.status = 'pending' AND p.available_at <= now(){{if not .PollMode}} AND p.handoff_at IS NOT NULL{{end}}) AS ok FROM {{.Outbox}} AS p
            WHERE p.aggregate_type = h.at AND p.aggregate_id = h.ai
              AND {{.Unsettled "p"}}
            ORDER BY p.id
            LIMIT 1) AS f ON f.ok
     WHERE h.below_ok),
per AS (
    SELECT GREATEST(($1 + count(*) - 1) / GREATEST(count(*), 1), {{.ClaimRunRows}}) AS n FROM starts),
pick AS (
    SELECT r.id, s.at, s.ai, s.rank, row_number() OVER (PARTITION BY s.at, s.ai ORDER BY r.id) AS rn
      FROM starts AS s
     CROSS JOIN LATERAL (
           SELECT p.id, bool_and(p.status = 'pending' AND p.available_at <= now(){{if not .PollMode}} AND p.handoff_at IS NOT NULL{{end}}) OVER (ORDER BY p.id) AS ok FROM {{.Outbox}} AS p
            WHERE p.aggregate_type = s.at AND p.aggregate_id = s.ai
              AND p.id >= s.head
              AND {{.Unsettled "p"}}
            ORDER BY p.id
            LIMIT (SELECT per.n FROM per)) AS r
     WHERE r.ok
    UNION ALL
    SELECT w.id, NULL, NULL, 0, 1 FROM win AS w WHERE w.at IS NULL OR w.ai IS NULL),
chosen AS (
    SELECT c.id, c.at, c.ai, c.rn
      FROM (SELECT c.id, c.at, c.ai, c.rn,
                   sum((SELECT {{.PayloadBytes "o"}} FROM {{.Outbox}} AS o WHERE o.id = c.id)) OVER w AS upto,
                   row_number() OVER w AS k
              FROM (SELECT c.id, c.at, c.ai, c.rn, c.rank FROM pick AS c ORDER BY c.rank, c.rn, c.id LIMIT $1) AS c
            WINDOW w AS (ORDER BY c.rank, c.rn, c.id)) AS c
     WHERE c.k = 1 OR c.upto <= $6::bigint),
locked AS (
    SELECT o.id, c.at, c.ai, c.rn
      FROM {{.Outbox}} AS o JOIN chosen AS c ON c.id = o.id
     WHERE (o.status = 'pending'
            AND o.available_at <= now(){{if not .PollMode}}
       AND o.handoff_at IS NOT NULL{{end}}) IS TRUE
       FOR UPDATE OF o SKIP LOCKED),
kept AS (
    SELECT l.id
      FROM (SELECT l.id, l.at, l.ai, l.rn,
                   row_number() OVER (PARTITION BY l.at, l.ai ORDER BY l.id) AS lrn
              FROM locked AS l) AS l
     WHERE l.at IS NULL OR l.ai IS NULL OR l.rn = l.lrn),
claimed AS (
UPDATE {{.Outbox}} AS o
   SET status = 'processing', locked_at = now(), locked_by = $2,
       handoff_at = coalesce(o.handoff_at, now())
  FROM kept
 WHERE o.id = kept.id
RETURNING o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, o.payload::text,
          o.created_at, COALESCE(o.attempts, 0), o.available_at, COALESCE(o.replays, 0) AS replays, o.trace_context::text AS trace)
SELECT s.n, s.last_due, s.last_id, c.*
  FROM summary AS s LEFT JOIN claimed AS c ON true
 ORDER BY c.id
