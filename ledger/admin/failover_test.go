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

func TestDiagnose_FailoverWithoutStandby(t *testing.T) {
	f := MustFixture(t)
	requireCheck(t, diagnose(t, f.url), "failover", admin.OK, "no physical standby")
}

// TestDiagnose_Failover: with a physical standby, doctor reports what a
// failover needs that the primary can see — before 17 that the slot is
// made again after a promotion; from 17 on the relay slot's failover
// property and synchronized_standby_slots, with their fixes — and whether
// the standby sends hot_standby_feedback.
func TestDiagnose_Failover(t *testing.T) {
	ctx := context.Background()
	primary := pgtest.NewCluster(t, pgtest.Options{})
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
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	// On 17+ without slot sync: synchronized_standby_slots stays empty.
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{NoSlotSync: true})
	conn, err = pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	MustExec(t, conn, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	waitFeedback := func(on bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			var sent bool
			if err := conn.QueryRow(ctx, `SELECT xmin IS NOT NULL FROM pg_replication_slots WHERE slot_name = 'pgtest_standby'`).Scan(&sent); err != nil {
				t.Fatal(err)
			}
			if sent == on {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the standby's feedback is still %v", sent)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitFeedback(true)

	checks := diagnose(t, primary.URL("app"))
	if version < 170000 {
		requireCheck(t, checks, "failover", admin.OK, "slot pgtest_standby (streaming)", "Before PostgreSQL 17")
		return
	}
	requireCheck(t, checks, "failover", admin.OK, "slot pgtest_standby (streaming)")
	requireCheck(t, checks, "standby feedback", admin.OK)
	{
		requireCheck(t, checks, "failover slot", admin.Warn, "failover disabled", "ALTER_REPLICATION_SLOT outbox_relay (FAILOVER true)")
		requireCheck(t, checks, "synchronized_standby_slots", admin.Warn, "missing on the new primary", "ALTER SYSTEM SET synchronized_standby_slots = 'pgtest_standby'")

		MustExec(t, conn, "ALTER SYSTEM SET synchronized_standby_slots = 'pgtest_standby'")
		MustExec(t, conn, "SELECT pg_reload_conf()")
		MustExec(t, conn, "SELECT pg_drop_replication_slot('outbox_relay')")
		MustExec(t, conn, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput', false, false, true)")
		checks = diagnose(t, primary.URL("app"))
		requireCheck(t, checks, "failover slot", admin.OK, "failover enabled")
		requireCheck(t, checks, "synchronized_standby_slots", admin.OK, "pgtest_standby")

		MustExec(t, conn, "ALTER SYSTEM SET synchronized_standby_slots = 'pgtest_standby, gone'")
		MustExec(t, conn, "SELECT pg_reload_conf()")
		requireCheck(t, diagnose(t, primary.URL("app")), "synchronized_standby_slots", admin.Fail, "gone", "synchronized_standby_slots = 'pgtest_standby'")
		MustExec(t, conn, "ALTER SYSTEM RESET synchronized_standby_slots")
		MustExec(t, conn, "SELECT pg_reload_conf()")
	}

	sconn, err := pgx.Connect(ctx, standby.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer sconn.Close(ctx)
	MustExec(t, sconn, "ALTER SYSTEM SET hot_standby_feedback = off")
	MustExec(t, sconn, "SELECT pg_reload_conf()")
	waitFeedback(false)
	requireCheck(t, diagnose(t, primary.URL("app")), "standby feedback", admin.Warn, "pgtest_standby", "hot_standby_feedback = on", "sync_replication_slots = on", "dbname=app")
}
