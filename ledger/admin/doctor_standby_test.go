package admin_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestDiagnose_Standby (PostgreSQL 16+): with source.standby_url, doctor
// checks what decoding on the standby needs, each with its fix — here a
// healthy standby (hot_standby_feedback through a physical slot, a
// replication connection, wal_level logical, its lag), a role that may not
// call pg_log_standby_snapshot() on the primary, and the relay's slot left
// on the primary; then a standby without hot_standby_feedback, and an
// unreachable one.
func TestDiagnose_Standby(t *testing.T) {
	bindir := pgtest.BindirAtLeast(t, 16, "logical decoding on a standby")
	ctx := context.Background()
	primary := pgtest.NewCluster(t, pgtest.Options{Bindir: bindir})
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}
	MustExec(t, conn, "CREATE ROLE relay LOGIN REPLICATION")
	MustExec(t, conn, "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO relay")
	conn.Close(ctx)
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{})
	conn, err = pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	MustExec(t, conn, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	deadline := time.Now().Add(30 * time.Second)
	for {
		var sent bool
		if err := conn.QueryRow(ctx, `SELECT xmin IS NOT NULL FROM pg_replication_slots WHERE slot_name = 'pgtest_standby'`).Scan(&sent); err != nil {
			t.Fatal(err)
		}
		if sent || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}

	asRelay := func(url string) string { return url + "&user=relay" }
	withStandby := func(url string) func(*admin.DiagnoseConfig) {
		return func(c *admin.DiagnoseConfig) { c.StandbyURL, c.StandbyMaxLag = url, 5*time.Second }
	}
	// Each server has its own max_slot_wal_keep_size: the primary's bounds
	// the standby's physical slot, the standby's the relay's slot.
	MustExec(t, conn, "ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'")
	MustExec(t, conn, "SELECT pg_reload_conf()")
	waitFor(t, func() bool {
		var mb int64
		return conn.QueryRow(ctx, `SELECT setting::bigint FROM pg_settings WHERE name = 'max_slot_wal_keep_size'`).Scan(&mb) == nil && mb == 10<<10
	})
	checks := diagnose(t, asRelay(primary.URL("app")), withStandby(asRelay(standby.URL("app"))))
	requireCheck(t, checks, "max_slot_wal_keep_size", admin.OK, "10.0 GiB")
	requireCheck(t, checks, "standby max_slot_wal_keep_size", admin.Warn, "-1 (unlimited)", "the standby stops", "on the standby: ALTER SYSTEM SET max_slot_wal_keep_size")
	requireCheck(t, checks, "standby", admin.OK, "a physical standby of this primary")
	requireCheck(t, checks, "standby wal_level", admin.OK)
	requireCheck(t, checks, "standby replication connection", admin.OK)
	requireCheck(t, checks, "standby hot_standby_feedback", admin.OK)
	requireCheck(t, checks, "standby physical slot", admin.OK, "pgtest_standby")
	requireCheck(t, checks, "pg_log_standby_snapshot", admin.Warn, `GRANT EXECUTE ON FUNCTION pg_log_standby_snapshot() TO "relay"`)
	requireCheck(t, checks, "slot outbox_relay on the standby", admin.OK, "does not exist yet")
	requireCheck(t, checks, "slot outbox_relay on the primary", admin.Warn, "pg_drop_replication_slot('outbox_relay')")
	requireCheck(t, checks, "standby lag", admin.OK, "replayed the primary's position")
	if _, ok := checks["failover"]; ok {
		t.Error("the primary's failover check runs while the relay decodes on the standby")
	}

	// A standby without feedback.
	bare := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{Slot: "bare", NoSlotSync: true,
		Settings: map[string]string{"hot_standby_feedback": "off"}})
	checks = diagnose(t, primary.URL("app"), withStandby(bare.URL("app")))
	requireCheck(t, checks, "standby hot_standby_feedback", admin.Fail, "hot_standby_feedback = on")
	requireCheck(t, checks, "pg_log_standby_snapshot", admin.OK)

	if err := bare.Stop(); err != nil {
		t.Fatal(err)
	}
	checks = diagnose(t, primary.URL("app"), withStandby(bare.URL("app")))
	requireCheck(t, checks, "standby connection", admin.Fail, "source.standby_url")
}

// TestPrune_KeepsRowsTheStandbySlotHasNotPassed (PostgreSQL 16+): decoding
// on a standby, the relay's slot lives there; retention's horizon reads it
// there (admin.NewHorizonOn), and keeps the done rows that slot could
// still send again — with the slot looked up on the primary, where there is
// none, it pruned them.
func TestPrune_KeepsRowsTheStandbySlotHasNotPassed(t *testing.T) {
	bindir := pgtest.BindirAtLeast(t, 16, "logical decoding on a standby")
	ctx := context.Background()
	primary := pgtest.NewCluster(t, pgtest.Options{Bindir: bindir})
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{NoSlotSync: true})
	pconn, err := pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer pconn.Close(ctx)
	sconn, err := pgx.Connect(ctx, standby.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer sconn.Close(ctx)
	// A slot on the standby waits for a running-transactions record.
	made := make(chan error, 1)
	go func() {
		_, err := sconn.Exec(ctx, `SELECT pg_create_logical_replication_slot('relay_on_standby', 'pgoutput')`)
		made <- err
	}()
	for waiting := true; waiting; {
		select {
		case err := <-made:
			if err != nil {
				t.Fatal(err)
			}
			waiting = false
		case <-time.After(100 * time.Millisecond):
			MustExec(t, pconn, `SELECT pg_log_standby_snapshot()`)
		}
	}
	n := migrations.DefaultNames()
	tables := admin.Tables{Outbox: n.Outbox, Ledger: n.Ledger, Checkpoint: n.Checkpoint}
	cfg := admin.RetentionConfig{DoneAfter: 7 * 24 * time.Hour, LedgerAfter: 7 * 24 * time.Hour, Batch: 100,
		Horizon: admin.NewHorizonOn("relay_on_standby", sconn)}
	prune := func() int64 {
		t.Helper()
		done, _, err := admin.Prune(ctx, pconn, tables, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return done
	}
	prune() // a sample before the rows
	MustExec(t, pconn, `INSERT INTO integration_outbox (event_key, status, created_at, processed_at)
		SELECT 'old-' || g, 'done', now() - interval '9 days', now() - interval '8 days' FROM generate_series(1, 10) g`)
	if done := prune(); done != 0 {
		t.Fatalf("pruned %d rows the standby's slot has not passed, want none", done)
	}
	// The slot passes them.
	var target string
	if err := pconn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&target); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var replayed bool
		if err := sconn.QueryRow(ctx, `SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn`, target).Scan(&replayed); err != nil {
			t.Fatal(err)
		}
		if replayed || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	MustExec(t, sconn, `SELECT pg_replication_slot_advance('relay_on_standby', pg_last_wal_replay_lsn())`)
	if done := prune(); done != 10 {
		t.Fatalf("after the standby's slot passed them: pruned %d rows, want 10", done)
	}
}
