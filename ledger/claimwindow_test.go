package ledger_test

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger"
)

// TestClaimWindowFollowsItsIndexBeforeStatistics: a claim's window (the due
// rows it looks at, oldest first after a cursor) is read through the partial
// index that holds only claimable rows — in replication mode the diversion
// index, in poll mode the claim index — whatever the statistics say. make
// bench's slot-recreated (a slot without the relay's hand-over record behind
// 50,000 rows, fresh events at 1,000/s) showed 180 claims of 136 ms each,
// two thirds of PostgreSQL's time: the table had been analyzed before the
// hand-over, when no row was the claim path's, so the planner costed both
// indexes as holding a handful of rows and read the window through the
// seed's (status, available_at, created_at) index instead, then sorted it.
// That index holds every pending row: the stream's own, which stay pending
// until their marks are written, and the versions of rows since claimed. A
// window found nothing after walking all of them (262 ms for 0 rows).
func TestClaimWindowFollowsItsIndexBeforeStatistics(t *testing.T) {
	if testing.Short() {
		t.Skip("45,000 rows: skipped with -short")
	}
	db := mustClaimDB(t)
	ctx := context.Background()
	for _, table := range []string{"integration_outbox", "integration_idempotency"} {
		db.exec(t, `ALTER TABLE `+table+` SET (autovacuum_enabled = off)`)
	}
	// A backlog behind a foreign slot, never analyzed (the relay starts
	// right after it was written).
	db.exec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at)
		SELECT 'order.placed', 'order', 'backlog-' || (g % 1000), 'backlog-' || g, '{}', now() - interval '1 minute'
		  FROM generate_series(1, 20000) AS g`)
	// The hand-over; the claim path then settles most of the backlog while
	// the stream delivers 25,000 fresh events whose marks are not written
	// yet (pending, not the claim path's).
	db.exec(t, `UPDATE integration_outbox SET handoff_at = now() WHERE status = 'pending'`)
	db.exec(t, `UPDATE integration_outbox SET status = 'done', processed_at = now() WHERE id <= 18000`)
	db.exec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at)
		SELECT 'order.placed', 'order', 'fresh-' || (g % 1000), 'fresh-' || g, '{}', now() - interval '30 seconds'
		  FROM generate_series(1, 25000) AS g`)
	db.exec(t, `
		INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		SELECT event_key, 'nats', 'delivered', 1, now() FROM integration_outbox WHERE event_key LIKE 'fresh-%'`)
	// Versions left by the updates are seen dead once (as a relay's claims
	// would after the first few), so that what is left is the plan.
	db.exec(t, `SELECT count(*) FROM integration_outbox WHERE status = 'pending' AND available_at <= now()`)

	conn, err := db.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	type statement struct {
		name, index string
		sql         string
		args        []any
	}
	var statements []statement
	for _, m := range []struct {
		name   string
		all    bool
		newest bool
		index  string
	}{
		{"replication mode", false, false, "integration_outbox_relay_handoff_idx"},
		{"replication mode, newest first", false, true, "integration_outbox_relay_handoff_idx"},
		{"poll mode", true, false, "integration_outbox_relay_claim_idx"},
	} {
		sql, args, err := db.store.ClaimStatement(500, ledger.NewOwner(), m.all)
		if m.newest {
			sql, args, err = db.store.ClaimNewestStatement(500, ledger.NewOwner())
		}
		if err != nil {
			t.Fatal(err)
		}
		st := statement{m.name, m.index, sql, args}
		if _, err := conn.Exec(ctx, fmt.Sprintf("PREPARE s%d AS %s", len(statements), sql), pgx.QueryExecModeSimpleProtocol); err != nil {
			t.Fatal(err)
		}
		statements = append(statements, st)
	}
	explain := func(stage string) {
		for i, st := range statements {
			for _, cache := range []string{"force_custom_plan", "force_generic_plan"} {
				lines := explainPrepared(t, conn, cache, db.store.ClaimTxSetting(), "", fmt.Sprintf("s%d", i), st.args)
				plan := strings.Join(lines, "\n")
				window := windowScan(lines)
				switch {
				case !strings.Contains(window, st.index):
					t.Errorf("%s, %s, %s: the window is not read through %s but by %q:\n%s", stage, st.name, cache, st.index, window, plan)
				case rowsExamined(lines) > 5000:
					t.Errorf("%s, %s, %s: examines %d rows for a window of 2,000:\n%s", stage, st.name, cache, rowsExamined(lines), plan)
				case strings.Contains(plan, "JIT:"):
					// The planner's cost of a disabled sort passes
					// jit_above_cost: each execution would be compiled.
					t.Errorf("%s, %s, %s: compiled by JIT:\n%s", stage, st.name, cache, plan)
				default:
					t.Logf("%s, %s, %s: %s; %s", stage, st.name, cache, window, lines[len(lines)-1])
				}
			}
		}
	}
	explain("never analyzed")
	db.exec(t, `ANALYZE integration_outbox`)
	explain("analyzed")
}

// windowScan is the first scan of the outbox in the plan of the claim's
// window (the CTE win).
func windowScan(lines []string) string {
	in := false
	scan := regexp.MustCompile(`(Index Scan|Index Only Scan|Bitmap Index Scan|Seq Scan)( Backward)?( using \S+)? on \S+`)
	for _, l := range lines {
		if strings.Contains(l, "CTE win") {
			in = true
			continue
		}
		if in {
			if m := scan.FindString(l); m != "" {
				return m
			}
		}
	}
	return ""
}
