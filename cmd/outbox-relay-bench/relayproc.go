package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
)

// relaySetup is what a phase's relay configuration varies.
type relaySetup struct {
	name    string // phase id: names the config, log, slot and stream
	url     string // database
	webhook bool   // deliver to the receiver as well as JetStream
	mode    string // source.mode; empty: the default (auto)
}

// slot is the replication slot of the phase (slot names are cluster-wide).
func (s relaySetup) slot() string { return "bench_" + strings.ReplaceAll(s.name, "-", "_") }

// stream is the phase's JetStream stream; it captures subjectPrefix().>.
func (s relaySetup) stream() string {
	return "BENCH_" + strings.ToUpper(strings.ReplaceAll(s.name, "-", "_"))
}

func (s relaySetup) subjectPrefix() string { return "bench." + s.name }

// writeConfig writes the relay's configuration file for s and returns its
// path.
func (e *env) writeConfig(s relaySetup) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "database_url: %q\n", s.url)
	fmt.Fprintf(&b, "data_dir: %q\n", filepath.Join(e.work, "relay-data-"+s.name))
	b.WriteString("source:\n")
	if s.mode != "" {
		fmt.Fprintf(&b, "  mode: %s\n", s.mode)
	}
	fmt.Fprintf(&b, "  slot: %s\n", s.slot())
	b.WriteString("sinks:\n")
	b.WriteString("  - name: nats\n    type: nats\n")
	fmt.Fprintf(&b, "    url: %q\n", e.natsURL)
	fmt.Fprintf(&b, "    subject: %q\n", s.subjectPrefix()+".{{.AggregateType}}.{{.EventType}}")
	fmt.Fprintf(&b, "    stream: {name: %s, subjects: [%q], create: true}\n", s.stream(), s.subjectPrefix()+".>")
	if s.webhook {
		b.WriteString("  - name: hook\n    type: webhook\n")
		fmt.Fprintf(&b, "    url: %q\n", e.recv.url)
	}
	b.WriteString("http:\n  listen: 127.0.0.1:0\n")
	b.WriteString("shutdown_timeout: 20s\n")
	b.WriteString("log: {level: info, format: json}\n")
	path := filepath.Join(e.work, "relay-"+s.name+".yaml")
	return path, os.WriteFile(path, []byte(b.String()), 0o600)
}

// relayProc is a running `outbox-relay run`.
type relayProc struct {
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
	err     error // exit error, valid once done is closed
}

// startRelay starts `outbox-relay run --config cfg`, appending its output to
// the phase's log file.
func (e *env) startRelay(s relaySetup, cfg string) (*relayProc, error) {
	logPath := filepath.Join(e.work, "relay-"+s.name+".log")
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	cmd := exec.Command(e.o.relayBin, "run", "--config", cfg)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start outbox-relay run: %w", err)
	}
	r := &relayProc{cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		r.err = cmd.Wait()
		close(r.done)
	}()
	return r, nil
}

// exited reports whether the relay has exited.
func (r *relayProc) exited() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// exitCode is the relay's exit code once it has exited.
func (r *relayProc) exitCode() int {
	<-r.done
	var ee *exec.ExitError
	if errors.As(r.err, &ee) {
		return ee.ExitCode()
	}
	if r.err != nil {
		return -1
	}
	return 0
}

// failure describes an unexpected exit, with the end of the relay's log.
func (r *relayProc) failure() error {
	return fmt.Errorf("outbox-relay run exited (code %d); end of its log %s:\n%s", r.exitCode(), r.logPath, tail(r.logPath))
}

// stop sends SIGTERM (the relay's graceful stop) and waits; after timeout it
// kills the relay and returns an error.
func (r *relayProc) stop(timeout time.Duration) error {
	if r.exited() {
		return nil
	}
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
		if c := r.exitCode(); c != 0 {
			return fmt.Errorf("outbox-relay run exited with code %d after SIGTERM (log %s)", c, r.logPath)
		}
		return nil
	case <-time.After(timeout):
		_ = r.cmd.Process.Kill()
		<-r.done
		return fmt.Errorf("outbox-relay run did not stop within %s of SIGTERM; killed (log %s)", timeout, r.logPath)
	}
}

// waitSlotActive waits until the relay streams from its slot.
func (e *env) waitSlotActive(ctx context.Context, s relaySetup, r *relayProc, timeout time.Duration) error {
	conn, err := pgx.Connect(ctx, s.url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	deadline := time.Now().Add(timeout)
	for {
		var active bool
		// A slot is also active while CREATE_REPLICATION_SLOT builds it (and
		// gone if the walsender exits then): wait for START_REPLICATION.
		err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots s
			JOIN pg_stat_replication r ON r.pid = s.active_pid
			WHERE s.slot_name = $1 AND r.state IN ('catchup', 'streaming'))`, s.slot()).Scan(&active)
		if err != nil {
			return err
		}
		if active {
			return nil
		}
		if r.exited() {
			return r.failure()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the relay did not start streaming from slot %s within %s (log %s)", s.slot(), timeout, r.logPath)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// createSlot starts the relay until it streams from its (new) slot, then
// stops it with SIGTERM: rows inserted afterwards are streamed at the next
// start.
func (e *env) createSlot(ctx context.Context, s relaySetup, cfg string) error {
	r, err := e.startRelay(s, cfg)
	if err != nil {
		return err
	}
	if err := e.waitSlotActive(ctx, s, r, 60*time.Second); err != nil {
		_ = r.stop(5 * time.Second)
		return err
	}
	return r.stop(30 * time.Second)
}

// subscribe records the arrival of every message of s's subjects in t, by
// its Nats-Msg-Id (the event_key), on a core NATS subscription.
func (e *env) subscribe(s relaySetup, t *tracker) (*nats.Subscription, error) {
	sub, err := e.nc.Subscribe(s.subjectPrefix()+".>", func(m *nats.Msg) {
		at := e.now()
		t.nats.record(t, m.Header.Get(nats.MsgIdHdr), at)
	})
	if err != nil {
		return nil, err
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return nil, err
	}
	return sub, e.nc.Flush()
}
