package admin_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// serverVersion returns the server_version_num of the package's servers (the
// shared cluster runs the same binaries as NewCluster's).
func serverVersion(tb testing.TB) int {
	tb.Helper()
	conn := MustConnect(tb, pgtest.NewDatabase(tb), "version")
	var v int
	if err := conn.QueryRow(context.Background(), "SELECT current_setting('server_version_num')::int").Scan(&v); err != nil {
		tb.Fatal(err)
	}
	return v
}

// MustIdleInvalidatedSlot returns the URL of a migrated database, on a
// cluster of its own (the timeout applies to every slot of a cluster), whose
// slot outbox_relay PostgreSQL 18 invalidated for idleness
// (idle_replication_slot_timeout, checked at checkpoints). It skips tb on
// older servers.
func MustIdleInvalidatedSlot(tb testing.TB) string {
	tb.Helper()
	if v := serverVersion(tb); v < 180000 {
		tb.Skipf("server_version_num %d: idle_replication_slot_timeout is new in PostgreSQL 18", v)
	}
	ctx := context.Background()
	cluster := pgtest.NewCluster(tb, pgtest.Options{})
	if err := cluster.CreateDatabase(ctx, "relay"); err != nil {
		tb.Fatal(err)
	}
	conn := MustConnect(tb, cluster.URL("relay"), "setup")
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		tb.Fatal(err)
	}
	MustExec(tb, conn, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	MustExec(tb, conn, "ALTER SYSTEM SET idle_replication_slot_timeout = '1s'")
	MustExec(tb, conn, "SELECT pg_reload_conf()")
	deadline := time.Now().Add(30 * time.Second)
	for {
		time.Sleep(500 * time.Millisecond)
		MustExec(tb, conn, "CHECKPOINT")
		var reason string
		err := conn.QueryRow(ctx, "SELECT coalesce(invalidation_reason, '') FROM pg_replication_slots WHERE slot_name = 'outbox_relay'").Scan(&reason)
		if err != nil {
			tb.Fatal(err)
		}
		if reason == "idle_timeout" {
			break
		}
		if time.Now().After(deadline) {
			tb.Fatalf("slot not invalidated 30s after idle_replication_slot_timeout = 1s (invalidation_reason %q)", reason)
		}
	}
	return cluster.URL("relay")
}

// TestDiagnose_SlotInvalidatedByIdleTimeout: on PostgreSQL 18 doctor says
// why the slot was invalidated (before, it blamed max_slot_wal_keep_size),
// does not count WAL as retained by it (18 keeps its restart_lsn), and
// reports the timeout itself.
func TestDiagnose_SlotInvalidatedByIdleTimeout(t *testing.T) {
	url := MustIdleInvalidatedSlot(t)
	checks := diagnose(t, url)
	requireCheck(t, checks, "slot outbox_relay", admin.Warn, "invalidation_reason idle_timeout", "idle_replication_slot_timeout", "run drops and recreates it")
	if c := checks["slot outbox_relay"]; strings.Contains(c.Detail, "max_slot_wal_keep_size") {
		t.Errorf("slot check blames max_slot_wal_keep_size for an idle timeout: %s", c.Detail)
	}
	if c, ok := checks["retained WAL"]; ok {
		t.Errorf("retained WAL reported for an invalidated slot: %s %s", c.Status, c.Detail)
	}
	requireCheck(t, checks, "idle_replication_slot_timeout", admin.Warn, "1s", "HA takeover", "ALTER SYSTEM SET idle_replication_slot_timeout = '1h';")

	conn := MustConnect(t, url, "setup")
	MustExec(t, conn, "ALTER SYSTEM SET idle_replication_slot_timeout = '1d'")
	MustExec(t, conn, "SELECT pg_reload_conf()")
	waitFor(t, func() bool { return diagnose(t, url)["idle_replication_slot_timeout"].Status == admin.OK })
	requireCheck(t, diagnose(t, url), "idle_replication_slot_timeout", admin.OK, "24h0m0s", "loses its slot")
}

// TestReadStatus_SlotInvalidatedByIdleTimeout: status shows the reason and
// no retained WAL for a slot PostgreSQL 18 invalidated for idleness.
func TestReadStatus_SlotInvalidatedByIdleTimeout(t *testing.T) {
	url := MustIdleInvalidatedSlot(t)
	conn := MustConnect(t, url, "status")
	n := migrations.DefaultNames()
	st, err := admin.ReadStatus(context.Background(), conn, admin.Tables{Outbox: n.Outbox, Ledger: n.Ledger, Checkpoint: n.Checkpoint},
		admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")})
	if err != nil {
		t.Fatal(err)
	}
	if !st.Slot.Exists || st.Slot.WALStatus != "lost" || st.Slot.InvalidationReason != "idle_timeout" || st.Slot.RetainedWALBytes != nil {
		t.Fatalf("slot status %+v (retained %v), want exists, wal_status lost, invalidation_reason idle_timeout, no retained WAL", st.Slot, st.Slot.RetainedWALBytes)
	}
}
