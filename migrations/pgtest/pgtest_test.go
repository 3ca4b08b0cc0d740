package pgtest_test

import (
	"bytes"
	"context"
	"errors"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func connect(tb testing.TB, connString string) *pgx.Conn {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	tb.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func queryString(tb testing.TB, conn *pgx.Conn, sql string, args ...any) string {
	tb.Helper()
	var s string
	if err := conn.QueryRow(context.Background(), sql, args...).Scan(&s); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	return s
}

func exec(tb testing.TB, conn *pgx.Conn, sql string, args ...any) {
	tb.Helper()
	if _, err := conn.Exec(context.Background(), sql, args...); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
}

// dbName returns the database named in a connection URL.
func dbName(tb testing.TB, connURL string) string {
	tb.Helper()
	u, err := url.Parse(connURL)
	if err != nil {
		tb.Fatalf("parse %q: %v", connURL, err)
	}
	return strings.TrimPrefix(u.Path, "/")
}

// adminURL returns connURL pointing at the database "postgres".
func adminURL(tb testing.TB, connURL string) string {
	tb.Helper()
	u, err := url.Parse(connURL)
	if err != nil {
		tb.Fatalf("parse %q: %v", connURL, err)
	}
	u.Path = "/postgres"
	return u.String()
}

func TestNewDatabase(t *testing.T) {
	dbURL := pgtest.NewDatabase(t)
	conn := connect(t, dbURL)

	if got := queryString(t, conn, "SHOW wal_level"); got != "logical" {
		t.Errorf("wal_level = %q, want logical", got)
	}
	if got, want := queryString(t, conn, "SELECT current_database()"), dbName(t, dbURL); got != want {
		t.Errorf("current_database() = %q, want %q", got, want)
	}
	if got := queryString(t, conn, "SHOW TimeZone"); got != "UTC" {
		t.Errorf("TimeZone = %q, want UTC", got)
	}
	if got := queryString(t, conn, "SHOW fsync"); got != "on" {
		t.Errorf("fsync = %q, want on", got)
	}
}

func TestNewDatabaseIsolated(t *testing.T) {
	first, second := pgtest.NewDatabase(t), pgtest.NewDatabase(t)
	if dbName(t, first) == dbName(t, second) {
		t.Fatalf("both databases are named %q", dbName(t, first))
	}
	conn1, conn2 := connect(t, first), connect(t, second)
	exec(t, conn1, "CREATE TABLE only_in_first (id int)")
	if got := queryString(t, conn2, "SELECT coalesce(to_regclass('only_in_first')::text, 'absent')"); got != "absent" {
		t.Errorf("table created in the first database is visible in the second: %s", got)
	}
}

func TestNewDatabaseNameIsSafe(t *testing.T) {
	valid := regexp.MustCompile(`^[a-z0-9_]{1,63}$`)
	for _, name := range []string{"Odd Name/ÄÖ-x.y; DROP", strings.Repeat("VeryLong", 20), "_"} {
		t.Run(name, func(t *testing.T) {
			got := dbName(t, pgtest.NewDatabase(t))
			if !valid.MatchString(got) {
				t.Errorf("database name %q is not lower-case letters, digits and underscores of at most 63 bytes", got)
			}
		})
	}
}

// TestNewDatabaseCleanup checks that the cleanup drops a database that still
// has connections, among them a walsender streaming from a logical slot, and
// that dropping it frees the slot.
func TestNewDatabaseCleanup(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var dbURL string
	var repl *pgconn.PgConn
	t.Run("leave connections open", func(t *testing.T) {
		dbURL = pgtest.NewDatabase(t)
		conn, err := pgx.Connect(ctx, dbURL) // deliberately not closed
		if err != nil {
			t.Fatalf("connect: %v", err)
		}
		exec(t, conn, "CREATE TABLE t (id int PRIMARY KEY)")
		exec(t, conn, "CREATE PUBLICATION pub FOR ALL TABLES")

		repl, err = pgconn.Connect(ctx, dbURL+"&replication=database")
		if err != nil {
			t.Fatalf("replication connect: %v", err)
		}
		// Slot names are cluster-wide: reuse the database name's random suffix.
		name := dbName(t, dbURL)
		slot := "cleanup_" + name[len(name)-12:]
		if _, err := pglogrepl.CreateReplicationSlot(ctx, repl, slot, "pgoutput",
			pglogrepl.CreateReplicationSlotOptions{}); err != nil {
			t.Fatalf("create slot: %v", err)
		}
		if err := pglogrepl.StartReplication(ctx, repl, slot, 0, pglogrepl.StartReplicationOptions{
			PluginArgs: []string{"proto_version '1'", "publication_names 'pub'"},
		}); err != nil {
			t.Fatalf("start replication: %v", err)
		}
		if got := queryString(t, conn, "SELECT active::text FROM pg_replication_slots WHERE slot_name = $1", slot); got != "true" {
			t.Fatalf("slot active = %s, want true", got)
		}
	})
	defer repl.Close(context.Background())

	admin := connect(t, adminURL(t, dbURL))
	name := dbName(t, dbURL)
	if got := queryString(t, admin, "SELECT count(*)::text FROM pg_database WHERE datname = $1", name); got != "0" {
		t.Errorf("database %s still exists after its test ended", name)
	}
	if got := queryString(t, admin, "SELECT count(*)::text FROM pg_replication_slots WHERE database = $1", name); got != "0" {
		t.Errorf("%s replication slots of database %s left after its test ended", got, name)
	}
}

// syncBuffer is a bytes.Buffer safe for the log-copying goroutine.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func TestNewClusterOptions(t *testing.T) {
	var log syncBuffer
	c := pgtest.NewCluster(t, pgtest.Options{
		WALLevel: "replica",
		Settings: map[string]string{"work_mem": "8MB", "application_name": "it's quoted"},
		Log:      &log,
	})
	conn := connect(t, c.URL("postgres"))
	for setting, want := range map[string]string{
		"wal_level":             "replica",
		"work_mem":              "8MB",
		"application_name":      "it's quoted",
		"max_replication_slots": "40",
		"listen_addresses":      "127.0.0.1",
		"port":                  strconv.Itoa(c.Port()),
	} {
		if got := queryString(t, conn, "SELECT current_setting($1)", setting); got != want {
			t.Errorf("%s = %q, want %q", setting, got, want)
		}
	}
	if !strings.Contains(log.String(), "database system is ready to accept connections") {
		t.Errorf("Options.Log did not receive the server log; got:\n%s", log.String())
	}
}

func TestKillKeepsCommittedData(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := pgtest.NewCluster(t, pgtest.Options{})
	port := c.Port()
	if err := c.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}

	conn, err := pgx.Connect(ctx, c.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	exec(t, conn, "CREATE TABLE events (id int PRIMARY KEY)")
	exec(t, conn, "INSERT INTO events SELECT generate_series(1, 100)")
	// An open transaction at the time of the crash must not survive it, and
	// its backend must not keep the port or the shared memory.
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO events VALUES (1000)"); err != nil {
		t.Fatal(err)
	}

	if err := c.Kill(); err != nil {
		t.Fatalf("Kill: %v", err)
	}
	if err := c.Kill(); err != nil {
		t.Fatalf("second Kill: %v", err)
	}
	_ = conn.Close(ctx)
	if err := c.Start(ctx); err != nil {
		t.Fatalf("Start after Kill: %v", err)
	}
	if c.Port() != port {
		t.Errorf("port changed from %d to %d", port, c.Port())
	}
	conn2 := connect(t, c.URL("app"))
	if got := queryString(t, conn2, "SELECT count(*)::text || ' ' || max(id)::text FROM events"); got != "100 100" {
		t.Errorf("after kill -9 and start: count, max = %s, want 100 100", got)
	}
}

func TestStopStart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := pgtest.NewCluster(t, pgtest.Options{})
	conn := connect(t, c.URL("postgres"))
	exec(t, conn, "CREATE TABLE kept (v text)")
	exec(t, conn, "INSERT INTO kept VALUES ('before stop')")

	if err := c.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if err := c.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	shortCtx, shortCancel := context.WithTimeout(ctx, 2*time.Second)
	defer shortCancel()
	if conn, err := pgx.Connect(shortCtx, c.URL("postgres")); err == nil {
		_ = conn.Close(ctx)
		t.Fatal("connected to a stopped server")
	}
	if err := c.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	if err := c.Start(ctx); err == nil {
		t.Error("Start on a running server succeeded, want an error")
	}
	if err := c.Restart(ctx); err != nil {
		t.Fatalf("Restart: %v", err)
	}
	conn2 := connect(t, c.URL("postgres"))
	if got := queryString(t, conn2, "SELECT v FROM kept"); got != "before stop" {
		t.Errorf("kept row = %q", got)
	}
}

func TestCloseRemovesDirectory(t *testing.T) {
	c := pgtest.NewCluster(t, pgtest.Options{})
	dir := c.Dir()
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("cluster directory: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cluster directory %s after Close: %v, want it removed", dir, err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := c.Start(context.Background()); !errors.Is(err, pgtest.ErrClosed) {
		t.Errorf("Start after Close = %v, want ErrClosed", err)
	}
}

// TestServerVersion reports the server's version, and under make test-pg
// (EnvVersion set) checks it is the version the matrix asked for: a run on
// the wrong binaries must not pass.
func TestServerVersion(t *testing.T) {
	conn := connect(t, pgtest.NewDatabase(t))
	num, err := strconv.Atoi(queryString(t, conn, "SHOW server_version_num"))
	if err != nil {
		t.Fatalf("server_version_num: %v", err)
	}
	t.Logf("server_version_num %d (%s)", num, queryString(t, conn, "SHOW server_version"))
	if want := os.Getenv(pgtest.EnvVersion); want != "" && strconv.Itoa(num/10000) != want {
		t.Errorf("server_version_num = %d, want major %s (%s)", num, want, pgtest.EnvVersion)
	}
	if num < 130000 {
		t.Errorf("server_version_num = %d: the relay needs PostgreSQL 13 or later", num)
	}
}

func TestBindirFromEnvironment(t *testing.T) {
	empty := t.TempDir()
	t.Setenv(pgtest.EnvBindir, empty)
	_, err := pgtest.StartCluster(context.Background(), pgtest.Options{})
	if err == nil || !strings.Contains(err.Error(), pgtest.EnvBindir) || !strings.Contains(err.Error(), "initdb not found in "+empty) {
		t.Fatalf("StartCluster with %s=%s (empty): err = %v, want initdb not found naming %s", pgtest.EnvBindir, empty, err, pgtest.EnvBindir)
	}
}

func TestStartClusterChecksVersion(t *testing.T) {
	pgtest.NewCluster(t, pgtest.Options{}) // skips or fails without binaries
	t.Setenv(pgtest.EnvVersion, "9")
	c, err := pgtest.StartCluster(context.Background(), pgtest.Options{})
	if err == nil {
		_ = c.Close()
		t.Fatalf("StartCluster with %s=9: no error", pgtest.EnvVersion)
	}
	if !strings.Contains(err.Error(), pgtest.EnvVersion+"=9 but the server") {
		t.Fatalf("StartCluster with %s=9: err = %v, want a version mismatch", pgtest.EnvVersion, err)
	}
}
