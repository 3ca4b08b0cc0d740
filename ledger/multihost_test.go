package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestConnectionsFollowTheWritableHost: with a multi-host URL whose first
// host is a standby (target_session_attrs=read-write), the leader lock, the
// owner lock, LISTEN and the stale-walsender check all connect to the
// primary: their dedicated connections keep the URL's hosts and its
// read-write check.
func TestConnectionsFollowTheWritableHost(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary, standby := mustPrimaryAndStandby(ctx, t)
	url := pgtest.MultiHostURL("app", standby, primary)
	onPrimary, err := pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer onPrimary.Close(ctx)
	count := func(sql string) int {
		t.Helper()
		var n int
		if err := onPrimary.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return n
	}

	leader, err := ledger.AcquireLeader(ctx, url, "outbox_relay", zerolog.New(zerolog.NewTestWriter(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Release()
	if n := count(`SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = 'outbox-relay leader outbox_relay'`); n != 1 {
		t.Errorf("leader lock sessions on the primary: %d, want 1", n)
	}

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	store := mustStore(t, pool, ledger.DefaultConfig())
	lock, err := store.LockOwner(ctx, "outbox-relay:test:1")
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Release()
	if n := count(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2`); n != 1 {
		t.Errorf("owner locks on the primary: %d, want 1", n)
	}

	notified := make(chan struct{}, 16)
	lctx, stopListen := context.WithCancel(ctx)
	listening := make(chan error, 1)
	go func() {
		listening <- store.Listen(lctx, "failover_test", func() { notified <- struct{}{} })
	}()
	<-notified // the first call says it listens
	if _, err := onPrimary.Exec(ctx, "NOTIFY failover_test"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-notified:
	case err := <-listening:
		t.Fatalf("Listen ended: %v", err)
	case <-time.After(10 * time.Second):
		t.Error("a NOTIFY on the primary did not reach Listen: it listens on the standby")
	}
	stopListen()

	// A walsender holding a slot on the primary is found and ended.
	if _, err := onPrimary.Exec(ctx, "SELECT pg_create_logical_replication_slot('held', 'pgoutput')"); err != nil {
		t.Fatal(err)
	}
	repl, err := pgconn.Connect(ctx, primary.URL("app")+"&replication=database")
	if err != nil {
		t.Fatal(err)
	}
	defer repl.Close(ctx)
	if err := pglogrepl.StartReplication(ctx, repl, "held", 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names 'outbox_relay'"},
	}); err != nil {
		t.Fatal(err)
	}
	if pid, err := ledger.TerminateStaleWalsender(ctx, url, "held"); err != nil || pid == 0 {
		t.Errorf("TerminateStaleWalsender = %d, %v; want the primary's walsender ended", pid, err)
	}
}
