package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// relaySetup is what a phase's relay configuration varies.
type relaySetup struct {
	name    string // phase id: names the config, log, slot and stream
	url     string // database
	webhook bool   // deliver to the receiver as well as JetStream
	// batch is the webhook's batch.max_events; 0: one event per request.
	batch int
	mode  string // source.mode; empty: the default (auto)
	// httpPort is where the relay serves /metrics; 0: any free port.
	httpPort int
	// outbox, when set, is a second outbox table of the database (a
	// partition): the relay's tables, publish function and publication
	// are named after it.
	outbox string
	// standbyURL, when set, is source.standby_url: the relay decodes on
	// that standby (the standby phase).
	standbyURL string
}

// slot is the replication slot of the phase (slot names are cluster-wide).
func (s relaySetup) slot() string { return "bench_" + strings.ReplaceAll(s.name, "-", "_") }

// stream is the phase's JetStream stream; it captures subjectPrefix().>.
func (s relaySetup) stream() string {
	return "BENCH_" + strings.ToUpper(strings.ReplaceAll(s.name, "-", "_"))
}

func (s relaySetup) subjectPrefix() string { return "bench." + s.name }

// setUpRelay gives s a fresh database of its own, db, a known /metrics
// port (for -profile) and a configuration file, whose path it returns;
// done drops s's stream and the database.
func (e *env) setUpRelay(ctx context.Context, db string, s *relaySetup) (cfg string, done func(), err error) {
	if s.url, err = e.newDatabase(ctx, db); err != nil {
		return "", nil, err
	}
	done = func() {
		e.deleteStream(s.stream())
		e.dropDatabase(db)
	}
	if s.httpPort == 0 {
		s.httpPort, err = harness.FreePort()
	}
	if err == nil {
		cfg, err = e.writeConfig(*s)
	}
	if err != nil {
		done()
		return "", nil, err
	}
	return cfg, done, nil
}

// writeConfig writes the relay's configuration file for s and returns its
// path.
func (e *env) writeConfig(s relaySetup) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "database_url: %q\n", s.url)
	fmt.Fprintf(&b, "data_dir: %q\n", filepath.Join(e.work, "relay-data-"+s.name))
	if s.outbox != "" {
		fmt.Fprintf(&b, "outbox:\n  table: %[1]s\n  ledger_table: %[1]s_idempotency\n  checkpoint_table: %[1]s_checkpoint\n  publish_function: %[1]s_publish\n", s.outbox)
	}
	b.WriteString("source:\n")
	if s.outbox != "" {
		fmt.Fprintf(&b, "  publication: %s\n", s.outbox)
	}
	if s.mode != "" {
		fmt.Fprintf(&b, "  mode: %s\n", s.mode)
	}
	fmt.Fprintf(&b, "  slot: %s\n", s.slot())
	if s.standbyURL != "" {
		fmt.Fprintf(&b, "  standby_url: %q\n", s.standbyURL)
	}
	b.WriteString("sinks:\n")
	b.WriteString("  - name: nats\n    type: nats\n")
	fmt.Fprintf(&b, "    url: %q\n", e.natsURL)
	fmt.Fprintf(&b, "    subject: %q\n", s.subjectPrefix()+".{{.AggregateType}}.{{.EventType}}")
	fmt.Fprintf(&b, "    stream: {name: %s, subjects: [%q], create: true}\n", s.stream(), s.subjectPrefix()+".>")
	if s.webhook {
		b.WriteString("  - name: hook\n    type: webhook\n")
		fmt.Fprintf(&b, "    url: %q\n", e.recv.url)
		if s.batch > 0 {
			fmt.Fprintf(&b, "    batch: {max_events: %d}\n", s.batch)
		}
	}
	fmt.Fprintf(&b, "http:\n  listen: 127.0.0.1:%d\n", s.httpPort)
	if e.o.profileDir != "" {
		b.WriteString("  pprof: true\n")
	}
	b.WriteString("shutdown_timeout: 20s\n")
	b.WriteString("log: {level: info, format: json}\n")
	path := filepath.Join(e.work, "relay-"+s.name+".yaml")
	return path, os.WriteFile(path, []byte(b.String()), 0o600)
}

// startRelay starts `outbox-relay run --config cfg`, appending its output to
// the phase's log file.
func (e *env) startRelay(s relaySetup, cfg string) (*harness.Relay, error) {
	return harness.StartRelayVia(e.place.command(), e.o.relayBin, cfg, filepath.Join(e.work, "relay-"+s.name+".log"), e.o.relayEnv...)
}

// waitSlotActive waits until the relay streams from its slot.
func (e *env) waitSlotActive(ctx context.Context, s relaySetup, r *harness.Relay, timeout time.Duration) error {
	conn, err := pgx.Connect(ctx, s.url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	deadline := time.Now().Add(timeout)
	for {
		active, err := harness.SlotStreaming(ctx, conn, s.slot())
		if err != nil {
			return err
		}
		if active {
			return nil
		}
		if r.Exited() {
			return r.Failure()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the relay did not start streaming from slot %s within %s (log %s)", s.slot(), timeout, r.LogPath())
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
		_ = r.Stop(5 * time.Second)
		return err
	}
	return r.Stop(30 * time.Second)
}

// subscribe records the arrival of every message of s's subjects in t, by
// its event key header, on a core NATS subscription.
func (e *env) subscribe(s relaySetup, t *tracker) (*nats.Subscription, error) {
	sub, err := e.nc.Subscribe(s.subjectPrefix()+".>", func(m *nats.Msg) {
		at := e.now()
		t.nats.record(t, m.Header.Get(natssink.HeaderEventKey), at)
	})
	if err != nil {
		return nil, err
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return nil, err
	}
	return sub, e.nc.Flush()
}

// profileCPU fetches the relay's CPU profile over d into
// <profileDir>/<phase>.cpu.pprof, in the background; wait waits for it.
func (e *env) profileCPU(port int, phase string, d time.Duration) (wait func()) {
	if e.o.profileDir == "" {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		url := fmt.Sprintf("http://127.0.0.1:%d/debug/pprof/profile?seconds=%d", port, int(d.Seconds()))
		resp, err := http.Get(url)
		if err != nil {
			e.say("warning: profile: %v", err)
			return
		}
		defer resp.Body.Close()
		if err := os.MkdirAll(e.o.profileDir, 0o755); err != nil {
			e.say("warning: profile: %v", err)
			return
		}
		path := filepath.Join(e.o.profileDir, phase+".cpu.pprof")
		f, err := os.Create(path)
		if err != nil {
			e.say("warning: profile: %v", err)
			return
		}
		defer f.Close()
		if _, err := io.Copy(f, resp.Body); err != nil {
			e.say("warning: profile: %v", err)
			return
		}
		e.say("%s: the relay's CPU profile is in %s", phase, path)
	}()
	return func() { <-done }
}
