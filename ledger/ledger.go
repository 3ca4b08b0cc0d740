// Package ledger is the PostgreSQL side of the stream path: the idempotency
// ledger, the outbox rows' status as the stream settles them, and the slot's
// checkpoint (SPEC §3).
//
// Every write is conditional on the row still being where the writer expects
// it (status = 'pending', handoff_at IS NULL, ledger state), so every method
// is safe to call again after an error or a crash. Batches go to the server
// as arrays (unnest, = ANY): one statement per kind, never one round trip per
// event.
package ledger

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

var (
	_ relay.Store      = (*Store)(nil)
	_ relay.Checkpoint = (*Store)(nil)
)

// maxIDsPerQuery bounds the arrays sent in one statement, so that a huge
// transaction re-streamed after a restart does not become one giant query.
const maxIDsPerQuery = 10_000

// Config names the tables and chooses the commit mode of the stream's writes.
type Config struct {
	// Outbox, Ledger and Checkpoint are the tables migrate created or
	// adopted. A name left empty takes the default of SPEC §3
	// (integration_outbox, integration_idempotency, relay_checkpoint).
	Outbox, Ledger, Checkpoint relay.QualifiedName

	// AsyncCommit makes Settle commit with synchronous_commit = off. That is
	// safe because the relay acknowledges the slot only after a synchronous
	// checkpoint write, which flushes the WAL of every earlier commit; a
	// crash in between loses only settlements the slot will stream again.
	// DefaultConfig sets it.
	AsyncCommit bool
}

// DefaultConfig returns the table names of SPEC §3 with AsyncCommit on.
func DefaultConfig() Config {
	n := migrations.DefaultNames()
	return Config{Outbox: n.Outbox, Ledger: n.Ledger, Checkpoint: n.Checkpoint, AsyncCommit: true}
}

// Store implements relay.Store and relay.Checkpoint over a connection pool,
// plus the slot-creation hand-over and the pre-send claims of sinks with
// on_unknown: hold. It is safe for concurrent use.
type Store struct {
	pool        *pgxpool.Pool
	asyncCommit bool
	sql         statements
	outbox      string // quoted, for the few statements built elsewhere
}

// statements is every SQL text the Store runs, rendered once with the
// configured names quoted as identifiers.
type statements struct {
	settleDelivered   string
	settleHandOffs    string
	settleDeadLetters string
	restreamed        string
	markDone          string
	diverted          string

	loadCheckpoint string
	saveCheckpoint string

	markForClaim         string
	pendingUnmarked      string
	markForClaimByID     string
	pendingRange         string
	markDeliveredDone    string
	claimSending         string
	hold                 string
	release              string
	setAsyncCommit       string
	setSynchronousCommit string
}

// New returns a Store on pool. Empty names in cfg take the defaults; the
// names are quoted here, once, so no name is ever read as SQL.
func New(pool *pgxpool.Pool, cfg Config) *Store {
	def := DefaultConfig()
	if cfg.Outbox.Name == "" {
		cfg.Outbox = def.Outbox
	}
	if cfg.Ledger.Name == "" {
		cfg.Ledger = def.Ledger
	}
	if cfg.Checkpoint.Name == "" {
		cfg.Checkpoint = def.Checkpoint
	}
	return &Store{
		outbox:      cfg.Outbox.Quoted(),
		pool:        pool,
		asyncCommit: cfg.AsyncCommit,
		sql:         render(cfg.Outbox.Quoted(), cfg.Ledger.Quoted(), cfg.Checkpoint.Quoted()),
	}
}

func render(outbox, ledger, checkpoint string) statements {
	return statements{
		// ON CONFLICT DO UPDATE may touch a row only once per statement, so
		// the pairs are made distinct first; the order makes concurrent
		// settlements lock ledger rows in one order. A pair already
		// delivered is left exactly as it is (insert-only); a 'sending' or
		// 'unknown' claim of a hold sink becomes delivered.
		settleDelivered: fmt.Sprintf(`
INSERT INTO %s AS l (event_key, action, state, attempts, delivered_at)
SELECT t.k, t.a, 'delivered', 1, now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'delivered', delivered_at = now()
 WHERE l.state <> 'delivered'`, ledger),

		// A NULL available_at means "due now"; an empty error keeps the
		// row's previous last_error.
		// Each row change reports, from its own snapshot, the ids it could
		// not see at all: the walsender may send a transaction before the
		// committing backend has left the proc array, so a fast delivery can
		// settle a row no other session sees yet. A separate check would run
		// in a later snapshot and could see the row then, hiding the miss.
		settleHandOffs: fmt.Sprintf(`
WITH t AS (SELECT * FROM unnest($1::bigint[], $2::timestamptz[], $3::text[], $4::int[]) AS t(id, avail, err, n)),
changed AS (
UPDATE %s AS o
   SET handoff_at = now(),
       available_at = COALESCE(t.avail, now()),
       last_error = COALESCE(NULLIF(t.err, ''), o.last_error),
       attempts = COALESCE(o.attempts, 0) + t.n
  FROM t
 WHERE o.id = t.id AND o.status = 'pending' AND o.handoff_at IS NULL
RETURNING o.id)
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM %s v WHERE v.id = t.id)`, outbox, outbox),

		settleDeadLetters: fmt.Sprintf(`
WITH t AS (SELECT * FROM unnest($1::bigint[], $2::text[]) AS t(id, err)),
changed AS (
UPDATE %s AS o
   SET status = 'failed', last_error = t.err, processed_at = now(),
       locked_at = NULL, locked_by = NULL
  FROM t
 WHERE o.id = t.id AND o.status = 'pending'
RETURNING o.id)
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM %s v WHERE v.id = t.id)`, outbox, outbox),

		// The lateral subquery is a prefix scan of the ledger's primary key
		// (event_key, action) per row.
		restreamed: fmt.Sprintf(`
SELECT o.id,
       (o.status = 'pending' AND o.handoff_at IS NULL) IS TRUE,
       d.actions
  FROM %s AS o
  LEFT JOIN LATERAL (
       SELECT array_agg(l.action ORDER BY l.action) AS actions
         FROM %s AS l
        WHERE l.event_key = o.event_key AND l.state = 'delivered') AS d ON true
 WHERE o.id = ANY($1::bigint[])`, outbox, ledger),

		markDone: fmt.Sprintf(`
WITH t AS (SELECT unnest($1::bigint[]) AS id),
changed AS (
UPDATE %s o SET status = 'done', processed_at = now()
  FROM t
 WHERE o.id = t.id AND o.status = 'pending' AND o.handoff_at IS NULL
RETURNING o.id)
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM %s v WHERE v.id = t.id)`, outbox, outbox),

		// The status list repeats the predicate of the ordering index
		// (aggregate_type, aggregate_id, id) WHERE status IN (…), so the
		// planner may scan that small partial index in aggregate order.
		diverted: fmt.Sprintf(`
SELECT DISTINCT aggregate_type, aggregate_id
  FROM %s
 WHERE status IN ('pending', 'processing', 'held')
   AND (handoff_at IS NOT NULL OR status = 'held')
   AND aggregate_type IS NOT NULL AND aggregate_id IS NOT NULL`, outbox),

		loadCheckpoint: fmt.Sprintf(`SELECT confirmed_lsn::text FROM %s WHERE slot_name = $1`, checkpoint),

		// GREATEST: a checkpoint never moves backwards, so a late or
		// reordered save (two relays racing during a takeover, a retry of an
		// older position) cannot make the relay re-ack an older position.
		saveCheckpoint: fmt.Sprintf(`
INSERT INTO %s AS c (slot_name, confirmed_lsn, updated_at)
VALUES ($1, $2::text::pg_lsn, now())
    ON CONFLICT (slot_name) DO UPDATE
   SET confirmed_lsn = GREATEST(c.confirmed_lsn, EXCLUDED.confirmed_lsn), updated_at = now()`, checkpoint),

		markForClaim: fmt.Sprintf(`
UPDATE %s SET handoff_at = now() WHERE status = 'pending' AND handoff_at IS NULL`, outbox),
		pendingUnmarked: fmt.Sprintf(`
SELECT id FROM %s WHERE status = 'pending' AND handoff_at IS NULL`, outbox),
		markForClaimByID: fmt.Sprintf(`
UPDATE %s SET handoff_at = now()
 WHERE id = ANY($1::bigint[]) AND status = 'pending' AND handoff_at IS NULL`, outbox),

		// $1 holds distinct sink names, so the count equals its cardinality
		// exactly when every one of them is delivered. One id range at a
		// time ($2, $3], in id order, skipping rows another statement has
		// locked (the engine's own MarkDone): it runs beside the stream and
		// never waits for, or deadlocks with, it.
		pendingRange: fmt.Sprintf(`
SELECT min(id), max(id) FROM %s WHERE status = 'pending' AND handoff_at IS NULL`, outbox),
		markDeliveredDone: fmt.Sprintf(`
WITH c AS (
SELECT o.id FROM %s AS o
 WHERE o.id > $2 AND o.id <= $3 AND o.status = 'pending' AND o.handoff_at IS NULL
   AND (SELECT count(*) FROM %s AS l
         WHERE l.event_key = o.event_key AND l.action = ANY($1::text[]) AND l.state = 'delivered')
       = cardinality($1::text[])
   FOR UPDATE SKIP LOCKED)
UPDATE %s AS o SET status = 'done', processed_at = now() FROM c WHERE o.id = c.id`, outbox, ledger, outbox),

		// The claim is the insert itself (never check-then-insert). Only an
		// 'unknown' pair — held, then released — may be claimed again.
		claimSending: fmt.Sprintf(`
INSERT INTO %s AS l (event_key, action, state, attempts, owner, claimed_at)
VALUES ($1, $2, 'sending', 1, $3, now())
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'sending', owner = EXCLUDED.owner, claimed_at = now(), attempts = l.attempts + 1
 WHERE l.state = 'unknown'
RETURNING true`, ledger),

		// The row is held only when the pair is not delivered: a delivered
		// pair has a known outcome. A data-modifying CTE runs even when the
		// outer statement does not read it; here the UPDATE reads it.
		hold: fmt.Sprintf(`
WITH unknown AS (
    INSERT INTO %s AS l (event_key, action, state, attempts, detail)
    VALUES ($1, $2, 'unknown', 1, $3)
        ON CONFLICT (event_key, action) DO UPDATE
       SET state = 'unknown', detail = EXCLUDED.detail
     WHERE l.state <> 'delivered'
    RETURNING 1)
UPDATE %s SET status = 'held', last_error = $3
 WHERE id = $4 AND status = 'pending' AND EXISTS (SELECT FROM unknown)`, ledger, outbox),

		// A claim whose send is known not to have happened (nothing was
		// written) is withdrawn, so whoever delivers next may claim afresh.
		release: fmt.Sprintf(`
DELETE FROM %s WHERE event_key = $1 AND action = $2 AND owner = $3 AND state = 'sending'`, ledger),

		setAsyncCommit: `SET LOCAL synchronous_commit = off`,
		// Explicitly synchronous even where the role or database default is
		// off; a stricter server setting (remote_apply) is kept.
		setSynchronousCommit: `SELECT set_config('synchronous_commit', 'on', true)
 WHERE current_setting('synchronous_commit') <> 'remote_apply'`,
	}
}

// inTx runs, in one transaction, the statement that sets the commit mode
// (setCommit; empty keeps the server's default) and then the statements queue
// adds, all sent as one batch: one round trip besides BEGIN and COMMIT. results reads their results in order; the
// transaction commits only when every statement succeeded.
func (s *Store) inTx(ctx context.Context, setCommit string, queue func(*pgx.Batch), results func(pgx.BatchResults) error) error {
	b := &pgx.Batch{}
	if setCommit != "" {
		b.Queue(setCommit)
	}
	queue(b)
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		br := tx.SendBatch(ctx, b)
		err := func() error {
			if setCommit != "" {
				if _, err := br.Exec(); err != nil {
					return fmt.Errorf("set synchronous_commit: %w", err)
				}
			}
			return results(br)
		}()
		if closeErr := br.Close(); err == nil {
			err = closeErr
		}
		return err
	})
}

// chunks splits ids into slices of at most maxIDsPerQuery.
func chunks(ids []int64) [][]int64 {
	var out [][]int64
	for len(ids) > maxIDsPerQuery {
		out = append(out, ids[:maxIDsPerQuery:maxIDsPerQuery])
		ids = ids[maxIDsPerQuery:]
	}
	if len(ids) > 0 {
		out = append(out, ids)
	}
	return out
}
