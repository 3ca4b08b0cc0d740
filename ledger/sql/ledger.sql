-- The ledger's pairs, (event, sink), as both the stream and the claim path
-- read and write them (docs/schema.md).

-- name: LedgerPairs
-- The ledger's pairs of some event keys: one prefix probe of the primary
-- key (event_key, action) per key. Written as a lateral subquery that is
-- not pulled up (OFFSET 0), so the plan does not depend on the ledger's
-- statistics: as `event_key = ANY($1)` the planner, knowing nothing of
-- event_key alone on a ledger grown since its last ANALYZE, counted 0.5% of
-- the table per key and scanned all of it for a batch of keys
-- (docs/performance.md, "Plans that do not depend on statistics").
SELECT p.event_key, p.action, p.state, p.owner
  FROM (SELECT DISTINCT k FROM unnest($1::text[]) AS u(k)) AS t
 CROSS JOIN LATERAL (SELECT event_key, action, state, owner FROM {{.Ledger}} WHERE event_key = t.k OFFSET 0) AS p

-- name: DeliveredPairs
-- Delivered ledger pairs, as the stream writes them when a plain insert
-- met another row of a pair (StreamDeliveredNew). ON CONFLICT DO UPDATE
-- may touch a row only once per statement, so the pairs are made distinct
-- first; the order makes concurrent settlements lock ledger rows in one
-- order. A pair already delivered is left exactly as it is (insert-only);
-- a claim ('sending', 'unknown') becomes delivered.
INSERT INTO {{.Ledger}} AS l (event_key, action, state, attempts, owner, claimed_at, delivered_at)
SELECT t.k, t.a, 'delivered', 1, NULL::text, now(), now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'delivered', delivered_at = now()
 WHERE l.state <> 'delivered'

-- name: DeliveredOwnPairs
-- Delivered ledger pairs, as the claim path writes them: as DeliveredPairs,
-- but a 'sending' claim becomes delivered only when it is the owner's ($3)
-- own.
INSERT INTO {{.Ledger}} AS l (event_key, action, state, attempts, owner, claimed_at, delivered_at)
SELECT t.k, t.a, 'delivered', 1, $3, now(), now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'delivered', delivered_at = now()
 WHERE l.state <> 'delivered' AND (l.state <> 'sending' OR l.owner = EXCLUDED.owner)

-- name: ReleasePairs
-- Withdraws the owner's ($3) claims whose send is known not to have
-- reached the sink, so whoever delivers next claims afresh.
DELETE FROM {{.Ledger}} AS l
 USING unnest($1::text[], $2::text[]) AS t(k, a)
 WHERE l.event_key = t.k AND l.action = t.a AND l.owner = $3 AND l.state = 'sending'
