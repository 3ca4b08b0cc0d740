package admin_test

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

const day = 24 * time.Hour

var week = admin.RetentionConfig{DoneAfter: 7 * day, LedgerAfter: 30 * day, Batch: 1000}

// MustLogDeletes records the number of rows each DELETE statement on table
// removes, in deletes_log(n) — the proof that Prune deletes in batches.
func (f *fixture) MustLogDeletes(tb testing.TB, table relay.QualifiedName) {
	tb.Helper()
	MustExec(tb, f.pool, `CREATE TABLE IF NOT EXISTS public.deletes_log (tbl text, n bigint, at timestamptz DEFAULT clock_timestamp())`)
	MustExec(tb, f.pool, `CREATE OR REPLACE FUNCTION public.log_deletes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.deletes_log (tbl, n) SELECT TG_TABLE_NAME, count(*) FROM gone;
    RETURN NULL;
END $$`)
	MustExec(tb, f.pool, fmt.Sprintf(`CREATE TRIGGER log_deletes AFTER DELETE ON %s REFERENCING OLD TABLE AS gone
		FOR EACH STATEMENT EXECUTE FUNCTION public.log_deletes()`, table.Quoted()))
}

func (f *fixture) MustDeleteSizes(tb testing.TB, table relay.QualifiedName) []int64 {
	tb.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT n FROM public.deletes_log WHERE tbl = $1 ORDER BY at`, table.Name)
	if err != nil {
		tb.Fatal(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var n int64
		if err := rows.Scan(&n); err != nil {
			tb.Fatal(err)
		}
		out = append(out, n)
	}
	return out
}

func TestPrune_DoneRowsInBatches(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	// 2,500 done rows processed 8 days ago, each with a ledger row delivered
	// then: younger than ledger_after, but an event's ledger rows go with its
	// row (a key published again is a new event).
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, status, created_at, processed_at)
		SELECT 'old' || g, 'done', now() - interval '9 days', now() - interval '8 days' FROM generate_series(1, 2500) g`, f.tables.Outbox.Quoted()))
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, action, state, delivered_at)
		SELECT 'old' || g, 'nats', 'delivered', now() - interval '8 days' FROM generate_series(1, 2500) g`, f.tables.Ledger.Quoted()))
	young := f.MustInsert(t, row{key: "young", status: "done", processed: 6 * day})
	legacy := f.MustInsert(t, row{key: "legacy-old", status: "done", created: 8 * day}) // no processed_at: ages from created_at
	legacyYoung := f.MustInsert(t, row{key: "legacy-young", status: "done", created: day})
	var keep []int64
	for _, status := range []string{"pending", "processing", "held", "failed"} {
		keep = append(keep, f.MustInsert(t, row{key: "ancient-" + status, status: status, created: 400 * day, processed: 300 * day}))
	}
	f.MustLogDeletes(t, f.tables.Outbox)

	done, ledger, err := admin.Prune(ctx, f.pool, f.tables, week)
	if err != nil {
		t.Fatal(err)
	}
	if done != 2501 || ledger != 2500 {
		t.Fatalf("pruned %d done rows and %d ledger rows, want 2501 and 2500", done, ledger)
	}
	if got := f.MustDeleteSizes(t, f.tables.Outbox); !slices.Equal(got, []int64{1000, 1000, 501}) {
		t.Fatalf("DELETE statements removed %v rows, want batches of 1000, 1000, 501", got)
	}
	for _, id := range append(keep, young, legacyYoung) {
		if f.MustCount(t, f.tables.Outbox, "id = $1", id) != 1 {
			t.Fatalf("row %d was pruned", id)
		}
	}
	if f.MustCount(t, f.tables.Outbox, "id = $1", legacy) != 0 {
		t.Fatal("an old done row without processed_at was kept")
	}
	if n := f.MustCount(t, f.tables.Ledger, "true"); n != 0 {
		t.Fatalf("%d ledger rows left, want none: they go with their rows", n)
	}

	// Repeating finds nothing.
	if done, ledger, err := admin.Prune(ctx, f.pool, f.tables, week); err != nil || done != 0 || ledger != 0 {
		t.Fatalf("second prune: %d %d %v", done, ledger, err)
	}
}

func TestPrune_Ledger(t *testing.T) {
	for name, names := range map[string]migrations.Names{"default names": migrations.DefaultNames(), "hostile names": hostileNames()} {
		t.Run(name, func(t *testing.T) {
			f := MustFixtureNames(t, names)
			ctx := context.Background()
			old := 31 * day
			f.MustInsert(t, row{key: "done", status: "done", processed: time.Hour})
			for _, status := range []string{"pending", "processing", "held", "failed"} {
				f.MustInsert(t, row{key: status, status: status, created: 400 * day})
				f.MustLedger(t, status, "nats", "delivered", old) // another sink still owes it
				f.MustLedger(t, status, "n8n", "unknown", old)
			}
			f.MustLedger(t, "done", "nats", "delivered", old)      // row done, old: kept while the row stays
			f.MustLedger(t, "done", "n8n", "delivered", 29*day)    // row done, young: kept
			f.MustLedger(t, "gone", "nats", "delivered", old)      // row pruned already, old: pruned
			f.MustLedger(t, "gone", "n8n", "delivered", day)       // row pruned already, young: kept
			f.MustLedger(t, "gone-untimed", "nats", "unknown", -1) // no time, row gone: pruned
			f.MustLedger(t, "done", "untimed", "unknown", -1)      // no time, row still there: kept
			f.MustLedger(t, "gone-sending", "n8n", "sending", old) // old claim, row gone: pruned

			done, ledger, err := admin.Prune(ctx, f.pool, f.tables, admin.RetentionConfig{DoneAfter: 7 * day, LedgerAfter: 30 * day, Batch: 2})
			if err != nil {
				t.Fatal(err)
			}
			if done != 0 || ledger != 3 {
				t.Fatalf("pruned %d done rows and %d ledger rows, want 0 and 3", done, ledger)
			}
			want := map[string]map[string]string{
				"done":         {"nats": "delivered", "n8n": "delivered", "untimed": "unknown"},
				"gone":         {"n8n": "delivered"},
				"gone-untimed": {},
				"gone-sending": {},
			}
			for _, status := range []string{"pending", "processing", "held", "failed"} {
				want[status] = map[string]string{"nats": "delivered", "n8n": "unknown"}
			}
			for key, states := range want {
				if got := f.MustLedgerStates(t, key); fmt.Sprint(got) != fmt.Sprint(states) {
					t.Errorf("ledger of %s: %v, want %v", key, got, states)
				}
			}
		})
	}
}

func TestPrune_RefusesZeroAges(t *testing.T) {
	f := MustFixture(t)
	if _, _, err := admin.Prune(context.Background(), f.pool, f.tables, admin.RetentionConfig{LedgerAfter: day}); err == nil {
		t.Fatal("Prune with done_after 0 would delete every done row")
	}
}

// syncBuffer is a log destination safe for the retention goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestRunRetention(t *testing.T) {
	f := MustFixture(t)
	old := f.MustInsert(t, row{key: "old", status: "done", processed: 8 * day})
	var logs syncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		errc <- admin.RunRetention(ctx, f.pool, f.tables, week, 50*time.Millisecond, zerolog.New(&logs))
	}()

	// The first pass runs at once; later passes pick up rows that age.
	waitFor(t, func() bool { return f.MustCount(t, f.tables.Outbox, "id = $1", old) == 0 })
	later := f.MustInsert(t, row{key: "later", status: "done", processed: 8 * day})
	waitFor(t, func() bool { return f.MustCount(t, f.tables.Outbox, "id = $1", later) == 0 })

	cancel()
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("RunRetention returned %v after cancel, want nil", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("RunRetention did not return after cancel")
	}
	if !strings.Contains(logs.String(), `"done_rows":1`) || !strings.Contains(logs.String(), "retention: pruned old rows") {
		t.Fatalf("logs: %s", logs.String())
	}
}

func TestRunRetention_KeepsGoingAfterAnError(t *testing.T) {
	f := MustFixture(t)
	missing := f.tables
	missing.Outbox = relay.QualifiedName{Name: "no_such_table"}
	var logs syncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- admin.RunRetention(ctx, f.pool, missing, week, 20*time.Millisecond, zerolog.New(&logs))
	}()
	waitFor(t, func() bool { return strings.Count(logs.String(), "pruning failed") >= 2 })
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("RunRetention: %v", err)
	}
}

func waitFor(tb testing.TB, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatal("condition not met within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPrune_KeepsRowsTheSlotHasNotPassed: a transaction of 20 rows with an
// old created_at (a backfill, a long transaction) whose 19 first rows were
// delivered and marked done long ago, while the slot is not acknowledged
// past the transaction (its 20th row is slow). Pruning those 19 rows would
// make the slot, after a reconnect, find them missing and send them again:
// retention keeps every row until the slot has passed its inserting
// transaction (Horizon), then prunes them. Without a slot nothing holds
// rows back (TestPrune_DoneRowsInBatches).
// MustPruneBehindSlot creates a logical slot and returns a Prune with a
// week's ages bounded by its horizon; it prunes once first, so that the
// horizon has a sample before what the test writes next.
func (f *fixture) MustPruneBehindSlot(t *testing.T, slot string) func() (done, ledger int64) {
	t.Helper()
	MustExec(t, f.pool, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot)
	t.Cleanup(func() { MustExec(t, f.pool, `SELECT pg_drop_replication_slot($1)`, slot) })
	cfg := week
	cfg.Horizon = admin.NewHorizon(slot)
	prune := func() (done, ledger int64) {
		t.Helper()
		done, ledger, err := admin.Prune(context.Background(), f.pool, f.tables, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return done, ledger
	}
	prune()
	return prune
}

func TestPrune_KeepsRowsTheSlotHasNotPassed(t *testing.T) {
	f, ctx, slot := MustFixture(t), context.Background(), "retention_slot"
	prune := f.MustPruneBehindSlot(t, slot) // a sample before the transaction

	outbox, led := f.tables.Outbox.Quoted(), f.tables.Ledger.Quoted()
	tx, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	MustExec(t, tx, fmt.Sprintf(`INSERT INTO %s (event_key, status, created_at) SELECT 'backfill-' || g, 'pending', now() - interval '9 days' FROM generate_series(1, 20) g`, outbox))
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	MustExec(t, f.pool, fmt.Sprintf(`UPDATE %s SET status = 'done', processed_at = now() - interval '8 days' WHERE event_key <> 'backfill-20'`, outbox))
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, action, state, attempts, delivered_at)
		SELECT event_key, 'nats', 'delivered', 1, now() FROM %s WHERE status = 'done'`, led, outbox))

	if done, ledger := prune(); done != 0 || ledger != 0 {
		t.Fatalf("pruned %d rows and %d ledger rows the slot has not passed, want none", done, ledger)
	}
	if n := f.MustCount(t, f.tables.Outbox, `status = 'done'`); n != 19 {
		t.Fatalf("%d done rows left, want 19", n)
	}
	// The slot passes the transaction (the 20th row settled, the relay
	// acknowledged): the next pass prunes the 19.
	MustExec(t, f.pool, `SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, slot)
	if done, ledger := prune(); done != 19 || ledger != 19 {
		t.Fatalf("after the slot passed the transaction: pruned %d rows and %d ledger rows, want 19 and 19", done, ledger)
	}
}

// TestPrune_DiscardedRowsLikeDone: a discarded row is settled (dlq
// discard): retention prunes it by processed_at with its ledger rows, as it
// prunes a done row. A pending row goes by its status, never by the
// ledger: one the ledger shows delivered everywhere is kept (an earlier
// version left its status pending; reconcile hands it to the claim path,
// which settles it done).
func TestPrune_DiscardedRowsLikeDone(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	led := f.tables.Ledger.Quoted()
	old := f.MustInsert(t, row{key: "old", status: "discarded", created: 9 * day, processed: 8 * day})
	young := f.MustInsert(t, row{key: "young", status: "discarded", created: 9 * day, processed: day})
	recorded := f.MustInsert(t, row{key: "recorded", created: 9 * day})
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, action, state, attempts, delivered_at) VALUES
		('old', 'nats', 'delivered', 1, now() - interval '40 days'), ('old', 'hook', 'unknown', 1, now() - interval '40 days'),
		('young', 'nats', 'delivered', 1, now() - interval '1 day'),
		('recorded', 'nats', 'delivered', 1, now() - interval '40 days')`, led))
	done, ledgerRows, err := admin.Prune(ctx, f.pool, f.tables, week)
	if err != nil {
		t.Fatal(err)
	}
	if done != 1 || ledgerRows != 2 {
		t.Fatalf("pruned %d rows and %d ledger rows, want 1 (old) and its 2", done, ledgerRows)
	}
	for id, want := range map[int64]int64{old: 0, young: 1, recorded: 1} {
		if n := f.MustCount(t, f.tables.Outbox, `id = $1`, id); n != want {
			t.Errorf("row %d: %d left, want %d", id, n, want)
		}
	}
	if got := f.MustLedgerStates(t, "recorded"); got["nats"] != "delivered" {
		t.Errorf("the pending row's ledger rows: %v, want kept", got)
	}
}

// TestPrune_KeepsADoneRowsLedgerRowsWhileTheRowStays: an event's ledger
// rows are its record of delivery (docs/guarantees.md, "Retention"): they
// go with its row, never before it, however old they are — before and
// after the slot has passed the row — so that verify never finds a done
// row without the record of a sink it was delivered to.
func TestPrune_KeepsADoneRowsLedgerRowsWhileTheRowStays(t *testing.T) {
	f, slot := MustFixture(t), "retention_ledger_slot"
	prune := f.MustPruneBehindSlot(t, slot) // a sample before the transaction

	outbox, led := f.tables.Outbox.Quoted(), f.tables.Ledger.Quoted()
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, status, created_at, processed_at) VALUES ('late-sink', 'done', now(), now())`, outbox))
	// One sink delivered it long before the other (a ledger row older than
	// ledger_after); the row is done, but not old enough to go.
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, action, state, attempts, delivered_at)
		VALUES ('late-sink', 'nats', 'delivered', 1, now() - interval '31 days'), ('late-sink', 'n8n', 'delivered', 1, now())`, led))

	want := fmt.Sprint(map[string]string{"nats": "delivered", "n8n": "delivered"})
	if done, ledger := prune(); done != 0 || ledger != 0 {
		t.Fatalf("pruned %d rows and %d ledger rows the slot has not passed, want none", done, ledger)
	}
	MustExec(t, f.pool, `SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, slot)
	if done, ledger := prune(); done != 0 || ledger != 0 {
		t.Fatalf("after the slot passed the transaction: pruned %d rows and %d ledger rows, want none while the row stays", done, ledger)
	}
	if got := f.MustLedgerStates(t, "late-sink"); fmt.Sprint(got) != want {
		t.Fatalf("ledger of late-sink: %v, want both delivered rows", got)
	}
}

// explainingDB runs each statement under EXPLAIN ANALYZE in a transaction
// it rolls back, then for real, and keeps the most rows any plan node of
// each statement read from a table.
type explainingDB struct {
	tb   testing.TB
	pool *pgxpool.Pool
	read map[string]int // statement (its first line) → most rows read
}

func (d *explainingDB) explain(ctx context.Context, sql string, args ...any) {
	d.tb.Helper()
	tx, err := d.pool.Begin(ctx)
	if err != nil {
		d.tb.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) "+sql, args...)
	if err != nil {
		d.tb.Fatalf("explain %s: %v", sql, err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		d.tb.Fatalf("explain %s: %v", sql, err)
	}
	// A scan node's rows, over its loops, with those its filter removed.
	scan := regexp.MustCompile(`Scan .*actual rows=(\d+) loops=(\d+)`)
	removed := regexp.MustCompile(`Rows Removed by Filter: (\d+)`)
	most, current, loops := 0, 0, 1
	for _, l := range lines {
		if m := scan.FindStringSubmatch(l); m != nil {
			n, _ := strconv.Atoi(m[1])
			loops, _ = strconv.Atoi(m[2])
			current = n * loops
			most = max(most, current)
		} else if m := removed.FindStringSubmatch(l); m != nil {
			n, _ := strconv.Atoi(m[1])
			most = max(most, current+n*loops)
		}
	}
	key := strings.TrimSpace(strings.SplitN(strings.TrimSpace(sql), "\n", 2)[0])
	d.read[key] = max(d.read[key], most)
}

func (d *explainingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	d.explain(ctx, sql, args...)
	return d.pool.Exec(ctx, sql, args...)
}

func (d *explainingDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	d.explain(ctx, sql, args...)
	return d.pool.Query(ctx, sql, args...)
}

func (d *explainingDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	d.explain(ctx, sql, args...)
	return d.pool.QueryRow(ctx, sql, args...)
}

// TestPrune_ReadsTheTablesInSlices: a pass reads the whole outbox and the
// whole ledger (no index on their times), a slice of rows per statement,
// so that no statement holds a snapshot over a whole table. One statement
// per table did: on a young outbox nothing is old, and make bench's
// slot-recreated (400,000 rows) showed retention's first DELETE running
// for more than 200 s beside the relay, holding back the oldest snapshot,
// so that no dead row version was removed and every claim, mark and insert
// slowed (530 s for the phase against 197 s with retention off).
func TestPrune_ReadsTheTablesInSlices(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	// 6,000 done rows and their ledger rows, all young, then 30 old ones.
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, status, created_at, processed_at)
		SELECT 'young' || g, 'done', now() - interval '2 days', now() - interval '1 day' FROM generate_series(1, 6000) g`, f.tables.Outbox.Quoted()))
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, action, state, delivered_at)
		SELECT 'young' || g, 'nats', 'delivered', now() - interval '1 day' FROM generate_series(1, 6000) g`, f.tables.Ledger.Quoted()))
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, status, created_at, processed_at)
		SELECT 'old' || g, 'done', now() - interval '9 days', now() - interval '8 days' FROM generate_series(1, 30) g`, f.tables.Outbox.Quoted()))
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, action, state, delivered_at)
		SELECT 'gone' || g, 'nats', 'delivered', now() - interval '40 days' FROM generate_series(1, 20) g`, f.tables.Ledger.Quoted()))
	MustExec(t, f.pool, `ANALYZE`)

	db := &explainingDB{tb: t, pool: f.pool, read: map[string]int{}}
	cfg := week
	cfg.Batch, cfg.Scan = 100, 1000
	done, ledger, err := admin.Prune(ctx, db, f.tables, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if done != 30 || ledger != 20 {
		t.Fatalf("pruned %d done rows and %d ledger rows, want 30 and 20", done, ledger)
	}
	for stmt, n := range db.read {
		// A slice, and the index entries of its ends.
		if n > 2*cfg.Scan {
			t.Errorf("a statement read %d rows of a table (slices of %d): %s", n, cfg.Scan, stmt)
		} else {
			t.Logf("%5d rows at most: %s", n, stmt)
		}
	}
	if len(db.read) == 0 {
		t.Fatal("no statement ran")
	}
}
