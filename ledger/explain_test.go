package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// The claim query uses the partial claim index for the scan and the partial
// order index for the ordering check — no sequential scan of the outbox —
// on 100,000 rows, both as a backlog (all pending) and in steady state
// (most rows done, their ledger pairs delivered).
func TestClaimQueryUsesPartialIndexes(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 rows: skipped with -short")
	}
	db := mustClaimDB(t)
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
			for _, index := range []string{mode.index, "integration_outbox_relay_unsettled_idx"} {
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

// TestClaimCostIndependentOfStreamedHistory: the ordering check must not
// walk an aggregate's history for every diverted row. With 200
// aggregates, each 300 rows the stream delivered (done, written in its
// settlement, and so out of the order index) followed by 30 diverted ones
// (an outage diverted them, and the aggregates' later events followed them
// to the claim path), a claim reads a few dozen buffers per diverted row.
// Walking every earlier row of the aggregate for every row cost about 900
// per row (make chaos, full profile: a 27 s claim over 53,000 diverted
// rows, the claim path at about 40 events/s, the backlog never drained).
func TestClaimCostIndependentOfStreamedHistory(t *testing.T) {
	db := mustClaimDB(t)
	ctx := context.Background()
	const aggs, streamed, handed = 200, 300, 30
	db.exec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, handoff_at, available_at,
		                                status, processed_at)
		SELECT 'order.updated', 'order', 'agg-' || a, 'evt-' || a || '-' || n, '{}',
		       CASE WHEN n > $2::int THEN now() END, now() - interval '1 minute',
		       CASE WHEN n > $2::int THEN 'pending' ELSE 'done' END, CASE WHEN n <= $2::int THEN now() END
		  FROM generate_series(1, $2::int + $3::int) AS n, generate_series(1, $1::int) AS a
		 ORDER BY n, a`, aggs, streamed, handed)
	db.exec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		SELECT o.event_key, s.sink, 'delivered', 1, now() FROM integration_outbox o, (VALUES ('nats'), ('hook')) AS s(sink)
		 WHERE o.handoff_at IS NULL`)
	db.exec(t, `VACUUM ANALYZE integration_outbox`)
	db.exec(t, `VACUUM ANALYZE integration_idempotency`)

	sql, args, err := db.store.ClaimStatement(500, ledger.NewOwner(), false)
	if err != nil {
		t.Fatal(err)
	}
	var plan []string
	var claimed int
	err = pgx.BeginFunc(ctx, db.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY ON) "+sql, args...)
		if err != nil {
			return err
		}
		if plan, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM integration_outbox WHERE status = 'processing'`).Scan(&claimed); err != nil {
			return err
		}
		return errExplainRollback
	})
	if !errors.Is(err, errExplainRollback) {
		t.Fatal(err)
	}
	text := strings.Join(plan, "\n")
	// Runs: each aggregate's diverted rows, up to the limit of 500.
	if claimed != 500 {
		t.Fatalf("claimed %d rows, want 500 (runs of the diverted rows of the aggregates)\n%s", claimed, text)
	}
	m := regexp.MustCompile(`Buffers: shared hit=(\d+)`).FindStringSubmatch(text)
	if m == nil {
		t.Fatalf("no buffer count in the plan:\n%s", text)
	}
	hits, _ := strconv.Atoi(m[1])
	perRow := float64(hits) / (aggs * handed)
	t.Logf("%d buffer hits for %d diverted rows behind %d streamed ones: %.1f per row; %s", hits, aggs*handed, aggs*streamed, perRow, plan[len(plan)-1])
	if perRow > 100 {
		t.Errorf("the claim read %.1f buffers per diverted row (%d in all), want at most 100: the ordering check walks the streamed history for every row\n%s", perRow, hits, text)
	}
}

// explainBuffers runs sql under EXPLAIN (ANALYZE, BUFFERS) on the
// fixture's pool and returns the buffers its top node touched (hit and
// read) and the plan.
func explainBuffers(tb testing.TB, f *fixture, sql string, args ...any) (int, string) {
	tb.Helper()
	rows, err := f.pool.Query(context.Background(), "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) "+sql, args...)
	if err != nil {
		tb.Fatal(err)
	}
	plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		tb.Fatal(err)
	}
	text := strings.Join(plan, "\n")
	m := regexp.MustCompile(`Buffers: shared hit=(\d+)(?: read=(\d+))?`).FindStringSubmatch(text)
	if m == nil {
		tb.Fatalf("no buffer count in the plan:\n%s", text)
	}
	hits, _ := strconv.Atoi(m[1])
	read, _ := strconv.Atoi(m[2])
	return hits + read, text
}

// TestDivertedCostIndependentOfTheStreamsBacklog: every stream session
// reads the diverted aggregates before its first event. Behind a recreated
// slot 200,000 rows were pending, the stream's own; the read walked all of
// them (the order index holds every pending row) and took 0.75 s in make
// bench's slot-recreated, the fresh events waiting. It must read only the
// diverted, claimed and held rows, whatever the pending backlog.
func TestDivertedCostIndependentOfTheStreamsBacklog(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustExec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'e', 'order', (g % 2000)::text, 'backlog-' || g, '{}' FROM generate_series(1, 20000) AS g`)
	f.MustInsert(t,
		row{Key: "handed", AggType: ptr("order"), AggID: ptr("handed"), Diverted: true},
		row{Key: "held", AggType: ptr("order"), AggID: ptr("held"), Status: "held"},
		row{Key: "claimed", AggType: ptr("order"), AggID: ptr("claimed"), Status: "processing", Diverted: true})
	f.MustExec(t, `VACUUM ANALYZE integration_outbox`)
	buffers, text := explainBuffers(t, f, f.store.DivertedStatement())
	t.Logf("the diverted read touched %d buffers behind 20,000 pending rows", buffers)
	if buffers > 50 {
		t.Errorf("the diverted read touched %d buffers, want at most 50: it walks the pending backlog\n%s", buffers, text)
	}
	got, err := f.store.Diverted(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Errorf("Diverted = %v, want the diverted, held and claimed aggregates", got)
	}
}

// TestEarlyCostIndependentOfTheBacklog: NewestUnblocked runs while the whole read of
// a new slot's snapshot runs, for the events committed just before the
// slot; it must read the newest rows and a row or two of each of their
// aggregates, not the backlog behind them.
func TestEarlyCostIndependentOfTheBacklog(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustExec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'e', 'order', (g % 500)::text, 'backlog-' || g, '{}' FROM generate_series(1, 50000) AS g`)
	f.MustExec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'e', 'fresh', g::text, 'fresh-' || g, '{}' FROM generate_series(1, 300) AS g`)
	// Not analyzed: a backlog just written, as in make bench.
	var above int64
	if err := f.pool.QueryRow(ctx, `SELECT max(id) - 1000 FROM integration_outbox`).Scan(&above); err != nil {
		t.Fatal(err)
	}
	buffers, text := explainBuffers(t, f, f.store.EarlyStatement(), above, above+1000)
	t.Logf("NewestUnblocked's read touched %d buffers behind 50,000 pending rows", buffers)
	// The newest 1,000 rows and each of their aggregates' first rows: a
	// few thousand buffers. Not every pending row sorted by id, nor the
	// whole claim index (make bench: 0.1 s of the query's 0.15 s).
	if buffers > 4000 || !strings.Contains(text, "integration_outbox_pkey") {
		t.Errorf("NewestUnblocked's read touched %d buffers: it reads the backlog\n%s", buffers, text)
	}
	var n int
	if err := f.pool.QueryRow(ctx, "SELECT count(*) FROM ("+f.store.EarlyStatement()+") AS e", above, above+1000).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 300 {
		t.Errorf("NewestUnblocked took %d rows, want the 300 fresh ones", n)
	}
}

// TestRestreamedCheckProbesTheLedger: after a reconnect every event
// committed before it is checked against the ledger (PrepareStream's
// re-stream check, a transaction's ids at a time). The check must probe
// the ledger by key, not scan it: make bench's write-back drain once
// showed a sequential scan of the stream's record of delivery in each of
// its 287 checks, 10 ms at the start and 25 ms at 48,600 recorded ids
// (148 us of PostgreSQL time per event). Two plans did it: one cached
// while the record was empty (a scan per id: generic plans are forced
// here, and the check runs once before the ledger fills), and a fresh one
// that hashed the whole record for a hundred ids, which the planner costs
// as cheap. pg_stat_user_tables counts the scans; closing the connection
// reports them.
func TestRestreamedCheckProbesTheLedger(t *testing.T) {
	for _, c := range []struct {
		name          string
		planCacheMode string
		recorded      int
	}{
		{"a plan cached while the ledger was empty", "force_generic_plan", 190000},
		{"a plan made for the ids against a ledger of 40,000", "auto", 40000},
	} {
		t.Run(c.name, func(t *testing.T) { testRestreamedCheckProbes(t, c.planCacheMode, c.recorded) })
	}
}

// analyzedOneConnStore vacuums and analyzes the outbox and the ledger, and
// returns a store on a pool of one connection with plan_cache_mode set, so
// that its statements' scans are reported when the pool closes.
func analyzedOneConnStore(t *testing.T, f *fixture, planCacheMode string) (*pgxpool.Pool, *ledger.Store) {
	t.Helper()
	f.MustExec(t, `VACUUM ANALYZE integration_outbox`)
	f.MustExec(t, `VACUUM ANALYZE integration_idempotency`)
	cfg, err := pgxpool.ParseConfig(f.url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	cfg.ConnConfig.RuntimeParams["plan_cache_mode"] = planCacheMode
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, mustStore(t, pool, ledger.DefaultConfig())
}

// ledgerScans returns the sequential and index scans of the ledger
// pg_stat_user_tables has counted.
func ledgerScans(t *testing.T, f *fixture) (seq, idx int64) {
	t.Helper()
	ctx := context.Background()
	if _, err := f.pool.Exec(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
		t.Fatal(err)
	}
	if err := f.pool.QueryRow(ctx, `SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE relname = 'integration_idempotency'`).Scan(&seq, &idx); err != nil {
		t.Fatal(err)
	}
	return seq, idx
}

// deliveredSQL writes nats's delivered ledger rows for the outbox ids 1 to $1.
const deliveredSQL = `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
	SELECT event_key, 'nats', 'delivered', 1, now() FROM integration_outbox WHERE id <= $1`

func testRestreamedCheckProbes(t *testing.T, planCacheMode string, recorded int) {
	f := MustFixture(t)
	ctx := context.Background()
	const rows, checks = 200000, 20
	f.MustExec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'order.updated', 'order', 'agg-' || (n % 500), 'evt-' || n, '{}'
		  FROM generate_series(1, $1::int) AS n`, rows)
	pool, store := analyzedOneConnStore(t, f, planCacheMode)
	check := func(from int64) {
		t.Helper()
		var works []*relay.Work
		for id := from; id < from+100; id++ {
			works = append(works, streamWork(id, "evt-"+strconv.FormatInt(id, 10), relay.Decision{}, &relay.Pair{Sink: "nats"}))
		}
		if err := store.PrepareStream(ctx, works, true, "relay-1"); err != nil {
			t.Fatal(err)
		}
	}
	check(rows + 1) // ids past the table's: a plan is made (and may be cached) with nothing scanned
	f.MustExec(t, deliveredSQL, recorded)
	scans := func() (seq, idx int64) { return ledgerScans(t, f) }
	seq0, idx0 := scans()
	for i := range checks {
		check(int64(recorded - 1000 + 100*i)) // ids on both sides of the last recorded one
	}
	pool.Close() // the backend's exit reports its scans
	var seq, idx int64
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if seq, idx = scans(); seq+idx >= seq0+idx0+checks {
			break
		}
	}
	t.Logf("%d checks of 100 ids against %d delivered pairs: %d sequential scans of the ledger, %d index scans", checks, recorded, seq-seq0, idx-idx0)
	if seq > seq0 {
		t.Errorf("%d sequential scans of the ledger (%d rows) in %d checks of 100 ids, want none", seq-seq0, recorded, checks)
	}
	if seq+idx < seq0+idx0+checks {
		t.Errorf("the ledger's scans were not reported within 10 s (sequential %d, index %d)", seq-seq0, idx-idx0)
	}
}

// TestLedgerReadProbesItsKeysBeforeStatistics: before each claimed batch
// goes out, the ledger's pairs of its event keys are read. On a ledger
// that has grown since it was last analyzed (a new database, or a burst
// between two autovacuum runs) the planner knows nothing about event_key
// alone: it estimated 0.5% of the table per key and scanned the whole
// ledger for a batch of 50 keys, which in the pollmode bench made that read
// take up to 250 ms as the ledger grew, and every claim cycle with it. The
// read probes the primary key once per event key whatever the statistics.
func TestLedgerReadProbesItsKeysBeforeStatistics(t *testing.T) {
	db := mustClaimDB(t)
	db.exec(t, `ALTER TABLE integration_idempotency SET (autovacuum_enabled = off)`)
	db.exec(t, `
		INSERT INTO integration_idempotency (event_key, action, state, attempts, owner, delivered_at)
		SELECT 'evt-' || g, a, 'delivered', 1, 'relay-x', now()
		  FROM generate_series(1, 20000) AS g, (VALUES ('hook'), ('nats')) AS s(a)`)
	keys := make([]string, 0, 100)
	for i := 19901; i <= 20000; i++ {
		keys = append(keys, "evt-"+strconv.Itoa(i))
	}
	sql := db.store.LedgerPairsStatement()
	for _, stage := range []string{"never analyzed", "analyzed"} {
		if stage == "analyzed" {
			db.exec(t, `ANALYZE integration_idempotency`)
		}
		plan := explainClaim(t, db, "EXPLAIN (COSTS OFF) "+sql, []any{keys})
		t.Logf("%s:\n%s", stage, plan)
		if strings.Contains(plan, "Seq Scan on integration_idempotency") {
			t.Errorf("%s: the read of 100 keys' pairs scans the ledger sequentially", stage)
		}
		rows, err := db.pool.Query(context.Background(), sql, keys)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for rows.Next() {
			n++
		}
		if rows.Close(); rows.Err() != nil {
			t.Fatal(rows.Err())
		}
		if n != 200 {
			t.Errorf("%s: read %d pairs, want 200", stage, n)
		}
	}
}

// TestBatchStatementsProbeKeysBeforeStatistics: every statement the stream
// and the claim path run on a batch finds its rows through a key (the
// outbox's id, the ledger's (event_key, action) or its prefix, the order
// index) whatever the tables' statistics say, and whatever plan was cached
// while the tables were small. Both happen in the first hour of a relay on
// a new outbox, and after a burst between two autovacuum runs: a plan made
// at 400 ledger rows (a merge anti-join over a sort of the whole ledger)
// was still used at 120,000 and took 120 ms for three pairs; in the
// write-back bench the stream's delivered insert averaged 29 ms per batch
// and its update of the rows' status 394 ms.
func TestBatchStatementsProbeKeysBeforeStatistics(t *testing.T) {
	if testing.Short() {
		t.Skip("60,000 rows: skipped with -short")
	}
	db := mustClaimDB(t)
	ctx := context.Background()
	for _, table := range []string{"integration_outbox", "integration_idempotency"} {
		db.exec(t, `ALTER TABLE `+table+` SET (autovacuum_enabled = off)`)
	}
	fill := func(from, to int) {
		db.exec(t, `
			INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, processed_at)
			SELECT 'order.placed', 'order', 'agg-' || (g % 1000), 'evt-' || g, '{}', 'done', now()
			  FROM generate_series($1::int, $2::int) AS g`, from, to)
		db.exec(t, `
			INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
			SELECT 'evt-' || g, a, 'delivered', 1, now()
			  FROM generate_series($1::int, $2::int) AS g, (VALUES ('hook'), ('nats')) AS s(a)`, from, to)
	}
	fill(1, 200)
	// The batch: 300 rows pending.
	var ids []int64
	var keys, aggregates []string
	rows, err := db.pool.Query(ctx, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'order.placed', 'order', 'agg-' || (g % 1000), 'evt-' || g, '{}'
		  FROM generate_series(1000001, 1000300) AS g
		RETURNING id, event_key, aggregate_id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var key, agg string
		if err := rows.Scan(&id, &key, &agg); err != nil {
			t.Fatal(err)
		}
		ids, keys, aggregates = append(ids, id), append(keys, key), append(aggregates, agg)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	conn, err := db.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	statements := db.store.BatchStatements(ids, keys, aggregates, "hook", "relay-x")
	explain := func(t *testing.T, stage, mode string, check bool) {
		if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
			t.Fatal(err)
		}
		seq := regexp.MustCompile(`Seq Scan on (integration_outbox|integration_idempotency)\b`)
		for i, st := range statements {
			err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				if st.InTx {
					if _, err := tx.Exec(ctx, db.store.TxSetting()); err != nil {
						return err
					}
				}
				rows, err := tx.Query(ctx, fmt.Sprintf("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) EXECUTE s%d(%s)", i, sqlLiterals(st.Args)), pgx.QueryExecModeSimpleProtocol)
				if err != nil {
					return err
				}
				lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
				if err != nil {
					return err
				}
				plan := strings.Join(lines, "\n")
				switch {
				case !check:
				case seq.MatchString(plan):
					t.Errorf("%s, %s, %s: scans a table sequentially:\n%s", stage, mode, st.Name, plan)
				case rowsExamined(lines) > 20000:
					// An index scan of the whole table, or a join that
					// compares every row with every row, is no better.
					t.Errorf("%s, %s, %s: examines %d rows for a batch of 300:\n%s", stage, mode, st.Name, rowsExamined(lines), plan)
				default:
					t.Logf("%s, %s, %s: %s", stage, mode, st.Name, lines[len(lines)-1])
				}
				return errExplainRollback
			})
			if !errors.Is(err, errExplainRollback) {
				t.Fatalf("%s: %v", st.Name, err)
			}
		}
	}
	for i, st := range statements {
		if _, err := conn.Exec(ctx, fmt.Sprintf("PREPARE s%d AS %s", i, st.SQL), pgx.QueryExecModeSimpleProtocol); err != nil {
			t.Fatalf("prepare %s: %v", st.Name, err)
		}
	}
	// Generic plans made now, at 200 rows, are cached in the prepared
	// statements and used again below.
	explain(t, "200 rows", "force_generic_plan", false)
	fill(201, 60000)
	explain(t, "60,000 rows, plans cached at 200", "force_generic_plan", true)
	explain(t, "60,000 rows never analyzed", "force_custom_plan", true)
	db.exec(t, `ANALYZE integration_outbox, integration_idempotency`)
	explain(t, "60,000 rows analyzed", "force_generic_plan", true)
	explain(t, "60,000 rows analyzed", "force_custom_plan", true)
}

// explainPrepared runs the prepared statement name with args under
// EXPLAIN (ANALYZE, TIMING OFF, SUMMARY ON, and options), with the plan
// cache in mode cache, in a transaction that begins with setting (when not
// empty) and is rolled back, and returns the plan's lines.
func explainPrepared(t *testing.T, conn *pgxpool.Conn, cache, setting, options, name string, args []any) []string {
	t.Helper()
	ctx := context.Background()
	if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+cache); err != nil {
		t.Fatal(err)
	}
	var lines []string
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if setting != "" {
			if _, err := tx.Exec(ctx, setting); err != nil {
				return err
			}
		}
		rows, err := tx.Query(ctx, fmt.Sprintf("EXPLAIN (ANALYZE, TIMING OFF, SUMMARY ON%s) EXECUTE %s(%s)", options, name, sqlLiterals(args)), pgx.QueryExecModeSimpleProtocol)
		if err != nil {
			return err
		}
		lines, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		return errExplainRollback
	})
	if !errors.Is(err, errExplainRollback) {
		t.Fatalf("%s, %s: %v", name, cache, err)
	}
	return lines
}

// rowsExamined is the most rows one node of an EXPLAIN ANALYZE plan read
// from the outbox or the ledger (returned and removed by its filter, over
// all its loops), or removed by one join filter.
func rowsExamined(lines []string) int {
	scan := regexp.MustCompile(`Scan (using \S+ )?on (integration_outbox|integration_idempotency)\b.*actual rows=(\d+) loops=(\d+)`)
	node := regexp.MustCompile(`actual rows=\d+ loops=(\d+)`)
	removed := regexp.MustCompile(`Rows Removed by (Index Recheck|Filter|Join Filter): (\d+)`)
	most, current, loops, ours := 0, 0, 1, false
	flush := func() {
		if ours {
			most = max(most, current)
		}
	}
	for _, line := range lines {
		if m := scan.FindStringSubmatch(line); m != nil {
			flush()
			rows, _ := strconv.Atoi(m[3])
			loops, _ = strconv.Atoi(m[4])
			current, ours = rows*loops, true
			continue
		}
		if m := node.FindStringSubmatch(line); m != nil {
			flush()
			loops, _ = strconv.Atoi(m[1])
			current, ours = 0, false
			continue
		}
		if m := removed.FindStringSubmatch(line); m != nil {
			n, _ := strconv.Atoi(m[2])
			if m[1] == "Join Filter" {
				most = max(most, n*loops)
				continue
			}
			current += n * loops
		}
	}
	flush()
	return most
}

// sqlLiterals renders BatchStatement and claim arguments as SQL literals
// for EXECUTE (the test's values hold no quotes).
func sqlLiterals(args []any) string {
	out := make([]string, len(args))
	for i, a := range args {
		switch v := a.(type) {
		case string:
			out[i] = "'" + v + "'"
		case int64:
			out[i] = strconv.FormatInt(v, 10)
		case []string:
			out[i] = "'{" + strings.Join(v, ",") + "}'"
		case []int64:
			parts := make([]string, len(v))
			for j, x := range v {
				parts[j] = strconv.FormatInt(x, 10)
			}
			out[i] = "'{" + strings.Join(parts, ",") + "}'"
		case []int32:
			parts := make([]string, len(v))
			for j, x := range v {
				parts[j] = strconv.Itoa(int(x))
			}
			out[i] = "'{" + strings.Join(parts, ",") + "}'"
		case []*time.Time:
			parts := make([]string, len(v))
			for j := range v {
				parts[j] = "NULL"
			}
			out[i] = "'{" + strings.Join(parts, ",") + "}'"
		case int:
			out[i] = strconv.Itoa(v)
		case bool:
			out[i] = strconv.FormatBool(v)
		case []bool:
			parts := make([]string, len(v))
			for j, b := range v {
				parts[j] = strconv.FormatBool(b)
			}
			out[i] = "'{" + strings.Join(parts, ",") + "}'"
		case []*string:
			parts := make([]string, len(v))
			for j, x := range v {
				parts[j] = "NULL"
				if x != nil {
					parts[j] = `"` + strings.ReplaceAll(*x, `\`, `\\`) + `"`
				}
			}
			out[i] = "'{" + strings.Join(parts, ",") + "}'"
		case pgtype.Timestamptz:
			if v.InfinityModifier != pgtype.NegativeInfinity {
				panic("sqlLiterals: only the claim's cursor at the front (-infinity)")
			}
			out[i] = "'-infinity'"
		default:
			panic(fmt.Sprintf("sqlLiterals: %T", a))
		}
	}
	return strings.Join(out, ", ")
}
