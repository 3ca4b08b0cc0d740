package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
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

	"github.com/outbox-relay/outbox-relay/ledger/pgtest"
)

// env is what every phase shares: the work directory, the PostgreSQL
// cluster, the nats-server process, the webhook receiver and the clock.
type env struct {
	o     options
	work  string
	base  time.Time // monotonic origin of every recorded time
	out   io.Writer // progress lines
	bin   string    // PostgreSQL binaries (pg_config --bindir)
	pgVer string

	cluster *pgtest.Cluster
	natsCmd *exec.Cmd
	natsBin string
	natsVer string
	natsURL string
	nc      *nats.Conn
	js      jetstream.JetStream
	recv    *receiver
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

	e.say("starting a private PostgreSQL cluster (wal_level=logical, fsync=on)")
	e.cluster, err = pgtest.StartCluster(ctx, pgtest.Options{})
	if err != nil {
		return nil, err
	}
	conn, err := pgx.Connect(ctx, e.cluster.URL("postgres"))
	if err != nil {
		return nil, err
	}
	err = conn.QueryRow(ctx, "SELECT version()").Scan(&e.pgVer)
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
	if e.natsCmd != nil && e.natsCmd.Process != nil {
		_ = e.natsCmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = e.natsCmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = e.natsCmd.Process.Kill()
			<-done
		}
	}
	if e.cluster != nil {
		_ = e.cluster.Close()
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
	e.natsBin = e.o.natsServer
	if e.natsBin == "" {
		// The module is in go.mod, so the version is pinned: prefer it to
		// whatever the machine has installed.
		bin := filepath.Join(e.work, "nats-server")
		goCmd := os.Getenv("GO")
		if goCmd == "" {
			goCmd = "go"
		}
		cmd := exec.CommandContext(ctx, goCmd, "build", "-o", bin, "github.com/nats-io/nats-server/v2")
		if out, err := cmd.CombinedOutput(); err == nil {
			e.natsBin = bin
		} else if p, lerr := exec.LookPath("nats-server"); lerr == nil {
			e.say("could not build nats-server from go.mod (%v: %s); using %s", err, bytes.TrimSpace(out), p)
			e.natsBin = p
		} else {
			return fmt.Errorf("build nats-server: %v: %s (and none in PATH)", err, bytes.TrimSpace(out))
		}
	}
	if v, err := exec.Command(e.natsBin, "--version").Output(); err == nil {
		e.natsVer = strings.TrimSpace(string(v))
	}
	port, err := freePort()
	if err != nil {
		return err
	}
	store := filepath.Join(e.work, "nats-store")
	log, err := os.Create(filepath.Join(e.work, "nats-server.log"))
	if err != nil {
		return err
	}
	defer log.Close()
	e.natsCmd = exec.Command(e.natsBin, "--addr", "127.0.0.1", "--port", strconv.Itoa(port),
		"--jetstream", "--store_dir", store)
	e.natsCmd.Stdout, e.natsCmd.Stderr = log, log
	e.natsCmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := e.natsCmd.Start(); err != nil {
		return fmt.Errorf("start nats-server: %w", err)
	}
	e.natsURL = fmt.Sprintf("nats://127.0.0.1:%d", port)
	e.say("nats-server %s (%s) with JetStream at %s", e.natsVer, e.natsBin, e.natsURL)
	deadline := time.Now().Add(15 * time.Second)
	for {
		e.nc, err = nats.Connect(e.natsURL, nats.Name("outbox-relay-bench"))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nats-server did not accept connections: %w (log: %s)", err, tail(filepath.Join(e.work, "nats-server.log")))
		}
		time.Sleep(50 * time.Millisecond)
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
func (e *env) roots(relay *relayProc) cpuGroups {
	g := cpuGroups{"bench": os.Getpid(), "nats": e.natsCmd.Process.Pid}
	if pid := e.postmasterPID(); pid > 0 {
		g["postgres"] = pid
	}
	if relay != nil && relay.cmd.Process != nil {
		g["relay"] = relay.cmd.Process.Pid
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
	cmd := exec.CommandContext(ctx, e.o.relayBin, "migrate", "--database-url", url)
	cmd.Env = append(os.Environ(), "RELAY_LOG_FORMAT=json")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("outbox-relay migrate: %w\n%s", err, bytes.TrimSpace(out))
	}
	return url, nil
}

// dropDatabase drops a phase's database (and with it the slots it holds).
func (e *env) dropDatabase(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
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

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// tail returns the last lines of a log file, for error messages.
func tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	const keep = 3000
	if len(b) > keep {
		b = b[len(b)-keep:]
	}
	return string(bytes.TrimSpace(b))
}

// receiver is the webhook destination: it answers 204 and records when each
// event_key (read from the body) first arrived, in the current tracker.
type receiver struct {
	e   *env
	srv *http.Server
	url string
	cur atomic.Pointer[tracker]
}

func newReceiver(e *env) (*receiver, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &receiver{e: e, url: "http://" + ln.Addr().String() + "/hook"}
	r.srv = &http.Server{Handler: r, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = r.srv.Serve(ln) }()
	return r, nil
}

// ServeHTTP records the delivery and answers 204.
func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	at := r.e.now()
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	var env struct {
		EventKey string `json:"event_key"`
	}
	if err := json.Unmarshal(body, &env); err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	if t := r.cur.Load(); t != nil {
		t.hook.record(t, env.EventKey, at)
	}
	w.WriteHeader(http.StatusNoContent)
}

func (r *receiver) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = r.srv.Shutdown(ctx)
}
