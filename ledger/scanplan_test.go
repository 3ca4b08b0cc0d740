package ledger_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestPendingScanReadsItsIdsBeforeStatistics: the pending scan reads the
// outbox by id — a range of new ids, and the watch list's ids again — and
// must find those rows through the primary key alone. make bench's
// slot-recreated showed it reading every pending row besides: before the
// outbox's first ANALYZE the planner took the seed's status index for
// "status = 'pending'" as selective and combined it with the ids in a
// bitmap, which read the status index's entries for all 50,000 backlog rows
// diverted to the claim path, for a watch list of a few thousand ids (205 ms
// a recheck, 13% of a core through the phase).
func TestPendingScanReadsItsIdsBeforeStatistics(t *testing.T) {
	if testing.Short() {
		t.Skip("40,000 rows: skipped with -short")
	}
	db := mustClaimDB(t)
	ctx := context.Background()
	db.exec(t, `ALTER TABLE integration_outbox SET (autovacuum_enabled = off)`)
	// 38,000 rows diverted to the claim path, then 2,000 of the stream's that
	// no sink has yet: the watch list.
	db.exec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, handoff_at)
		SELECT 'order.placed', 'order', 'backlog-' || (g % 1000), 'backlog-' || g, '{}', now()
		  FROM generate_series(1, 38000) AS g`)
	var ids []int64
	rows, err := db.pool.Query(ctx, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'order.placed', 'order', 'fresh-' || (g % 1000), 'fresh-' || g, '{}'
		  FROM generate_series(1, 2000) AS g
		RETURNING id`)
	if err != nil {
		t.Fatal(err)
	}
	if ids, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		t.Fatal(err)
	}
	conn, err := db.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	rng, recheck := db.store.ScanStatements()
	statements := []struct {
		name, sql string
		args      []any
		read      int // rows the ids name
	}{
		{"range", rng, []any{ids[0] - 10000, ids[0] + 9999}, 10000},
		{"recheck", recheck, []any{ids}, len(ids)},
	}
	for i, st := range statements {
		if _, err := conn.Exec(ctx, fmt.Sprintf("PREPARE scan%d AS %s", i, st.sql), pgx.QueryExecModeSimpleProtocol); err != nil {
			t.Fatal(err)
		}
	}
	explain := func(stage string) {
		for i, st := range statements {
			for _, cache := range []string{"force_custom_plan", "force_generic_plan"} {
				lines := explainPrepared(t, conn, cache, "", ", COSTS OFF", fmt.Sprintf("scan%d", i), st.args)
				plan := strings.Join(lines, "\n")
				switch n := rowsExamined(lines); {
				case strings.Contains(plan, "integration_outbox_status_available_at_created_at_idx"):
					t.Errorf("%s, %s, %s: reads the status index:\n%s", stage, st.name, cache, plan)
				case n > 2*st.read:
					t.Errorf("%s, %s, %s: examines %d rows for %d ids:\n%s", stage, st.name, cache, n, st.read, plan)
				default:
					t.Logf("%s, %s, %s: %d rows examined; %s", stage, st.name, cache, n, lines[len(lines)-1])
				}
			}
		}
	}
	explain("never analyzed")
	db.exec(t, `ANALYZE integration_outbox`)
	explain("analyzed")
}
