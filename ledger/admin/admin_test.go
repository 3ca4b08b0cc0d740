package admin_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// fixture is a fresh migrated database and a pool on it.
type fixture struct {
	url    string
	pool   *pgxpool.Pool
	tables admin.Tables
}

// hostileNames are table names that would inject SQL if they were not quoted.
func hostileNames() migrations.Names {
	n := migrations.DefaultNames()
	n.Outbox = relay.QualifiedName{Schema: `we"ird`, Name: `out"; DROP TABLE x; --`}
	n.Ledger = relay.QualifiedName{Schema: `we"ird`, Name: `led ger`}
	n.Checkpoint = relay.QualifiedName{Schema: `we"ird`, Name: `check'point`}
	n.Conflicts = relay.QualifiedName{Schema: `we"ird`, Name: `conflicts`}
	n.PublishFunction = relay.QualifiedName{Schema: `we"ird`, Name: `pub`}
	n.Publication = `pub"lication`
	return n
}

// MustFixture creates a database and migrates it with the default names.
func MustFixture(tb testing.TB) *fixture {
	tb.Helper()
	return MustFixtureNames(tb, migrations.DefaultNames())
}

// MustFixtureNames creates a database (and the schema of names.Outbox, if
// any) and migrates it with names.
func MustFixtureNames(tb testing.TB, names migrations.Names) *fixture {
	tb.Helper()
	ctx := context.Background()
	url := pgtest.NewDatabase(tb)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	defer conn.Close(ctx)
	if s := names.Outbox.Schema; s != "" {
		MustExec(tb, conn, "CREATE SCHEMA "+relay.QuoteIdentifier(s))
	}
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: names}); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		tb.Fatalf("pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	return &fixture{url: url, pool: pool, tables: admin.Tables{Outbox: names.Outbox, Ledger: names.Ledger, Checkpoint: names.Checkpoint}}
}

// MustExec runs sql or fails tb.
func MustExec(tb testing.TB, db admin.DB, sql string, args ...any) {
	tb.Helper()
	if _, err := db.Exec(context.Background(), sql, args...); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
}

// row describes an outbox row to insert; zero fields take defaults.
type row struct {
	key       string
	eventType *string
	status    string
	attempts  int
	lastError string
	created   time.Duration // age of created_at
	processed time.Duration // age of processed_at; 0: NULL
}

func str(s string) *string { return &s }

// MustInsert inserts r and returns its id.
func (f *fixture) MustInsert(tb testing.TB, r row) int64 {
	tb.Helper()
	if r.status == "" {
		r.status = "pending"
	}
	if r.eventType == nil {
		r.eventType = str("order.created")
	}
	var lastError, processed any
	if r.lastError != "" {
		lastError = r.lastError
	}
	if r.processed > 0 {
		processed = time.Now().Add(-r.processed)
	}
	var id int64
	err := f.pool.QueryRow(context.Background(), fmt.Sprintf(`
INSERT INTO %s (event_type, aggregate_type, aggregate_id, event_key, payload, status, attempts, last_error, created_at, processed_at)
VALUES ($1, 'order', 'A1', $2, '{"n": 1}', $3, $4, $5, now() - $6 * interval '1 microsecond', $7)
RETURNING id`, f.tables.Outbox.Quoted()), r.eventType, r.key, r.status, r.attempts, lastError, r.created.Microseconds(), processed).Scan(&id)
	if err != nil {
		tb.Fatalf("insert %s: %v", r.key, err)
	}
	return id
}

// MustLedger inserts a ledger row for key and sink in state; age is the age
// of delivered_at (delivered) or claimed_at (otherwise), 0 for now and -1
// for NULL.
func (f *fixture) MustLedger(tb testing.TB, key, sink, state string, age time.Duration) {
	tb.Helper()
	var at any
	if age >= 0 {
		at = time.Now().Add(-age)
	}
	var delivered, claimed any
	if state == "delivered" {
		delivered = at
	} else {
		claimed = at
	}
	MustExec(tb, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, action, state, attempts, delivered_at, claimed_at)
		VALUES ($1, $2, $3, 1, $4, $5)`, f.tables.Ledger.Quoted()), key, sink, state, delivered, claimed)
}

// outboxRow is what tests read back of a row.
type outboxRow struct {
	status      string
	attempts    int
	replays     *int
	lastError   *string
	diverted    bool
	availableIn time.Duration // available_at - now
}

func (f *fixture) MustRow(tb testing.TB, id int64) outboxRow {
	tb.Helper()
	var r outboxRow
	var avail float64
	err := f.pool.QueryRow(context.Background(), fmt.Sprintf(`
SELECT status, attempts, replays, last_error, handoff_at IS NOT NULL, extract(epoch FROM available_at - now())::float8
  FROM %s WHERE id = $1`, f.tables.Outbox.Quoted()), id).Scan(&r.status, &r.attempts, &r.replays, &r.lastError, &r.diverted, &avail)
	if err != nil {
		tb.Fatalf("read row %d: %v", id, err)
	}
	r.availableIn = time.Duration(avail * float64(time.Second))
	return r
}

// MustLedgerStates returns key's ledger rows as sink → state.
func (f *fixture) MustLedgerStates(tb testing.TB, key string) map[string]string {
	tb.Helper()
	rows, err := f.pool.Query(context.Background(), fmt.Sprintf(`SELECT action, state FROM %s WHERE event_key = $1`, f.tables.Ledger.Quoted()), key)
	if err != nil {
		tb.Fatal(err)
	}
	out := map[string]string{}
	var a, s string
	if _, err := pgx.ForEachRow(rows, []any{&a, &s}, func() error { out[a] = s; return nil }); err != nil {
		tb.Fatal(err)
	}
	return out
}

// MustCount returns the number of rows of table matching where.
func (f *fixture) MustCount(tb testing.TB, table relay.QualifiedName, where string, args ...any) int64 {
	tb.Helper()
	var n int64
	if err := f.pool.QueryRow(context.Background(), fmt.Sprintf("SELECT count(*) FROM %s WHERE %s", table.Quoted(), where), args...).Scan(&n); err != nil {
		tb.Fatal(err)
	}
	return n
}

func TestBatches(t *testing.T) {
	ids := make([]int64, 2500)
	got := admin.Batches(ids, 1000)
	if len(got) != 3 || len(got[0]) != 1000 || len(got[1]) != 1000 || len(got[2]) != 500 {
		t.Fatalf("batches of 2500: %d", len(got))
	}
	if admin.Batches(nil, 1000) != nil {
		t.Fatal("batches of nothing")
	}
	// Appending to a batch must not overwrite the next one.
	got[0] = append(got[0], 42)
	if got[1][0] != 0 {
		t.Fatal("batches share capacity")
	}
}

func TestFormatBytes(t *testing.T) {
	for n, want := range map[int64]string{0: "0 B", 1023: "1023 B", 1536: "1.5 KiB", 10 << 30: "10.0 GiB", -2048: "-2.0 KiB"} {
		if got := admin.FormatBytes(n); got != want {
			t.Errorf("FormatBytes(%d) = %q, want %q", n, got, want)
		}
	}
}
