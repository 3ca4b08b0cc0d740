package main

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// syncBuffer is written by the relay subprocess and the receiver at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// relayBinary builds the relay once for the package's tests, in a directory
// pgtest.Main removes after them.
var relayBinary = sync.OnceValues(func() (string, error) {
	dir, err := pgtest.SharedDir("outbox-relay-dev-test-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "outbox-relay")
	if out, err := exec.Command("go", "build", "-o", bin, "../outbox-relay").CombinedOutput(); err != nil {
		return "", fmt.Errorf("build the relay: %v\n%s", err, out)
	}
	return bin, nil
})

// mustRun runs make run's tour with --once against databaseURL ("" for a
// private cluster) and returns its output; it fails t when the tour fails.
func mustRun(t *testing.T, databaseURL string) string {
	t.Helper()
	out, err := tour(t, databaseURL)
	if err != nil {
		t.Fatalf("make run: %v\noutput:\n%s", err, out)
	}
	return out
}

func tour(t *testing.T, databaseURL string) (string, error) {
	t.Helper()
	bin, err := relayBinary()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out syncBuffer
	err = run(ctx, options{relayBin: bin, once: true, databaseURL: databaseURL}, &out)
	return out.String(), err
}

// requireOutput fails t unless out contains each of want, in order.
func requireOutput(t *testing.T, out string, want ...string) {
	t.Helper()
	rest := out
	for _, w := range want {
		i := strings.Index(rest, w)
		if i < 0 {
			t.Errorf("output lacks %q (after the lines before it)", w)
			continue
		}
		rest = rest[i+len(w):]
	}
}

// TestMakeRun is what `make run` does on a fresh machine, with --once: a
// private cluster, migrate, the relay with the embedded NATS server (asked
// for with --embedded-nats) and a webhook receiver, sample events arriving,
// and a clean SIGTERM stop. Output that is not a terminal has no escape
// codes, migrate and run log alike (console), and each thing is said once.
func TestMakeRun(t *testing.T) {
	got := mustRun(t, "")
	requireOutput(t, got,
		fmt.Sprintf("migrated integration_outbox from version 0 to %d", migrations.Latest()), "created publication outbox_relay",
		"outbox-relay run --config", "--embedded-nats", "embedded NATS server", "natscli",
		"outbox_publish(lead.created, lead/L1, sample-", "webhook received event ", "lead.qualified lead/L1",
		"all 3 sample events arrived", "relay stopped", "stopping the private cluster")
	if strings.Contains(got, "\x1b[") {
		t.Error("output to a pipe carries terminal escape codes")
	}
	if strings.Contains(got, `{"level"`) {
		t.Error("some lines are JSON: migrate and run should log alike")
	}
	if n := strings.Count(got, "created publication"); n != 1 {
		t.Errorf("%q said %d times", "created publication", n)
	}
	if strings.Contains(got, "webhook received #") {
		t.Error("the webhook line numbers events like a counter; it shows the row id")
	}
	if t.Failed() {
		t.Logf("output:\n%s", got)
	}
}

// userDatabase is a database as a user has it: migrated with the defaults,
// with pending rows in integration_outbox that the user's own relay (not
// running now) has yet to deliver. Its URL carries a password, which the
// shared cluster's trust authentication ignores.
func userDatabase(t *testing.T) (dbURL string, conn *pgx.Conn) {
	t.Helper()
	dbURL = pgtest.NewDatabase(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if _, err := conn.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', $1, $2, '{"real": true}')`, fmt.Sprint(i), fmt.Sprintf("real-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	u, _ := url.Parse(dbURL)
	u.User = url.UserPassword(u.User.Username(), "s3cret-pw")
	return u.String(), conn
}

// TestMakeRun_AttachedDatabaseLeavesItsEventsAlone: DATABASE_URL=… make run
// against a database holding real pending events delivers the tour's own
// samples and nothing else: the user's rows stay pending, untouched, with
// no ledger row; no slot named outbox_relay is
// created; what the tour created is listed before it is created and gone
// after; the password is never printed.
func TestMakeRun_AttachedDatabaseLeavesItsEventsAlone(t *testing.T) {
	dbURL, conn := userDatabase(t)
	got := mustRun(t, dbURL)
	requireOutput(t, got,
		"attaching to postgres@127.0.0.1:", "make run leaves your events alone", "schema       outbox_relay_dev", "publication  outbox_relay_dev",
		"slot         outbox_relay_dev", "created schema outbox_relay_dev", "outbox-relay migrate --config",
		"outbox_relay_dev.outbox_publish(lead.created", "webhook received event ", "all 3 sample events arrived",
		"removed the slot outbox_relay_dev, the publication outbox_relay_dev and the schema outbox_relay_dev")
	if strings.Contains(got, "s3cret-pw") {
		t.Error("the output shows the database password")
	}

	ctx := context.Background()
	var pending, untouched, ledger, userSlots, devObjects int
	err := conn.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM integration_outbox WHERE status = 'pending'),
		(SELECT count(*) FROM integration_outbox WHERE attempts = 0 AND handoff_at IS NULL AND locked_by IS NULL AND processed_at IS NULL AND last_error IS NULL),
		(SELECT count(*) FROM integration_idempotency),
		(SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay'),
		(SELECT count(*) FROM pg_namespace WHERE nspname = 'outbox_relay_dev')
		  + (SELECT count(*) FROM pg_publication WHERE pubname = 'outbox_relay_dev')
		  + (SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay_dev')`).
		Scan(&pending, &untouched, &ledger, &userSlots, &devObjects)
	if err != nil {
		t.Fatal(err)
	}
	if pending != 5 || untouched != 5 || ledger != 0 {
		t.Errorf("the user's outbox was touched: %d of 5 rows pending, %d untouched; %d ledger rows", pending, untouched, ledger)
	}
	if userSlots != 0 {
		t.Error("make run created the slot outbox_relay, the user's relay's")
	}
	if devObjects != 0 {
		t.Errorf("%d of the tour's objects are left in the database", devObjects)
	}
	if t.Failed() {
		t.Logf("output:\n%s", got)
	}
}

// TestMakeRun_WALLevelReplica: against a server with wal_level=replica the
// tour says at once that the relay polls, why, and the fix, and the
// samples still arrive (by the claim path); it does not wait for a stream
// that cannot start.
func TestMakeRun_WALLevelReplica(t *testing.T) {
	c := pgtest.NewCluster(t, pgtest.Options{WALLevel: "replica"})
	if err := c.CreateDatabase(context.Background(), "app"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	got := mustRun(t, c.URL("app"))
	requireOutput(t, got, "wal_level is replica on this server: the relay cannot stream", "ALTER SYSTEM SET wal_level = logical",
		"outbox-relay run --config", "webhook received event ", "all 3 sample events arrived")
	if strings.Contains(got, "waiting for the relay to stream") {
		t.Error("waited for a stream that cannot start")
	}
	t.Logf("the tour took %v", time.Since(start).Round(time.Millisecond))
	if t.Failed() {
		t.Logf("output:\n%s", got)
	}
}

// TestMakeRun_RoleThatMayNotCreate: a least-privilege role that may not
// create the tour's schema gets the reason and the fix, and nothing is
// created.
func TestMakeRun_RoleThatMayNotCreate(t *testing.T) {
	dbURL, conn := userDatabase(t)
	ctx := context.Background()
	if _, err := conn.Exec(ctx, `CREATE ROLE dev_tour_app LOGIN; GRANT SELECT, INSERT, UPDATE, DELETE ON integration_outbox TO dev_tour_app`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Exec(context.Background(), `DROP OWNED BY dev_tour_app; DROP ROLE dev_tour_app`) })
	u, _ := url.Parse(dbURL)
	u.User = url.UserPassword("dev_tour_app", "pw")
	got, err := tour(t, u.String())
	if err == nil || !strings.Contains(err.Error(), "role dev_tour_app may not create the schema outbox_relay_dev") ||
		!strings.Contains(err.Error(), `GRANT CREATE ON DATABASE`) {
		t.Fatalf("err = %v, want the reason and the GRANT\noutput:\n%s", err, got)
	}
	var created bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'outbox_relay_dev')`).Scan(&created); err != nil || created {
		t.Errorf("schema created: %v, %v", created, err)
	}
	if strings.Contains(got, "outbox-relay migrate") {
		t.Error("ran migrate after refusing")
	}
}
