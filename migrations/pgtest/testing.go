package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// EnvDatabaseURL names the environment variable that points NewDatabase at an
// existing server instead of the shared private cluster. Its value is a
// postgres:// URL of a superuser (or a role with CREATEDB) on a server with
// wal_level=logical; NewDatabase connects to the database it names to create
// and drop the test databases.
const EnvDatabaseURL = "OUTBOX_RELAY_TEST_DATABASE_URL"

// setupTimeout bounds the work a test helper does before and after a test.
const setupTimeout = 2 * time.Minute

// shared is the package's logical-WAL cluster, started by the first
// NewDatabase and closed by Main.
var shared struct {
	mu      sync.Mutex
	cluster *Cluster
	err     error // a failed start is not retried by every test
	closed  bool
}

// mainRunning is set by Main (or Wrap's Run); NewDatabase requires it,
// because only Main can shut the shared cluster down.
var mainRunning atomic.Bool

// Main runs the tests of a package that uses NewDatabase, then closes the
// shared cluster (if a test started it) and exits with the tests' code, or 1
// if the tests passed but closing failed. Call it from TestMain:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// It also removes the directories SharedDir made.
func Main(m *testing.M) { os.Exit(Wrap(m).Run()) }

// Wrap returns m with a Run that does what Main does but returns the code
// instead of exiting: for a TestMain that checks the package's tests after
// the shared cluster is closed, such as goleak.VerifyTestMain:
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(pgtest.Wrap(m)) }
func Wrap(m *testing.M) interface{ Run() int } { return wrapped{m} }

type wrapped struct{ m *testing.M }

func (w wrapped) Run() int {
	mainRunning.Store(true)
	code := w.m.Run()
	if err := closeShared(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: close shared cluster: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	if err := removeSharedDirs(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// sharedDirs are the directories SharedDir made, for Main to remove.
var sharedDirs struct {
	mu    sync.Mutex
	paths []string
}

// SharedDir creates a directory under os.TempDir for what the tests of a
// package share beyond one test (such as a binary built once), and returns
// its path. Main removes it after the tests, so the package must call Main
// from TestMain; a test's own files belong in t.TempDir.
func SharedDir(prefix string) (string, error) {
	if !mainRunning.Load() {
		return "", errors.New("pgtest.SharedDir needs pgtest.Main in the package's TestMain, which removes the directory")
	}
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return "", err
	}
	sharedDirs.mu.Lock()
	defer sharedDirs.mu.Unlock()
	sharedDirs.paths = append(sharedDirs.paths, dir)
	return dir, nil
}

// removeSharedDirs removes every directory SharedDir made.
func removeSharedDirs() error {
	sharedDirs.mu.Lock()
	defer sharedDirs.mu.Unlock()
	var errs []error
	for _, dir := range sharedDirs.paths {
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", dir, err))
		}
	}
	sharedDirs.paths = nil
	return errors.Join(errs...)
}

func closeShared() error {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	shared.closed = true
	if shared.cluster == nil {
		return nil
	}
	err := shared.cluster.Close()
	shared.cluster = nil
	return err
}

// sharedCluster returns the shared cluster, starting it on first use.
func sharedCluster(ctx context.Context) (*Cluster, error) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	switch {
	case shared.closed:
		return nil, errors.New("shared cluster already closed: pgtest.Main has finished")
	case shared.cluster != nil:
		return shared.cluster, nil
	case shared.err != nil:
		return nil, shared.err
	}
	shared.cluster, shared.err = StartCluster(ctx, Options{})
	return shared.cluster, shared.err
}

// NewCluster starts a private cluster for tb, for tests that stop, kill or
// restart the server or need settings the shared cluster cannot have (such as
// wal_level=replica), and closes it when tb ends. When the PostgreSQL server
// binaries are missing it skips tb, or fails it under CI; any other failure to
// start fails tb.
func NewCluster(tb testing.TB, opts Options) *Cluster {
	tb.Helper()
	requireOrSkip(tb)
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	c, err := StartCluster(ctx, opts)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	tb.Cleanup(func() {
		if err := c.Close(); err != nil {
			tb.Errorf("pgtest: close cluster: %v", err)
		}
	})
	return c
}

// NewDatabase creates a database with a fresh name for tb and returns its URL;
// the database is dropped WITH (FORCE) when tb ends, which also closes
// connections left open and drops its replication slots. The database lives
// on the package's shared logical-WAL cluster, started on first use, so the
// package must call Main from TestMain. When EnvDatabaseURL is set, the
// database is created on that server instead (no cluster is started), which
// must have wal_level=logical. When neither is available it skips tb, or
// fails it under CI.
func NewDatabase(tb testing.TB) string {
	tb.Helper()
	if !mainRunning.Load() {
		tb.Fatal("pgtest: NewDatabase needs the package to call pgtest.Main: add func TestMain(m *testing.M) { pgtest.Main(m) }")
	}
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	name := uniqueDatabaseName(tb.Name())

	if adminURL := os.Getenv(EnvDatabaseURL); adminURL != "" {
		dbURL, err := newExternalDatabase(ctx, adminURL, name)
		if err != nil {
			tb.Fatalf("pgtest: %s: %v", EnvDatabaseURL, err)
		}
		tb.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
			defer cancel()
			if err := dropDatabase(ctx, adminURL, name); err != nil {
				tb.Errorf("pgtest: %v", err)
			}
		})
		return dbURL
	}

	requireOrSkip(tb)
	c, err := sharedCluster(ctx)
	if err != nil {
		tb.Fatalf("pgtest: shared cluster: %v", err)
	}
	if err := c.CreateDatabase(ctx, name); err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
		defer cancel()
		if err := c.DropDatabase(ctx, name); err != nil {
			tb.Errorf("pgtest: %v", err)
		}
	})
	return c.URL(name)
}

// newExternalDatabase creates database name on the server at adminURL after
// checking its wal_level, and returns adminURL with the database replaced.
func newExternalDatabase(ctx context.Context, adminURL, name string) (string, error) {
	u, err := url.Parse(adminURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", errors.New("not a postgres:// URL")
	}
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return "", fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.Background())
	var walLevel string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return "", fmt.Errorf("show wal_level: %w", err)
	}
	if walLevel != "logical" {
		return "", fmt.Errorf("the server has wal_level=%s; the tests need wal_level=logical (ALTER SYSTEM SET wal_level = logical, then restart it)", walLevel)
	}
	if err := createDatabase(ctx, adminURL, name); err != nil {
		return "", err
	}
	u.Path = "/" + name
	u.RawPath = ""
	return u.String(), nil
}

// uniqueDatabaseName returns "pgtest_", up to 30 characters of the test name
// (lower-case letters and digits, other runs as one underscore), and random
// hex: a valid unquoted identifier, unique across concurrent test binaries.
func uniqueDatabaseName(testName string) string {
	var b strings.Builder
	b.WriteString("pgtest_")
	underscore := true
	for _, r := range strings.ToLower(testName) {
		if b.Len() >= len("pgtest_")+30 {
			break
		}
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
			underscore = false
		} else if !underscore {
			b.WriteByte('_')
			underscore = true
		}
	}
	if !underscore {
		b.WriteByte('_')
	}
	var random [6]byte
	_, _ = rand.Read(random[:]) // crypto/rand.Read never fails
	b.WriteString(hex.EncodeToString(random[:]))
	return b.String()
}

// prerequisites reports what is missing to run a private cluster, or nil.
var prerequisites = sync.OnceValue(func() error {
	if _, err := serverBindir(); err != nil {
		return err
	}
	_, err := serverCredential()
	return err
})

// requireOrSkip skips tb when the PostgreSQL server binaries (or, as root, the
// postgres OS user) are missing, saying what is missing and how to install
// it. Under CI (CI=true or CI=1) it fails tb instead: integration tests must
// not pass by skipping there.
func requireOrSkip(tb testing.TB) {
	tb.Helper()
	err := prerequisites()
	if err == nil {
		return
	}
	msg := fmt.Sprintf("pgtest: cannot run a private PostgreSQL cluster: %v", err)
	if inCI() {
		tb.Fatalf("%s (CI is set: not skipping)", msg)
	}
	tb.Skip(msg)
}

func inCI() bool {
	v := os.Getenv("CI")
	return strings.EqualFold(v, "true") || v == "1"
}
