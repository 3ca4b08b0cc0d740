package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// env is what every phase shares: the work directory, the PostgreSQL
// cluster, the nats-server process, the webhook receiver and the clock.
type env struct {
	o     options
	place placement // where the processes run (-layout)
	work  string
	base  time.Time // monotonic origin of every recorded time
	out   io.Writer // progress lines
	bin   string    // PostgreSQL binaries (pg_config --bindir)
	pgVer string
	// pgss: the cluster preloads pg_stat_statements (tracking nothing
	// unless a database turns it on: only the write-back phase's does).
	pgss bool

	cluster *pgtest.Cluster
	// serverLog is the cluster's log file with -auto-explain.
	serverLog *os.File
	nats      *harness.NATSServer
	natsBin   string
	natsVer   string
	natsURL   string
	nc        *nats.Conn
	js        jetstream.JetStream
	recv      *receiver
}

// say prints a progress line.
func (e *env) say(format string, args ...any) {
	fmt.Fprintf(e.out, "==> "+format+"\n", args...)
}

// now is the time since e.base in nanoseconds (monotonic), never 0.
func (e *env) now() int64 { return int64(time.Since(e.base)) + 1 }

// setUp starts PostgreSQL, nats-server and the receiver.
func setUp(ctx context.Context, o options, out io.Writer) (*env, error) {
	e := &env{o: o, base: time.Now(), out: out}
	var err error
	// First, so that every process started below inherits its place.
	if e.place, err = place(o.layout); err != nil {
		return nil, err
	}
	e.say("layout %s", e.place.describe())
	e.work, err = os.MkdirTemp("", "outbox-relay-bench-")
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			e.close()
		}
	}()
	if b, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		e.bin = strings.TrimSpace(string(b))
	} else {
		return nil, fmt.Errorf("pg_config --bindir: %w", err)
	}

	settings := map[string]string{}
	libdir := func() (string, error) {
		b, err := exec.Command("pg_config", "--pkglibdir").Output()
		return strings.TrimSpace(string(b)), err
	}
	if bindir := os.Getenv(pgtest.EnvBindir); bindir != "" {
		// Other binaries (the standby phase's PostgreSQL 16+): their own
		// library directory, pg_stat_statements only if they ship it.
		e.bin = bindir
		libdir = func() (string, error) { return filepath.Join(bindir, "..", "lib", "postgresql"), nil }
	}
	if lib, err := libdir(); err == nil {
		if _, err := os.Stat(filepath.Join(lib, "pg_stat_statements.so")); err == nil {
			e.pgss = true
			settings["shared_preload_libraries"] = "pg_stat_statements"
			settings["pg_stat_statements.track"] = "none"
		}
	}
	var serverLog io.Writer
	if e.o.autoExplain > 0 {
		// Plans of slow statements, with their actual rows and times, in a
		// server log kept in the work directory (-keep keeps it).
		lib, err := libdir()
		if err != nil {
			return nil, err
		}
		if _, err := os.Stat(filepath.Join(lib, "auto_explain.so")); err != nil {
			return nil, fmt.Errorf("-auto-explain: %w", err)
		}
		settings["shared_preload_libraries"] = strings.TrimPrefix(settings["shared_preload_libraries"]+",auto_explain", ",")
		settings["auto_explain.log_min_duration"] = fmt.Sprintf("%dms", e.o.autoExplain.Milliseconds())
		settings["auto_explain.log_analyze"] = "on"
		settings["auto_explain.log_nested_statements"] = "on"
		f, err := os.Create(filepath.Join(e.work, "postgres.log"))
		if err != nil {
			return nil, err
		}
		e.serverLog = f
		serverLog = f
		e.say("auto_explain: plans of statements over %s in %s", e.o.autoExplain, f.Name())
	}
	e.say("starting a private PostgreSQL cluster (wal_level=logical, fsync=on; pg_stat_statements loaded: %v)", e.pgss)
	e.cluster, err = pgtest.StartCluster(ctx, pgtest.Options{Settings: settings, Log: serverLog})
	if err != nil {
		return nil, err
	}
	conn, err := pgx.Connect(ctx, e.cluster.URL("postgres"))
	if err != nil {
		return nil, err
	}
	err = conn.QueryRow(ctx, "SELECT version()").Scan(&e.pgVer)
	if err == nil && e.pgss {
		_, err = conn.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
	}
	conn.Close(ctx)
	if err != nil {
		return nil, err
	}
	if i := strings.Index(e.pgVer, " on "); i > 0 {
		e.pgVer = e.pgVer[:i]
	}

	if err := e.startNATS(ctx); err != nil {
		return nil, err
	}
	e.recv, err = newReceiver(e)
	if err != nil {
		return nil, err
	}
	ok = true
	return e, nil
}

// close stops everything setUp started and removes the work directory
// (unless -keep).
func (e *env) close() {
	if e.recv != nil {
		e.recv.close()
	}
	if e.nc != nil {
		e.nc.Close()
	}
	if e.nats != nil {
		_ = e.nats.Stop(10 * time.Second)
	}
	if e.cluster != nil {
		_ = e.cluster.Close()
	}
	if e.serverLog != nil {
		_ = e.serverLog.Close()
	}
	if e.o.keep {
		fmt.Fprintf(e.out, "==> kept the work directory %s\n", e.work)
		return
	}
	_ = os.RemoveAll(e.work)
}

// startNATS builds or finds nats-server and starts it with JetStream on a
// free loopback port, storing under the work directory.
func (e *env) startNATS(ctx context.Context) error {
	var note string
	var err error
	e.natsBin, note, err = harness.NATSServerBinary(ctx, e.o.natsServer, e.work)
	if err != nil {
		return err
	}
	if note != "" {
		e.say("%s", note)
	}
	e.natsVer = harness.NATSVersion(e.natsBin)
	if e.nats, err = harness.StartNATS(e.natsBin, e.work); err != nil {
		return err
	}
	e.natsURL = e.nats.URL()
	e.say("nats-server %s (%s) with JetStream at %s", e.natsVer, e.natsBin, e.natsURL)
	if e.nc, err = e.nats.Connect(ctx, 15*time.Second, nats.Name("outbox-relay-bench")); err != nil {
		return err
	}
	e.js, err = jetstream.New(e.nc)
	if err != nil {
		return err
	}
	if _, err := e.js.AccountInfo(ctx); err != nil {
		return fmt.Errorf("JetStream on %s: %w", e.natsURL, err)
	}
	return nil
}

// roots returns the process trees a phase's CPU is reported for.
func (e *env) roots(relay *harness.Relay) cpuGroups {
	g := cpuGroups{"bench": os.Getpid(), "nats": e.nats.Pid()}
	if pid := e.postmasterPID(); pid > 0 {
		g["postgres"] = pid
	}
	if relay != nil {
		g["relay"] = relay.Pid()
	}
	return g
}

// postmasterPID reads the first line of postmaster.pid.
func (e *env) postmasterPID() int {
	b, err := os.ReadFile(filepath.Join(e.cluster.Dir(), "data", "postmaster.pid"))
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, _ := strconv.Atoi(strings.TrimSpace(line))
	return pid
}

// newDatabase creates database name and migrates it with the relay binary.
func (e *env) newDatabase(ctx context.Context, name string) (string, error) {
	_ = e.cluster.DropDatabase(ctx, name)
	if err := e.cluster.CreateDatabase(ctx, name); err != nil {
		return "", err
	}
	url := e.cluster.URL(name)
	if err := harness.Migrate(ctx, e.o.relayBin, url); err != nil {
		return "", err
	}
	if e.o.statements > 0 && e.pgss {
		// Sessions opened from now on are tracked; dropDatabase prints them.
		conn, err := e.connectBench(ctx, e.cluster.URL("postgres"))
		if err != nil {
			return "", err
		}
		_, err = conn.Exec(ctx, `ALTER DATABASE `+name+` SET pg_stat_statements.track = 'top'`)
		conn.Close(ctx)
		if err != nil {
			return "", err
		}
	}
	return url, nil
}

// topStatements prints the -statements statements of database name with
// the most execution time (waits included), the bench's own among them.
func (e *env) topStatements(ctx context.Context, name string) {
	conn, err := e.connectBench(ctx, e.cluster.URL("postgres"))
	if err != nil {
		e.say("warning: statements of %s: %v", name, err)
		return
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT s.calls, s.total_exec_time, s.rows,
       coalesce((to_jsonb(s) ->> 'jit_functions')::bigint, 0), regexp_replace(s.query, '\s+', ' ', 'g')
  FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
 WHERE d.datname = $1 ORDER BY s.total_exec_time DESC LIMIT $2`, name, e.o.statements)
	if err != nil {
		e.say("warning: statements of %s: %v", name, err)
		return
	}
	defer rows.Close()
	e.say("statements of %s, by execution time (calls, total ms, mean ms, rows, functions compiled by JIT):", name)
	for rows.Next() {
		var calls, n, jit int64
		var ms float64
		var q string
		if err := rows.Scan(&calls, &ms, &n, &jit, &q); err != nil {
			e.say("warning: statements of %s: %v", name, err)
			return
		}
		if len(q) > 240 {
			q = q[:240] + "…"
		}
		e.say("  %8d %10.0f %8.2f %9d %5d  %s", calls, ms, ms/float64(max(calls, 1)), n, jit, q)
	}
}

// dropDatabase drops a phase's database (and with it the slots it holds).
func (e *env) dropDatabase(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if e.o.statements > 0 && e.pgss {
		e.topStatements(ctx, name)
	}
	if err := e.cluster.DropDatabase(ctx, name); err != nil {
		e.say("warning: drop database %s: %v", name, err)
	}
}

// deleteStream removes a phase's JetStream stream, if it exists.
func (e *env) deleteStream(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		e.say("warning: delete stream %s: %v", name, err)
	}
}

// streamMsgs returns how many messages stream holds (0 while it does not
// exist).
func (e *env) streamMsgs(ctx context.Context, name string) (uint64, error) {
	s, err := e.js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

// serverCredential is the postgres OS user when running as root (PostgreSQL
// client tools are run as it, as the server is), else nil.
func serverCredential() *syscall.Credential {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return nil
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
}

// receiver is the webhook destination: it answers 204 and records when each
// event_key (read from the body) first arrived, in the current tracker.
type receiver struct {
	e   *env
	srv *harness.HTTPServer
	url string
	cur atomic.Pointer[tracker]
}

func newReceiver(e *env) (*receiver, error) {
	r := &receiver{e: e}
	srv, err := harness.ServeHTTP(r, "/hook")
	if err != nil {
		return nil, err
	}
	r.srv, r.url = srv, srv.URL
	return r, nil
}

// ServeHTTP records the delivery — one event, or a batch's array of them
// — and answers 204, which delivers every event of a batch
// (docs/sinks.md, "Batched delivery").
func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	at := r.e.now()
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	type envelope struct {
		EventKey string `json:"event_key"`
	}
	var events []envelope
	if body = bytes.TrimSpace(body); len(body) > 0 && body[0] == '[' {
		var items []struct {
			Event envelope `json:"event"`
		}
		err = json.Unmarshal(body, &items)
		for _, it := range items {
			events = append(events, it.Event)
		}
	} else {
		events = make([]envelope, 1)
		err = json.Unmarshal(body, &events[0])
	}
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	if t := r.cur.Load(); t != nil {
		for _, ev := range events {
			t.hook.record(t, ev.EventKey, at)
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

func (r *receiver) close() { r.srv.Close() }
