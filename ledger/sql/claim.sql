-- The claim path (docs/architecture.md, "The claim path"): claim a batch of
-- due rows with one statement (claim_runs.sql), claim their (event, sink)
-- pairs in the ledger before sending, and settle each batch in one
-- synchronous transaction, every change conditional on the row or claim
-- still being this owner's.

-- name: ClaimPairsTakeOver
-- The claim before sending is the insert itself (never check-then-insert).
-- An existing pair is taken when it is 'unknown' (held, then released by
-- dlq retry, or left by a send whose outcome was unknown), or 'sending'
-- with its lease ($4 ms) passed, its owner gone (owner lock free), or this
-- owner's own (left by a failed settlement). Taking a 'sending' pair is an
-- unknown outcome; the caller tells that case by the state it read before,
-- or by attempts > 1 when the pair appeared since. Pairs are locked in key
-- order.
INSERT INTO {{.Ledger}} AS l (event_key, action, state, attempts, owner, claimed_at)
SELECT t.k, t.a, 'sending', 1, $3, now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'sending', owner = EXCLUDED.owner, claimed_at = now(), attempts = l.attempts + 1
 WHERE l.state = 'unknown'
    OR (l.state = 'sending'
        AND (l.owner IS NULL OR l.owner = EXCLUDED.owner OR l.claimed_at IS NULL
             OR l.claimed_at < now() - $4::bigint * interval '1 millisecond'
             OR NOT {{.OwnerAlive "l.owner"}}))
RETURNING l.event_key, l.action, l.attempts

-- name: ClaimedPairsUnknown
-- Our claim's outcome is unknown: held for a person (next attempt NULL),
-- or to be sent again by whoever claims the row next.
UPDATE {{.Ledger}} AS l
   SET state = 'unknown', detail = t.d, next_attempt_at = now() + t.delay * interval '1 millisecond'
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS t(k, a, d, delay)
 WHERE l.event_key = t.k AND l.action = t.a AND l.owner = $5 AND l.state = 'sending'

-- name: ClaimedDone
-- Every status change is conditional on the row still being ours.
UPDATE {{.Outbox}}
   SET status = 'done', processed_at = now(), locked_at = NULL, locked_by = NULL
 WHERE id = ANY($1::bigint[]) AND status = 'processing' AND locked_by = $2

-- name: ClaimedFailed
UPDATE {{.Outbox}} AS o
   SET status = 'failed', last_error = t.err, attempts = t.n, processed_at = now(),
       locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $4

-- name: ClaimedRetry
-- Back to pending, still the claim path's (handoff_at is kept). A NULL
-- error keeps the previous last_error.
UPDATE {{.Outbox}} AS o
   SET status = 'pending', attempts = t.n, available_at = now() + t.delay * interval '1 millisecond',
       last_error = COALESCE(t.err, o.last_error), locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::int[]) AS t(id, delay, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $5

-- name: ClaimedHeld
UPDATE {{.Outbox}} AS o
   SET status = 'held', last_error = t.err, attempts = t.n, processed_at = now(),
       locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $4

-- name: ClaimedMissing
-- The ids among $1 without a row: deleted since they were claimed
-- (relay.StreamStore.Gone). One probe of the primary key per id.
SELECT t.id FROM unnest($1::bigint[]) AS t(id)
 WHERE NOT EXISTS (SELECT FROM {{.Outbox}} AS o WHERE o.id = t.id OFFSET 0)

-- name: SettledAggregates
-- The aggregates among $1/$2 with no diverted or held row left unsettled:
-- the stream may deliver their events again. The status list repeats the
-- order index's predicate (Unsettled).
SELECT t.at, t.ai
  FROM unnest($1::text[], $2::text[]) AS t(at, ai)
 WHERE NOT EXISTS (
       SELECT FROM {{.Outbox}} AS o
        WHERE o.aggregate_type = t.at AND o.aggregate_id = t.ai
          AND {{.Unsettled "o"}}
          AND (o.handoff_at IS NOT NULL OR o.status = 'held'))

-- name: ReleaseOwned
-- The rows processing under owner $1 back to pending, still the claim
-- path's, and the owner's 'sending' claims of them withdrawn.
WITH back AS (
UPDATE {{.Outbox}} AS o SET status = 'pending', locked_at = NULL, locked_by = NULL,
       handoff_at = coalesce(o.handoff_at, now())
 WHERE o.status = 'processing' AND o.locked_by = $1
RETURNING o.event_key),
withdrawn AS (
DELETE FROM {{.Ledger}} AS l USING back WHERE l.event_key = back.event_key AND l.owner = $1 AND l.state = 'sending')
SELECT count(*) FROM back

-- name: ExtendRowLeases
-- A lease is renewed while its rows are being delivered.
UPDATE {{.Outbox}} SET locked_at = now()
 WHERE id = ANY($1::bigint[]) AND status = 'processing' AND locked_by = $2

-- name: ExtendPairClaims
UPDATE {{.Ledger}} AS l SET claimed_at = now()
 WHERE l.event_key = ANY(ARRAY(SELECT o.event_key FROM {{.Outbox}} AS o WHERE o.id = ANY($1::bigint[])))
   AND l.owner = $2 AND l.state = 'sending'
