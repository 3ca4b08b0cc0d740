package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// TestMain fails the package when a test leaves a goroutine behind
// (docs/architecture.md, "Goroutines and their owners").
func TestMain(m *testing.M) { goleak.VerifyTestMain(pgtest.Wrap(m)) }

// fixture is a fresh migrated database, a pool on it and a Store.
type fixture struct {
	url   string
	pool  *pgxpool.Pool
	store *ledger.Store
	names migrations.Names
}

// MustFixture creates a database, migrates it with the default names and
// returns a Store with the default config.
func MustFixture(tb testing.TB) *fixture {
	tb.Helper()
	return MustFixtureNames(tb, migrations.DefaultNames(), "")
}

// MustFixtureNames is MustFixture for other table names; setup runs before
// the migrations (to create a schema, say).
func MustFixtureNames(tb testing.TB, names migrations.Names, setup string) *fixture {
	tb.Helper()
	ctx := context.Background()
	url := pgtest.NewDatabase(tb)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	defer conn.Close(ctx)
	if setup != "" {
		if _, err := conn.Exec(ctx, setup); err != nil {
			tb.Fatalf("%s: %v", setup, err)
		}
	}
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: names}); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		tb.Fatalf("pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	cfg := ledger.DefaultConfig()
	cfg.Outbox, cfg.Ledger, cfg.Checkpoint = names.Outbox, names.Ledger, names.Checkpoint
	return &fixture{url: url, pool: pool, store: mustStore(tb, pool, cfg), names: names}
}

// row is an outbox row to insert; empty fields take the table's defaults,
// and an empty Status means pending.
type row struct {
	Key     string
	AggType *string
	AggID   *string
	Status  string
	// NullStatus inserts the row with a NULL status (the column is
	// nullable), which means pending.
	NullStatus bool
	Diverted   bool
	LastError  *string
	Attempts   int
	// NoAvailableAt inserts the row with a NULL available_at (an
	// application that sets the column itself), which means due now.
	NoAvailableAt bool
	// Type is the event_type; empty: test.event.
	Type string
}

func ptr[T any](v T) *T { return &v }

// MustInsert inserts rows and returns their ids in order.
func (f *fixture) MustInsert(tb testing.TB, rows ...row) []int64 {
	tb.Helper()
	ids := make([]int64, len(rows))
	for i, r := range rows {
		status := &r.Status
		switch {
		case r.NullStatus:
			status = nil
		case r.Status == "":
			status = ptr("pending")
		}
		var handoff *time.Time
		if r.Diverted {
			handoff = ptr(time.Now())
		}
		err := f.pool.QueryRow(context.Background(), fmt.Sprintf(`
			INSERT INTO %s (event_type, aggregate_type, aggregate_id, event_key, payload, status, handoff_at, last_error, attempts, available_at)
			VALUES (coalesce(nullif($9, ''), 'test.event'), $1, $2, $3, '{}', $4, $5, $6, $7, CASE WHEN $8 THEN NULL ELSE now() END) RETURNING id`, f.names.Outbox.Quoted()),
			r.AggType, r.AggID, r.Key, status, handoff, r.LastError, r.Attempts, r.NoAvailableAt, r.Type).Scan(&ids[i])
		if err != nil {
			tb.Fatalf("insert %s: %v", r.Key, err)
		}
	}
	return ids
}

// MustInsertPending inserts n pending rows keyed prefix-1 … prefix-n in one
// statement and returns their ids.
func (f *fixture) MustInsertPending(tb testing.TB, prefix string, n int) []int64 {
	tb.Helper()
	rows, err := f.pool.Query(context.Background(), fmt.Sprintf(`
		INSERT INTO %s (event_type, event_key, payload)
		SELECT 'test.event', $1 || '-' || g, '{}' FROM generate_series(1, $2::int) g RETURNING id`,
		f.names.Outbox.Quoted()), prefix, n)
	if err != nil {
		tb.Fatalf("insert %d rows: %v", n, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		tb.Fatalf("insert %d rows: %v", n, err)
	}
	return ids
}

// outboxRow is what the tests check of a row.
type outboxRow struct {
	Status      string // "<NULL>" when NULL
	DivertedAt  *time.Time
	AvailableAt time.Time // zero when NULL
	LastError   *string
	Attempts    int
	ProcessedAt *time.Time
}

func (f *fixture) MustRow(tb testing.TB, id int64) outboxRow {
	tb.Helper()
	var r outboxRow
	var available *time.Time
	err := f.pool.QueryRow(context.Background(), fmt.Sprintf(`
		SELECT coalesce(status, '<NULL>'), handoff_at, available_at, last_error, attempts, processed_at FROM %s WHERE id = $1`,
		f.names.Outbox.Quoted()), id).Scan(&r.Status, &r.DivertedAt, &available, &r.LastError, &r.Attempts, &r.ProcessedAt)
	if err != nil {
		tb.Fatalf("read row %d: %v", id, err)
	}
	if available != nil {
		r.AvailableAt = *available
	}
	return r
}

// ledgerRow is what the tests check of a ledger row.
type ledgerRow struct {
	State       string
	Attempts    int
	Owner       *string
	DeliveredAt *time.Time
	Detail      *string
}

// MustLedger returns the ledger rows of eventKey by action.
func (f *fixture) MustLedger(tb testing.TB, eventKey string) map[string]ledgerRow {
	tb.Helper()
	rows, err := f.pool.Query(context.Background(), fmt.Sprintf(`
		SELECT action, state, attempts, owner, delivered_at, detail FROM %s WHERE event_key = $1`,
		f.names.Ledger.Quoted()), eventKey)
	if err != nil {
		tb.Fatalf("read ledger of %s: %v", eventKey, err)
	}
	out := map[string]ledgerRow{}
	var action string
	var r ledgerRow
	_, err = pgx.ForEachRow(rows, []any{&action, &r.State, &r.Attempts, &r.Owner, &r.DeliveredAt, &r.Detail}, func() error {
		out[action] = r
		return nil
	})
	if err != nil {
		tb.Fatalf("read ledger of %s: %v", eventKey, err)
	}
	return out
}

// MustExec runs sql on the pool.
func (f *fixture) MustExec(tb testing.TB, sql string, args ...any) {
	tb.Helper()
	if _, err := f.pool.Exec(context.Background(), sql, args...); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
}

// MustCount runs a count query.
func (f *fixture) MustCount(tb testing.TB, sql string, args ...any) int {
	tb.Helper()
	var n int
	if err := f.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	return n
}

// String renders r with its pointers followed, for comparisons and messages.
func (r outboxRow) String() string {
	return fmt.Sprintf("{status=%s handoff_at=%s available_at=%s last_error=%s attempts=%d processed_at=%s}",
		r.Status, deref(r.DivertedAt), r.AvailableAt, deref(r.LastError), r.Attempts, deref(r.ProcessedAt))
}

func deref[T any](p *T) string {
	if p == nil {
		return "NULL"
	}
	return fmt.Sprint(*p)
}

// streamWork is a stream Work of the row id keyed key, decided d, with
// pairs (Prepare's and the engine's view of each sink).
func streamWork(id int64, key string, d relay.Decision, pairs ...*relay.Pair) *relay.Work {
	return &relay.Work{Event: &relay.Event{ID: id, EventKey: key}, Pairs: pairs, Decision: d}
}

// outcomePair is a pair of sink whose outcome is kind.
func outcomePair(sink string, kind relay.OutcomeKind) *relay.Pair {
	return &relay.Pair{Sink: sink, Outcome: relay.Outcome{Kind: kind}}
}

// mustPrimaryAndStandby returns a cluster with database "app" migrated and
// a physical standby of it.
func mustPrimaryAndStandby(ctx context.Context, t *testing.T) (primary, standby *pgtest.Cluster) {
	t.Helper()
	primary = pgtest.NewCluster(t, pgtest.Options{})
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}
	return primary, pgtest.NewStandby(t, primary, pgtest.StandbyOptions{})
}

// mustStore is ledger.New, failing the test on an error.
func mustStore(tb testing.TB, pool *pgxpool.Pool, cfg ledger.Config) *ledger.Store {
	tb.Helper()
	s, err := ledger.New(pool, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return s
}
