package ledger_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// claimDB is a migrated database with the default table names and a Store
// whose claim query routes to sinks: the claim path's SQL under test.
type claimDB struct {
	pool  *pgxpool.Pool
	store *ledger.Store
}

// mustClaimDB creates and migrates a database and returns a Store on it
// with the default config.
func mustClaimDB(tb testing.TB) *claimDB {
	tb.Helper()
	ctx := context.Background()
	url := pgtest.NewDatabase(tb)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		tb.Fatalf("pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	return &claimDB{pool: pool, store: mustStore(tb, pool, ledger.DefaultConfig())}
}

// exec runs sql and returns the rows it affected.
func (d *claimDB) exec(tb testing.TB, sql string, args ...any) int64 {
	tb.Helper()
	tag, err := d.pool.Exec(context.Background(), sql, args...)
	if err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	return tag.RowsAffected()
}
