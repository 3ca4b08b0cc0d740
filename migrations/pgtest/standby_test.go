package pgtest_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// TestStandbyFollowsAndPromotes builds a standby from a cold copy of the
// primary, checks that it replays the primary's writes (and on 17+ keeps a
// failover-enabled logical slot in sync), then kills the primary, promotes
// the standby and writes to it through a multi-host URL.
func TestStandbyFollowsAndPromotes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary := pgtest.NewCluster(t, pgtest.Options{})
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	pconn := connect(t, primary.URL("app"))
	exec(t, pconn, "CREATE TABLE events (id int PRIMARY KEY)")
	exec(t, pconn, "INSERT INTO events SELECT generate_series(1, 10)")
	version, err := strconv.Atoi(queryString(t, pconn, "SHOW server_version_num"))
	if err != nil {
		t.Fatal(err)
	}

	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{})
	pconn = connect(t, primary.URL("app")) // the copy restarted the primary
	exec(t, pconn, "INSERT INTO events SELECT generate_series(11, 20)")
	if version >= 170000 {
		if got := queryString(t, pconn, "SHOW synchronized_standby_slots"); got != "pgtest_standby" {
			t.Errorf("primary: synchronized_standby_slots = %q, want pgtest_standby", got)
		}
		exec(t, pconn, "SELECT pg_create_logical_replication_slot('synced', 'pgoutput', false, false, true)")
	}

	sconn := connect(t, standby.URL("app"))
	if got := queryString(t, sconn, "SELECT pg_is_in_recovery()::text"); got != "true" {
		t.Fatalf("standby: pg_is_in_recovery() = %s", got)
	}
	waitFor(t, ctx, "the standby to replay the 20 rows", func() bool {
		return queryString(t, sconn, "SELECT count(*)::text FROM events") == "20"
	})
	if version >= 170000 {
		// A synced slot is temporary on the standby (and dropped at
		// promotion) until the primary's slot moves past what the standby
		// reserved for it: advance it.
		waitFor(t, ctx, "the standby to sync the failover slot", func() bool {
			exec(t, pconn, "INSERT INTO events VALUES (1000) ON CONFLICT DO NOTHING")
			exec(t, pconn, "SELECT pg_replication_slot_advance('synced', pg_current_wal_lsn())")
			exec(t, pconn, "SELECT pg_log_standby_snapshot()")
			return queryString(t, sconn, "SELECT count(*)::text FROM pg_replication_slots WHERE slot_name = 'synced' AND synced AND NOT temporary") == "1"
		})
		exec(t, pconn, "DELETE FROM events WHERE id = 1000")
		waitFor(t, ctx, "the standby to replay the delete", func() bool {
			return queryString(t, sconn, "SELECT count(*)::text FROM events") == "20"
		})
	}

	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	multi := connect(t, pgtest.MultiHostURL("app", primary, standby))
	if got := queryString(t, multi, "SELECT inet_server_port()::text"); got != strconv.Itoa(standby.Port()) {
		t.Errorf("multi-host URL connected to port %s, want the promoted standby's %d", got, standby.Port())
	}
	exec(t, multi, "INSERT INTO events VALUES (21)")
	if got := queryString(t, multi, "SELECT count(*)::text FROM events"); got != "21" {
		t.Errorf("after promotion: %s rows, want 21", got)
	}
	if version >= 170000 {
		if got := queryString(t, multi, "SELECT count(*)::text FROM pg_replication_slots WHERE slot_name = 'synced'"); got != "1" {
			t.Errorf("after promotion: failover slot missing")
		}
	}
}

// TestMultiHostURLSkipsStandby checks that a multi-host URL whose first host
// is a standby connects to the primary.
func TestMultiHostURLSkipsStandby(t *testing.T) {
	primary := pgtest.NewCluster(t, pgtest.Options{})
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{})
	conn := connect(t, pgtest.MultiHostURL("postgres", standby, primary))
	if got := queryString(t, conn, "SELECT pg_is_in_recovery()::text"); got != "false" {
		t.Errorf("multi-host URL with the standby first connected to a server in recovery")
	}
}

func waitFor(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// TestStandbyThroughProxy: a standby streaming through a proxy that
// black-holes its connection misses the writes the primary acknowledges
// meanwhile, and a failover then loses them.
func TestStandbyThroughProxy(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary := pgtest.NewCluster(t, pgtest.Options{})
	proxy := netfault.NewProxy(t, "127.0.0.1:"+strconv.Itoa(primary.Port()))
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{NoSlotSync: true, PrimaryAddr: proxy.Addr()})
	pconn := connect(t, primary.URL("postgres"))
	exec(t, pconn, "CREATE TABLE events (id int PRIMARY KEY)")
	sconn := connect(t, standby.URL("postgres"))
	waitFor(t, ctx, "the table on the standby", func() bool {
		return queryString(t, sconn, "SELECT (to_regclass('events') IS NOT NULL)::text") == "true"
	})

	proxy.BlackHole(netfault.NewConnsBlackHole)
	exec(t, pconn, "INSERT INTO events VALUES (1)")
	time.Sleep(300 * time.Millisecond)
	if got := queryString(t, sconn, "SELECT count(*)::text FROM events"); got != "0" {
		t.Fatalf("the standby has %s rows while its link is black-holed", got)
	}
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	proxy.ResetConns()
	proxy.Pass()
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	if got := queryString(t, sconn, "SELECT count(*)::text FROM events"); got != "0" {
		t.Errorf("after the failover the new primary has %s rows, want the acknowledged one lost", got)
	}
}

// TestStandbyRebuiltAfterFailover: a standby starts without the primary's
// slots (a copied slot would hold WAL from the copy on); after a failover a
// new standby of the promoted server is built on the old primary's port
// (online with pg_basebackup where the bin dir has it, else from a cold
// copy), replays its writes, and a multi-host URL naming the old primary's
// port first still reaches the writable server.
func TestStandbyRebuiltAfterFailover(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary := pgtest.NewCluster(t, pgtest.Options{})
	pconn := connect(t, primary.URL("postgres"))
	exec(t, pconn, "CREATE TABLE events (id int PRIMARY KEY)")
	exec(t, pconn, "SELECT pg_create_logical_replication_slot('copied', 'pgoutput')")
	first := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{})
	sconn := connect(t, first.URL("postgres"))
	if got := queryString(t, sconn, "SELECT count(*)::text FROM pg_replication_slots"); got != "0" {
		t.Errorf("the standby holds %s replication slots copied from the primary, want 0", got)
	}

	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := first.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	online := first.CanCopyOnline()
	t.Logf("rebuilding the standby online (pg_basebackup): %v", online)
	oldPort := primary.Port()
	if err := primary.Close(); err != nil {
		t.Fatal(err)
	}
	second := pgtest.NewStandby(t, first, pgtest.StandbyOptions{Port: oldPort, Online: online})
	if second.Port() != oldPort {
		t.Errorf("the new standby listens on %d, want the old primary's %d", second.Port(), oldPort)
	}
	multi := connect(t, pgtest.MultiHostURL("postgres", second, first))
	exec(t, multi, "INSERT INTO events VALUES (1)")
	nconn := connect(t, second.URL("postgres"))
	waitFor(t, ctx, "the new standby to replay the row written after the failover", func() bool {
		return queryString(t, nconn, "SELECT count(*)::text FROM events") == "1"
	})
	if got := queryString(t, nconn, "SELECT pg_is_in_recovery()::text"); got != "true" {
		t.Errorf("the rebuilt server is not in recovery")
	}
}
