// Package pgtest starts private PostgreSQL servers for tests and for the
// development tool (make run).
//
// StartCluster runs initdb and postgres from the local PostgreSQL install
// (found with pg_config --bindir, or in the directory EnvBindir names) in a
// fresh directory under os.TempDir, listening on 127.0.0.1 only. When the
// caller is root, both run as the postgres OS user, because they refuse to run
// as root. Only initdb and postgres are used (no psql, pg_ctl or
// pg_isready), so a bin directory holding just those two will do, such as the
// one cmd/outbox-relay-pg installs for the version matrix (make test-pg).
// With EnvVersion set, a server of another major version is an error.
//
// Tests use NewCluster for a server of their own (to kill or restart it, or
// for a wal_level other than logical), or NewDatabase for a fresh database on
// a cluster shared by all tests of the package; such packages call Main from
// TestMain.
//
// The postmaster is started with the Linux parent-death signal SIGQUIT, so a
// test binary that crashes or is killed does not leave servers behind: the
// postmaster then performs an immediate shutdown. The signal is tied to the OS
// thread that started the server, not to the process; the Go runtime keeps
// that thread alive unless a goroutine locked to it with runtime.LockOSThread
// exits, so do not call StartCluster, Start or Restart from such a goroutine.
// A cluster directory left behind by a crashed process is not removed.
package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

const (
	// readyTimeout bounds how long a start waits for the server to accept
	// connections, crash recovery included.
	readyTimeout = 30 * time.Second
	// stopTimeout bounds a fast shutdown before it is escalated.
	stopTimeout = 30 * time.Second
	// goneTimeout bounds the wait for a killed server's orphaned children
	// to exit and release the port and the shared memory.
	goneTimeout = 30 * time.Second
	// orphanGrace is how long Kill lets the killed postmaster's children
	// exit on their own before it kills them too.
	orphanGrace = 10 * time.Second
	// portGrace bounds the wait for a port held by another process.
	portGrace = 2 * time.Second
	// logTailBytes is how much of the server log an error quotes.
	logTailBytes = 4096
	// portAttempts is how often StartCluster picks another free port when the
	// one it picked was taken before the server could bind it.
	portAttempts = 3
)

// EnvBindir names the environment variable that, when set, is the directory
// of the server binaries (initdb and postgres) to use instead of
// pg_config --bindir. When running as root, the postgres OS user must be able
// to reach it: every parent directory searchable.
const EnvBindir = "OUTBOX_RELAY_PG_BINDIR"

// EnvVersion names the environment variable that, when set, is the major
// version (such as "13") every cluster must run: StartCluster checks
// server_version_num and fails on another, so that a matrix run cannot pass
// on the wrong binaries.
const EnvVersion = "OUTBOX_RELAY_PG_VERSION"

// ErrClosed is returned by the methods of a Cluster after Close.
var ErrClosed = errors.New("pgtest: cluster is closed")

// errPortInUse marks a start that failed because the port was taken.
var errPortInUse = errors.New("port already in use")

// Options configures StartCluster. The zero value is a logical-WAL cluster on
// a free port with its log in the cluster directory.
type Options struct {
	// WALLevel is the wal_level setting; empty means "logical".
	WALLevel string
	// Settings are extra postgresql.conf settings, written after (and so
	// overriding) the defaults. The port cannot be set here: use Port.
	Settings map[string]string
	// Port is the TCP port on 127.0.0.1; 0 picks a free one.
	Port int
	// Log receives the server's log output. It is written from a goroutine
	// started by os/exec, so it must be safe for that; its write errors are
	// ignored, so that a failing log cannot stall the server. Nil means a
	// file named server.log in the cluster directory.
	Log io.Writer
	// Bindir is the directory of the server binaries (initdb and postgres);
	// empty means EnvBindir, else pg_config --bindir. BindirAtLeast finds
	// one of a given major version or later.
	Bindir string
}

// Cluster is a PostgreSQL server running in a private directory, listening on
// 127.0.0.1 only, with trust authentication for the superuser postgres. Its
// methods are safe for concurrent use; they are serialized.
type Cluster struct {
	bindir  string
	dir     string // cluster directory, symlinks resolved
	dataDir string
	port    int
	cred    *syscall.Credential // nil: run as the current user

	logFile *os.File    // nil when Options.Log is set
	logTail *tailBuffer // nil when logFile is used

	mu       sync.Mutex
	proc     *process // nil while stopped
	logStart int64    // log file offset at which the current start began
	closed   bool
}

// process is a running postmaster. The goroutine started with it waits for it
// and closes done; whoever stops the server receives from done.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error // exit error, valid once done is closed
}

// StartCluster creates a cluster directory under os.TempDir, runs initdb in it
// and starts the server, returning once it accepts connections. It fails if
// pg_config is not in PATH, if the server binaries are missing, or, when
// running as root, if the postgres OS user does not exist. On failure nothing
// is left running and the directory is removed. The caller owns the cluster
// and must Close it.
func StartCluster(ctx context.Context, opts Options) (*Cluster, error) {
	bindir, err := serverBindir()
	if opts.Bindir != "" {
		bindir, err = opts.Bindir, checkBindir(opts.Bindir, "Options.Bindir")
	}
	if err != nil {
		return nil, err
	}
	cred, err := serverCredential()
	if err != nil {
		return nil, err
	}
	conf, err := configLines(opts)
	if err != nil {
		return nil, err
	}

	dir, err := os.MkdirTemp("", "pgtest-")
	if err != nil {
		return nil, fmt.Errorf("create cluster directory: %w", err)
	}
	c := &Cluster{bindir: bindir, dir: dir, cred: cred, port: opts.Port}
	ok := false
	defer func() {
		if !ok {
			_ = c.Close()
		}
	}()
	// Orphan detection compares process working directories with dataDir,
	// which the kernel reports with symlinks resolved.
	resolved, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil, fmt.Errorf("resolve cluster directory: %w", err)
	}
	c.dir = resolved
	c.dataDir = filepath.Join(c.dir, "data")
	if cred != nil {
		if err := os.Chown(c.dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return nil, fmt.Errorf("chown cluster directory to postgres: %w", err)
		}
	}
	if opts.Log != nil {
		c.logTail = &tailBuffer{dest: opts.Log}
	} else {
		c.logFile, err = os.OpenFile(filepath.Join(c.dir, "server.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			return nil, fmt.Errorf("create server log: %w", err)
		}
	}
	if err := c.initdb(ctx, conf); err != nil {
		return nil, err
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	for attempt := 1; ; attempt++ {
		if opts.Port == 0 {
			if c.port, err = freePort(); err != nil {
				return nil, err
			}
		}
		err = c.startLocked(ctx)
		if err == nil {
			break
		}
		if opts.Port != 0 || !errors.Is(err, errPortInUse) || attempt == portAttempts {
			return nil, err
		}
	}
	if err := c.checkVersion(ctx); err != nil {
		return nil, err
	}
	ok = true
	return c, nil
}

// checkVersion fails if EnvVersion is set and the server runs another major
// version.
func (c *Cluster) checkVersion(ctx context.Context) error {
	want := os.Getenv(EnvVersion)
	if want == "" {
		return nil
	}
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return fmt.Errorf("check server version: %w", err)
	}
	defer conn.Close(context.Background())
	var num int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&num); err != nil {
		return fmt.Errorf("check server version: %w", err)
	}
	if strconv.Itoa(num/10000) != want {
		return fmt.Errorf("%s=%s but the server in %s runs server_version_num %d (major %d)", EnvVersion, want, c.bindir, num, num/10000)
	}
	return nil
}

// serverBindir returns the directory of the PostgreSQL server binaries
// (EnvBindir, or pg_config --bindir), checking that initdb and postgres are
// there.
func serverBindir() (string, error) {
	if bindir := os.Getenv(EnvBindir); bindir != "" {
		for _, name := range []string{"initdb", "postgres"} {
			if _, err := os.Stat(filepath.Join(bindir, name)); err != nil {
				return "", fmt.Errorf("%s not found in %s (%s; make test-pg installs versions with cmd/outbox-relay-pg): %w", name, bindir, EnvBindir, err)
			}
		}
		return bindir, nil
	}
	pgConfig, err := exec.LookPath("pg_config")
	if err != nil {
		return "", fmt.Errorf("pg_config not found in PATH (install the PostgreSQL server, e.g. apt-get install postgresql): %w", err)
	}
	out, err := exec.Command(pgConfig, "--bindir").Output()
	if err != nil {
		return "", fmt.Errorf("run pg_config --bindir: %w", err)
	}
	bindir := strings.TrimSpace(string(out))
	for _, name := range []string{"initdb", "postgres"} {
		if _, err := os.Stat(filepath.Join(bindir, name)); err != nil {
			return "", fmt.Errorf("%s not found in %s (pg_config --bindir; install the PostgreSQL server, e.g. apt-get install postgresql): %w", name, bindir, err)
		}
	}
	return bindir, nil
}

// serverCredential returns the postgres OS user's credential when running as
// root, and nil otherwise.
func serverCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root, initdb and postgres must run as the postgres OS user (created by apt-get install postgresql): %w", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("parse uid of user postgres: %w", err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("parse gid of user postgres: %w", err)
	}
	// An empty Groups drops root's supplementary groups.
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, nil
}

// configLines returns what StartCluster appends to postgresql.conf.
func configLines(opts Options) (string, error) {
	walLevel := opts.WALLevel
	if walLevel == "" {
		walLevel = "logical"
	}
	var b strings.Builder
	b.WriteString("\n# Added by pgtest.\n")
	set := func(name, value string) {
		fmt.Fprintf(&b, "%s = '%s'\n", name, strings.ReplaceAll(value, "'", "''"))
	}
	set("wal_level", walLevel)
	set("listen_addresses", "127.0.0.1")
	set("unix_socket_directories", "") // TCP only: socket paths are length-limited
	set("fsync", "on")
	set("TimeZone", "UTC")
	set("max_replication_slots", "40")
	set("max_wal_senders", "40")
	set("max_connections", "200")
	set("logging_collector", "off")

	names := make([]string, 0, len(opts.Settings))
	for name := range opts.Settings {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if !validSettingName(name) {
			return "", fmt.Errorf("invalid setting name %q", name)
		}
		if strings.EqualFold(name, "port") {
			return "", errors.New("the port cannot be set in Options.Settings: use Options.Port")
		}
		if strings.ContainsAny(opts.Settings[name], "\n\r") {
			return "", fmt.Errorf("setting %s: value contains a line break", name)
		}
		set(name, opts.Settings[name])
	}
	return b.String(), nil
}

func validSettingName(name string) bool {
	if name == "" {
		return false
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '.') {
			return false
		}
	}
	return true
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// portFree reports whether the port can be bound on 127.0.0.1.
func portFree(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

// serverEnv is the environment of initdb and postgres: the caller's, without
// libpq variables, with English messages (the start error matches on them).
func serverEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PG") || strings.HasPrefix(kv, "LC_") || strings.HasPrefix(kv, "LANG=") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "LC_ALL=C")
}

// initdb creates the data directory and appends conf to its postgresql.conf.
func (c *Cluster) initdb(ctx context.Context, conf string) error {
	// --no-sync: initdb's files are flushed by the first checkpoint; skipping
	// its own fsyncs only matters if the machine crashes right after initdb.
	cmd := exec.CommandContext(ctx, filepath.Join(c.bindir, "initdb"),
		"-D", c.dataDir, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync")
	cmd.Dir = c.dir
	cmd.Env = serverEnv()
	cmd.SysProcAttr = sysProcAttr(c.cred)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %w\n%s", err, bytes.TrimSpace(out))
	}
	f, err := os.OpenFile(filepath.Join(c.dataDir, "postgresql.conf"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return fmt.Errorf("open postgresql.conf: %w", err)
	}
	if _, err := f.WriteString(conf); err != nil {
		_ = f.Close()
		return fmt.Errorf("write postgresql.conf: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write postgresql.conf: %w", err)
	}
	return nil
}

// URL returns the connection URL of database dbname as the superuser
// postgres, which needs no password.
func (c *Cluster) URL(dbname string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.port, url.PathEscape(dbname))
}

// Port returns the TCP port the server listens on. It stays the same across
// Stop, Kill, Start and Restart.
func (c *Cluster) Port() int {
	return c.port
}

// Dir returns the cluster directory. The data directory is its subdirectory
// "data"; the default server log is server.log in it. Close removes it.
func (c *Cluster) Dir() string {
	return c.dir
}

// Start starts the server again on the same directory and port after Stop or
// Kill, returning once it accepts connections (after crash recovery, if it
// was killed). It fails if the server is already running or the cluster is
// closed, and quotes the end of the server log when the server does not come
// up; a server that failed to come up is not left running.
func (c *Cluster) Start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if c.proc != nil {
		select {
		case <-c.proc.done: // exited on its own; start it again
			c.proc = nil
		default:
			return errors.New("start postgres: already running")
		}
	}
	return c.startLocked(ctx)
}

// Restart stops the server with a fast shutdown and starts it again; see
// Stop and Start.
func (c *Cluster) Restart(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if err := c.stopLocked(); err != nil {
		return fmt.Errorf("restart postgres: %w", err)
	}
	return c.startLocked(ctx)
}

// Stop shuts the server down with a fast shutdown (SIGINT: open transactions
// are rolled back, a checkpoint is written) and waits for it to exit. If that
// takes longer than 30 seconds it escalates to an immediate shutdown and then
// SIGKILL, and returns an error saying so; the server is stopped either way.
// Stop on a stopped or closed cluster does nothing and returns nil.
func (c *Cluster) Stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stopLocked()
}

// Kill sends SIGKILL to the postmaster, as a crash would, and waits until its
// orphaned children have exited and the port is free, so that Start can
// follow at once. Committed transactions survive (fsync is on). Kill on a
// stopped or closed cluster does nothing and returns nil.
func (c *Cluster) Kill() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.killLocked()
}

// Close stops the server if it is running and removes the cluster directory.
// It returns the first error met, but always tries to remove the directory.
// Calling Close again does nothing and returns nil.
func (c *Cluster) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	err := c.stopLocked() // leaves the server stopped even when it fails
	if c.logFile != nil {
		if cerr := c.logFile.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("close server log: %w", cerr))
		}
	}
	if rerr := os.RemoveAll(c.dir); rerr != nil {
		err = errors.Join(err, fmt.Errorf("remove cluster directory: %w", rerr))
	}
	return err
}

// CreateDatabase creates database name, connecting as postgres to the
// database "postgres". It fails if the database exists.
func (c *Cluster) CreateDatabase(ctx context.Context, name string) error {
	return createDatabase(ctx, c.URL("postgres"), name)
}

// DropDatabase drops database name WITH (FORCE), terminating its connections
// and dropping its replication slots. Dropping a database that does not exist
// returns nil, so it is safe to repeat.
func (c *Cluster) DropDatabase(ctx context.Context, name string) error {
	return dropDatabase(ctx, c.URL("postgres"), name)
}

// startLocked starts the postmaster and waits until it accepts connections.
func (c *Cluster) startLocked(ctx context.Context) error {
	if err := c.waitGone(); err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	cmd := exec.Command(filepath.Join(c.bindir, "postgres"), "-D", c.dataDir, "-p", strconv.Itoa(c.port))
	cmd.Dir = c.dir
	cmd.Env = serverEnv()
	cmd.SysProcAttr = sysProcAttr(c.cred)
	if c.logFile != nil {
		// An *os.File is handed to the server as is: no copying goroutine, so
		// orphaned children holding it cannot delay Wait.
		off, err := c.logFile.Seek(0, io.SeekEnd)
		if err != nil {
			return fmt.Errorf("start postgres: seek server log: %w", err)
		}
		c.logStart = off
		cmd.Stdout, cmd.Stderr = c.logFile, c.logFile
	} else {
		c.logTail.reset()
		cmd.Stdout, cmd.Stderr = c.logTail, c.logTail
		// Orphaned children may hold the pipe open after a kill.
		cmd.WaitDelay = 5 * time.Second
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	c.proc = p

	if err := c.waitReady(ctx, p); err != nil {
		_ = c.killLocked()
		tail := c.tailOfLog()
		if strings.Contains(tail, "Address already in use") {
			err = fmt.Errorf("%w: %w", errPortInUse, err)
		}
		return fmt.Errorf("start postgres on port %d: %w\n--- end of server log ---\n%s", c.port, err, tail)
	}
	return nil
}

// waitReady connects until the server accepts a connection, it exits, or
// readyTimeout or ctx ends.
func (c *Cluster) waitReady(ctx context.Context, p *process) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	for {
		attemptCtx, cancelAttempt := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgx.Connect(attemptCtx, c.URL("postgres"))
		if err == nil {
			err = conn.Close(attemptCtx)
			cancelAttempt()
			return err
		}
		cancelAttempt()
		select {
		case <-p.done:
			return fmt.Errorf("server exited during startup: %v", p.err)
		case <-ctx.Done():
			return fmt.Errorf("not accepting connections: %w (last attempt: %v)", ctx.Err(), err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (c *Cluster) stopLocked() error {
	p := c.proc
	if p == nil {
		return nil
	}
	var err error
	if serr := p.cmd.Process.Signal(syscall.SIGINT); serr != nil && !errors.Is(serr, os.ErrProcessDone) {
		err = fmt.Errorf("stop postgres: %w", serr)
	}
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Signal(syscall.SIGQUIT) // immediate shutdown
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		err = fmt.Errorf("stop postgres: fast shutdown did not finish within %s; forced an immediate shutdown\n--- end of server log ---\n%s", stopTimeout, c.tailOfLog())
	}
	c.proc = nil
	if gerr := c.waitGone(); gerr != nil {
		err = errors.Join(err, fmt.Errorf("stop postgres: %w", gerr))
	}
	return err
}

func (c *Cluster) killLocked() error {
	p := c.proc
	if p == nil {
		return nil
	}
	if err := p.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("kill postgres: %w", err)
	}
	<-p.done
	c.proc = nil
	// A crash takes every server process with it. Children notice the
	// postmaster's death and exit on their own, but one blocked outside
	// the latch waits that check for it (seen once in make chaos: two
	// processes still there 30 s after the kill) would hold the shared
	// memory forever: after orphanGrace they are killed as well.
	if err := c.waitGoneWithin(orphanGrace); err != nil {
		pids, _ := serverProcesses(c.dataDir)
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if err := c.waitGone(); err != nil {
			return fmt.Errorf("kill postgres: %w (after a SIGKILL of the leftover processes %v)", err, pids)
		}
	}
	return nil
}

// waitGone waits until no server process of this cluster is left and the
// port is free. After a SIGKILL the postmaster's children notice its death and
// exit on their own, but until they have, a new postmaster refuses to start:
// they still hold its shared memory. Children close the listening socket
// right after they are forked, so once they are gone a port still in use is
// held by some other process, which gets a short grace period only.
func (c *Cluster) waitGone() error { return c.waitGoneWithin(goneTimeout) }

// waitGoneWithin is waitGone with a bound of its own for the processes.
func (c *Cluster) waitGoneWithin(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		pids, err := serverProcesses(c.dataDir)
		if err != nil {
			return fmt.Errorf("look for leftover server processes: %w", err)
		}
		if len(pids) == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("server processes %v still running %s after the postmaster exited", pids, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	deadline = time.Now().Add(portGrace)
	for !portFree(c.port) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: port %d is held by another process", errPortInUse, c.port)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// tailOfLog returns the end of what the server logged since it was last
// started.
func (c *Cluster) tailOfLog() string {
	if c.logFile == nil {
		return c.logTail.String()
	}
	b, err := os.ReadFile(c.logFile.Name())
	if err != nil {
		return fmt.Sprintf("(read server log: %v)", err)
	}
	if c.logStart <= int64(len(b)) {
		b = b[c.logStart:]
	}
	if len(b) > logTailBytes {
		b = b[len(b)-logTailBytes:]
	}
	return string(b)
}

// tailBuffer forwards the server log to dest and keeps its last logTailBytes.
type tailBuffer struct {
	mu   sync.Mutex
	dest io.Writer
	buf  []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > logTailBytes {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-logTailBytes:]...)
	}
	_, _ = t.dest.Write(p) // see Options.Log
	return len(p), nil
}

func (t *tailBuffer) reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = t.buf[:0]
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// createDatabase creates database name through the server at adminURL.
func createDatabase(ctx context.Context, adminURL, name string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// dropDatabase drops database name WITH (FORCE) through the server at
// adminURL. A walsender streaming from a slot of the database makes the drop
// fail even WITH (FORCE), so such walsenders are terminated first and the
// drop is retried while they exit.
func dropDatabase(ctx context.Context, adminURL, name string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	defer conn.Close(context.Background())
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := conn.Exec(ctx,
			`SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, name)
		if err != nil {
			return fmt.Errorf("drop database %s: terminate walsenders: %w", name, err)
		}
		_, err = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55006" || time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("drop database %s: %w", name, err)
			}
			return nil
		}
		select { // 55006 object_in_use: a terminated walsender has not exited yet
		case <-ctx.Done():
			return fmt.Errorf("drop database %s: %w", name, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}
