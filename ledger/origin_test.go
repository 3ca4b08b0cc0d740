package ledger_test

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// serverOrigin reads the server's system identifier and timeline, as
// IDENTIFY_SYSTEM reports them.
func serverOrigin(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (string, int32) {
	t.Helper()
	var systemID string
	var timeline int32
	err := q.QueryRow(context.Background(), `SELECT system_identifier::text,
		('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int FROM pg_control_system()`).Scan(&systemID, &timeline)
	if err != nil {
		t.Fatal(err)
	}
	return systemID, timeline
}

// TestStreamFromGuardsStreamWrites: once the stream is bound to a timeline
// the server is not on, SettleStream and SaveCheckpoint roll
// back with relay.ErrServerChanged and change nothing; bound to the
// server's own, they write.
func TestStreamFromGuardsStreamWrites(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	systemID, timeline := serverOrigin(t, f.pool)
	ids := f.MustInsert(t, row{Key: "k1"}, row{Key: "k2"})

	if err := f.store.StreamFrom(ctx, systemID, timeline+1); err != nil {
		t.Fatal(err)
	}
	dead := []*relay.Work{streamWork(ids[0], "k1", relay.Decision{Kind: relay.DeadLetter, Reason: "bad"}, outcomePair("webhook", relay.Failed))}
	if _, err := f.store.SettleStream(ctx, dead, "relay-a"); !errors.Is(err, relay.ErrServerChanged) {
		t.Errorf("SettleStream on another timeline = %v, want ErrServerChanged", err)
	}
	done := []*relay.Work{streamWork(ids[1], "k2", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered))}
	if _, err := f.store.SettleStream(ctx, done, "relay-a"); !errors.Is(err, relay.ErrServerChanged) {
		t.Errorf("SettleStream (done) on another timeline = %v, want ErrServerChanged", err)
	}
	if err := f.store.SaveCheckpoint(ctx, "s", 42); !errors.Is(err, relay.ErrServerChanged) {
		t.Errorf("SaveCheckpoint on another timeline = %v, want ErrServerChanged", err)
	}
	for i, id := range ids {
		if r := f.MustRow(t, id); r.Status != "pending" {
			t.Errorf("row %d after refused writes: %s, want pending", i, r)
		}
	}
	if lsn, err := f.store.LoadCheckpoint(ctx, "s"); err != nil || lsn != 0 {
		t.Errorf("checkpoint after a refused write = %v, %v; want none", lsn, err)
	}

	f.store.BeginTerm()
	if err := f.store.StreamFrom(ctx, systemID, timeline); err != nil {
		t.Fatal(err)
	}
	if _, err := f.store.SettleStream(ctx, dead, "relay-a"); err != nil {
		t.Fatalf("SettleStream on the stream's timeline: %v", err)
	}
	if _, err := f.store.SettleStream(ctx, done, "relay-a"); err != nil {
		t.Fatalf("SettleStream (done) on the stream's timeline: %v", err)
	}
	if err := f.store.SaveCheckpoint(ctx, "s", 42); err != nil {
		t.Fatalf("SaveCheckpoint on the stream's timeline: %v", err)
	}
	if r := f.MustRow(t, ids[0]); r.Status != "failed" {
		t.Errorf("dead-lettered row: %s", r)
	}
	if r := f.MustRow(t, ids[1]); r.Status != "done" {
		t.Errorf("row marked done: %s", r)
	}
}

// TestStreamFromOneServerPerTerm: within a term the stream may not move to
// another server; the next term may.
func TestStreamFromOneServerPerTerm(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.store.BeginTerm()
	if err := f.store.StreamFrom(ctx, "7", 1); err != nil {
		t.Fatalf("first StreamFrom: %v", err)
	}
	if err := f.store.StreamFrom(ctx, "7", 1); err != nil {
		t.Fatalf("StreamFrom the same server again: %v", err)
	}
	if err := f.store.StreamFrom(ctx, "7", 2); !errors.Is(err, relay.ErrServerChanged) {
		t.Fatalf("StreamFrom another timeline in the same term = %v, want ErrServerChanged", err)
	}
	f.store.BeginTerm()
	if err := f.store.StreamFrom(ctx, "7", 2); err != nil {
		t.Fatalf("StreamFrom another timeline in a new term: %v", err)
	}
}

// TestStreamWritesRefusedAfterPromotion: a Store on a multi-host URL, bound
// to the primary's timeline, writes nothing on the promoted standby: its
// rows keep their state (an id the old primary used may belong to another
// row there).
func TestStreamWritesRefusedAfterPromotion(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary, standby := mustPrimaryAndStandby(ctx, t)
	pool, err := pgxpool.New(ctx, pgtest.MultiHostURL("app", primary, standby))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	store := mustStore(t, pool, ledger.DefaultConfig())
	systemID, timeline := serverOrigin(t, pool)
	if err := store.StreamFrom(ctx, systemID, timeline); err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := pool.QueryRow(ctx, `INSERT INTO integration_outbox (event_type, event_key, payload) VALUES ('t', 'k1', '{}') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	sconn, err := pgx.Connect(ctx, standby.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer sconn.Close(ctx)
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := sconn.QueryRow(ctx, "SELECT count(*) FROM integration_outbox").Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the standby did not replay the row")
		}
		time.Sleep(20 * time.Millisecond)
	}

	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	pool.Reset() // its connections died with the old primary
	_, newTimeline := serverOrigin(t, pool)
	if newTimeline == timeline {
		t.Fatalf("the promoted standby is on timeline %d, the old primary's", newTimeline)
	}
	dead := []*relay.Work{streamWork(id, "k1", relay.Decision{Kind: relay.DeadLetter, Reason: "bad"}, outcomePair("webhook", relay.Failed))}
	if _, err := store.SettleStream(ctx, dead, "relay-a"); !errors.Is(err, relay.ErrServerChanged) || !strings.Contains(err.Error(), "timeline "+strconv.Itoa(int(newTimeline))) {
		t.Errorf("SettleStream after the promotion = %v, want ErrServerChanged naming timeline %d", err, newTimeline)
	}
	if err := store.SaveCheckpoint(ctx, "s", 42); !errors.Is(err, relay.ErrServerChanged) {
		t.Errorf("SaveCheckpoint after the promotion = %v, want ErrServerChanged", err)
	}
	var status string
	if err := pool.QueryRow(ctx, "SELECT status FROM integration_outbox WHERE id = $1", id).Scan(&status); err != nil || status != "pending" {
		t.Errorf("row on the new primary: %q, %v; want pending", status, err)
	}
}

// TestSaveCheckpointWaitsForStandbys (PostgreSQL 17+): with
// synchronized_standby_slots naming the standby's slot, SaveCheckpoint
// returns only once the standby has flushed the checkpoint; while its link
// is black-holed it fails, naming the slot.
func TestSaveCheckpointWaitsForStandbys(t *testing.T) {
	ctx := context.Background()
	var version int
	if err := MustFixture(t).pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if version < 170000 {
		t.Skipf("server_version_num %d: synchronized_standby_slots is new in PostgreSQL 17", version)
	}
	primary := pgtest.NewCluster(t, pgtest.Options{})
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	link := netfault.NewProxy(t, "127.0.0.1:"+strconv.Itoa(primary.Port()))
	pgtest.NewStandby(t, primary, pgtest.StandbyOptions{PrimaryAddr: link.Addr()})
	conn, err := pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	pool, err := pgxpool.New(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	store := mustStore(t, pool, ledger.DefaultConfig())
	if err := store.SaveCheckpoint(ctx, "s", 1); err != nil {
		t.Fatalf("SaveCheckpoint with the standby streaming: %v", err)
	}

	link.BlackHole(netfault.NewConnsBlackHole)
	short, cancel := context.WithTimeout(ctx, time.Second)
	err = store.SaveCheckpoint(short, "s", 2)
	cancel()
	if err == nil || !strings.Contains(err.Error(), "pgtest_standby") {
		t.Fatalf("SaveCheckpoint with the standby cut off = %v, want an error naming its slot", err)
	}
	link.Pass()
	if err := store.SaveCheckpoint(ctx, "s", 3); err != nil {
		t.Fatalf("SaveCheckpoint once the standby streams again: %v", err)
	}
}

// TestOriginGuardNeedsNoPrivileges: the timeline check and the standby wait
// run as a role with only the table privileges run needs.
func TestOriginGuardNeedsNoPrivileges(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	var db string
	if err := f.pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	role := db + "_r"
	f.MustExec(t, `CREATE ROLE "`+role+`" LOGIN`)
	t.Cleanup(func() {
		f.MustExec(t, `DROP OWNED BY "`+role+`"`)
		f.MustExec(t, `DROP ROLE "`+role+`"`)
	})
	f.MustExec(t, `GRANT SELECT, UPDATE ON integration_outbox TO "`+role+`"`)
	f.MustExec(t, `GRANT SELECT, INSERT, UPDATE, DELETE ON integration_idempotency, relay_checkpoint TO "`+role+`"`)
	u, err := url.Parse(f.url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	store := mustStore(t, pool, ledger.DefaultConfig())
	systemID, timeline := serverOrigin(t, f.pool)
	if err := store.StreamFrom(ctx, systemID, timeline); err != nil {
		t.Fatal(err)
	}
	ids := f.MustInsert(t, row{Key: "k1"})
	done := []*relay.Work{streamWork(ids[0], "k1", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered))}
	if _, err := store.SettleStream(ctx, done, "relay-a"); err != nil {
		t.Fatalf("SettleStream as %s: %v", role, err)
	}
	if err := store.SaveCheckpoint(ctx, "s", 42); err != nil {
		t.Fatalf("SaveCheckpoint as %s: %v", role, err)
	}
}

// TestStreamFromGuardsTheSystemToo: another cluster behind the same host
// name can be on the same timeline number (every fresh cluster starts on
// timeline 1). The guard compares the system identifier as well: bound to
// another system, the stream's writes are refused and change nothing.
func TestStreamFromGuardsTheSystemToo(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	_, timeline := serverOrigin(t, f.pool)
	ids := f.MustInsert(t, row{Key: "k1"})
	if err := f.store.StreamFrom(ctx, "7000000000000000001", timeline); err != nil {
		t.Fatal(err)
	}
	dead := []*relay.Work{streamWork(ids[0], "k1", relay.Decision{Kind: relay.DeadLetter, Reason: "bad"}, outcomePair("webhook", relay.Failed))}
	if _, err := f.store.SettleStream(ctx, dead, "relay-a"); !errors.Is(err, relay.ErrServerChanged) {
		t.Errorf("SettleStream on another system, same timeline = %v, want ErrServerChanged", err)
	}
	if err := f.store.SaveCheckpoint(ctx, "s", 42); !errors.Is(err, relay.ErrServerChanged) {
		t.Errorf("SaveCheckpoint on another system = %v, want ErrServerChanged", err)
	}
	if r := f.MustRow(t, ids[0]); r.Status != "pending" {
		t.Errorf("row after refused writes: %s, want pending", r)
	}
}

// TestHoldClaimsAreGuarded: the stream's pre-send claims of a sink with
// on_unknown: hold are written like its outcomes: on the timeline its
// events came from only. On another, PrepareStream is refused and no
// claim is written (an event key the new primary reuses for another event
// would otherwise be claimed for it).
func TestHoldClaimsAreGuarded(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	systemID, timeline := serverOrigin(t, f.pool)
	if err := f.store.StreamFrom(ctx, systemID, timeline+1); err != nil {
		t.Fatal(err)
	}
	works := []*relay.Work{streamWork(1, "k-hold", relay.Decision{}, &relay.Pair{Sink: "hold", Hold: true})}
	if err := f.store.PrepareStream(ctx, works, false, "relay-a"); !errors.Is(err, relay.ErrServerChanged) {
		t.Fatalf("PrepareStream(hold claim) on another timeline = %v, want ErrServerChanged", err)
	}
	if n := f.MustCount(t, `SELECT count(*) FROM integration_idempotency`); n != 0 {
		t.Fatalf("%d ledger claims written on another timeline, want none", n)
	}
}
