package replication_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestRecreatesSlotInvalidatedByIdleTimeout: PostgreSQL 18 invalidates, at
// a checkpoint, a slot no one has used for idle_replication_slot_timeout
// (at least 1s: the setting is in seconds). A relay that was down that long
// must notice it as it notices a slot lost past max_slot_wal_keep_size: drop
// and recreate the slot, handing the rows committed meanwhile to the claim
// path, and stream again.
func TestRecreatesSlotInvalidatedByIdleTimeout(t *testing.T) {
	ctx := context.Background()
	var version int
	// The shared cluster runs the same binaries: ask it before starting one.
	if err := mustConnect(t, pgtest.NewDatabase(t)).QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if version < 180000 {
		t.Skipf("server_version_num %d: idle_replication_slot_timeout is new in PostgreSQL 18", version)
	}
	// A cluster of its own: the timeout applies to every slot of a cluster.
	cluster := pgtest.NewCluster(t, pgtest.Options{})
	admin := mustConnect(t, cluster.URL("postgres"))
	if err := cluster.CreateDatabase(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	e := &testEnv{url: cluster.URL("relay"), slot: "outbox_relay"}
	e.conn = mustConnect(t, e.url)
	if _, err := migrations.Migrate(ctx, e.conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}

	c1 := &fakeConsumer{}
	claim1 := &claimRecorder{url: e.url}
	r := start(t, e.config(t, c1, &fakeCheckpoint{}, claim1))
	waitStreaming(t, c1, 1)
	claim1.waitCalls(t, 1) // the hand-over finishes beside the stream
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}

	// Rows the invalidated slot will never stream; then the slot stays
	// unused past the timeout and a checkpoint invalidates it.
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type) SELECT 'idle-' || g, 'x' FROM generate_series(1, 4) g`)
	mustExec(t, admin, "ALTER SYSTEM SET idle_replication_slot_timeout = '1s'")
	mustExec(t, admin, "SELECT pg_reload_conf()")
	t.Cleanup(func() {
		mustExec(t, admin, "ALTER SYSTEM RESET idle_replication_slot_timeout")
		mustExec(t, admin, "SELECT pg_reload_conf()")
	})
	var walStatus, reason string
	waitFor(t, 30*time.Second, "the idle slot to be invalidated", func() bool {
		time.Sleep(500 * time.Millisecond)
		mustExec(t, admin, "CHECKPOINT")
		err := admin.QueryRow(ctx, `SELECT coalesce(wal_status, ''), coalesce(invalidation_reason, '')
			FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&walStatus, &reason)
		if err != nil {
			t.Fatal(err)
		}
		return reason != ""
	})
	t.Logf("invalidated slot: wal_status %q, invalidation_reason %q", walStatus, reason)
	if reason != "idle_timeout" {
		t.Fatalf("invalidation_reason = %q, want idle_timeout", reason)
	}
	mustExec(t, admin, "ALTER SYSTEM RESET idle_replication_slot_timeout")
	mustExec(t, admin, "SELECT pg_reload_conf()")

	logs := &logBuffer{}
	c2 := &fakeConsumer{}
	claim := &claimRecorder{url: e.url}
	cfg := e.config(t, c2, &fakeCheckpoint{}, claim)
	cfg.Logger = zerolog.New(zerolog.MultiLevelWriter(zerolog.SyncWriter(logs), zerolog.NewTestWriter(t)))
	start(t, cfg)
	waitStreaming(t, c2, 1)
	if _, counts := claim.waitCalls(t, 1); len(counts) != 1 || counts[0] != 4 {
		t.Fatalf("hand-over counts %v, want one hand-over of the 4 rows", counts)
	}
	if got := logs.String(); !strings.Contains(got, "replication slot was invalidated") || !strings.Contains(got, `"reason":"idle_timeout"`) {
		t.Errorf("the log does not report the invalidation and its reason idle_timeout:\n%s", got)
	}
	if err := admin.QueryRow(ctx, `SELECT coalesce(invalidation_reason, '') FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&reason); err != nil || reason != "" {
		t.Fatalf("the recreated slot: invalidation_reason %q, err %v", reason, err)
	}
	e.insert(t, "after")
	waitFor(t, 10*time.Second, "streaming on the recreated slot", func() bool { return c2.commitOf("after") != 0 })
}
