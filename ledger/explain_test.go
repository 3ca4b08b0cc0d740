package ledger_test

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger"
)

// The claim query uses the partial claim index for the scan and the partial
// order index for the ordering check — no sequential scan of the outbox —
// on 100,000 rows, both as a backlog (all pending) and in steady state
// (most rows done, their ledger pairs delivered).
func TestClaimQueryUsesPartialIndexes(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 rows: skipped with -short")
	}
	db := mustClaimDB(t, ledger.Sink{Name: "all"}, ledger.Sink{Name: "orders", Events: []string{"order.*", "refund.[a-c]?"}})
	ctx := context.Background()
	db.exec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, handoff_at,
		                                created_at, available_at)
		SELECT CASE WHEN g % 7 = 0 THEN 'invoice.sent' ELSE 'order.placed' END, 'order', 'agg-' || (g % 5000),
		       'evt-' || g, jsonb_build_object('n', g), CASE WHEN g % 2 = 0 THEN now() END,
		       now() - (100000 - g) * interval '1 millisecond', now() - (100000 - g) * interval '1 millisecond'
		  FROM generate_series(1, 100000) AS g`)

	explain := func(t *testing.T, stage string) {
		for _, mode := range []struct {
			name  string
			all   bool
			index string // the scan's partial index
		}{{"poll mode", true, "integration_outbox_relay_claim_idx"}, {"replication mode", false, "integration_outbox_relay_handoff_idx"}} {
			sql, args, err := db.store.ClaimStatement(500, ledger.NewOwner(), mode.all)
			if err != nil {
				t.Fatal(err)
			}
			plan := explainClaim(t, db, "EXPLAIN (COSTS OFF) "+sql, args)
			t.Logf("%s, %s: claim plan:\n%s", stage, mode.name, plan)
			for _, index := range []string{mode.index, "integration_outbox_relay_order_idx"} {
				if !strings.Contains(plan, index) {
					t.Errorf("%s, %s: the plan does not use %s", stage, mode.name, index)
				}
			}
			if regexp.MustCompile(`Seq Scan on integration_outbox\b`).MatchString(plan) {
				t.Errorf("%s, %s: the plan scans the outbox sequentially", stage, mode.name)
			}
			// Measured, then rolled back.
			err = pgx.BeginFunc(ctx, db.pool, func(tx pgx.Tx) error {
				rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) "+sql, args...)
				if err != nil {
					return err
				}
				lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
				if err != nil {
					return err
				}
				t.Logf("%s, %s: %s", stage, mode.name, lines[len(lines)-1])
				return errExplainRollback
			})
			if !errors.Is(err, errExplainRollback) {
				t.Fatal(err)
			}
		}
	}

	db.exec(t, `ANALYZE integration_outbox`)
	explain(t, "backlog of 100,000 pending rows")

	// Steady state: 90% done and delivered; the rest pending.
	db.exec(t, `UPDATE integration_outbox SET status = 'done' WHERE id % 10 <> 0`)
	db.exec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		SELECT event_key, s.name, 'delivered', 1, now()
		  FROM integration_outbox, (VALUES ('all'), ('orders')) AS s(name) WHERE status = 'done'`)
	db.exec(t, `VACUUM ANALYZE integration_outbox`)
	db.exec(t, `VACUUM ANALYZE integration_idempotency`)
	explain(t, "100,000 rows, 10% pending")
}

var errExplainRollback = errors.New("rollback")

func explainClaim(tb testing.TB, db *claimDB, sql string, args []any) string {
	tb.Helper()
	rows, err := db.pool.Query(context.Background(), sql, args...)
	if err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	return strings.Join(lines, "\n")
}
