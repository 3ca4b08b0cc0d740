package claim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/relay"
)

// reconcileBatch bounds the rows one reconcile statement marks, so a large
// backlog is marked in short transactions.
const reconcileBatch = 10_000

// Reconcile marks for the claim path (handoff_at = now()) every row that is
// still pending, not handed off, and was created more than olderThan ago,
// and returns how many it marked. It is `outbox-relay reconcile
// --older-than D`: the repair for rows a slot will never stream (the slot
// was dropped and recreated by someone else while the relay was down). The
// claim path then delivers them; pairs the ledger shows delivered are
// skipped, so rows the stream delivered but did not mark done are only
// settled.
//
// Run it with olderThan well above the stream's lag: a row the stream is
// still delivering when it is marked may reach a sink from both paths. It
// marks in batches of 10,000 rows, each its own transaction, so an error
// leaves earlier batches marked; it is safe to repeat. olderThan must be
// positive.
func Reconcile(ctx context.Context, pool *pgxpool.Pool, outbox relay.QualifiedName, olderThan time.Duration) (int64, error) {
	if olderThan <= 0 {
		return 0, errors.New("reconcile: older-than must be positive")
	}
	if outbox.Name == "" {
		return 0, errors.New("reconcile: no outbox table")
	}
	sql := fmt.Sprintf(`
WITH batch AS (
    SELECT id FROM %[1]s
     WHERE status = 'pending' AND handoff_at IS NULL
       AND created_at < now() - $1::bigint * interval '1 millisecond'
     ORDER BY id
     LIMIT $2
       FOR UPDATE)
UPDATE %[1]s AS o SET handoff_at = now()
  FROM batch
 WHERE o.id = batch.id AND o.status = 'pending' AND o.handoff_at IS NULL`, outbox.Quoted())
	var marked int64
	for {
		tag, err := pool.Exec(ctx, sql, olderThan.Milliseconds(), reconcileBatch)
		if err != nil {
			return marked, fmt.Errorf("reconcile %s: mark rows older than %s for the claim path: %w", outbox, olderThan, err)
		}
		// Stop only at an empty batch: rows settled meanwhile make a batch
		// short without meaning nothing is left.
		if tag.RowsAffected() == 0 {
			return marked, nil
		}
		marked += tag.RowsAffected()
	}
}
