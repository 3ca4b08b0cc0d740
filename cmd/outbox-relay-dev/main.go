// Command outbox-relay-dev is what `make run` starts: a tour of the relay
// that never touches a user's events (README, "A five-minute tour").
//
// Without DATABASE_URL it starts a private logical-WAL PostgreSQL cluster
// from the local binaries (the tests' harness) and uses the default names.
// With DATABASE_URL it attaches to that database with names of its own — a
// schema, a publication and a slot called outbox_relay_dev — which it lists
// before it creates them and removes when it stops (attach.go): it never
// reads or writes the user's outbox, ledger or slot, and never prints the
// password. Either way it migrates with the outbox-relay binary, runs the
// relay with a small webhook receiver that prints what it gets and the
// embedded NATS server (run --embedded-nats), and publishes sample events
// until Ctrl-C.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

func main() {
	relayBin := flag.String("relay", "", "path to the outbox-relay binary (default: beside this one)")
	once := flag.Bool("once", false, "publish three events, wait until they arrive, stop the relay and exit")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	opts := options{relayBin: *relayBin, once: *once, databaseURL: os.Getenv("DATABASE_URL")}
	if err := run(ctx, opts, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-dev: %v\n", err)
		os.Exit(1)
	}
}

// options are what run does.
type options struct {
	// relayBin is the outbox-relay binary; empty: beside this one.
	relayBin string
	// once publishes three events, waits until the webhook has them, stops
	// the relay and returns.
	once bool
	// databaseURL is the database to attach to; empty: a private cluster.
	databaseURL string
}

// say prints one of the tour's own lines.
type sayer func(format string, args ...any)

func run(ctx context.Context, opts options, out io.Writer) (err error) {
	say := sayer(func(format string, args ...any) { fmt.Fprintf(out, "==> "+format+"\n", args...) })
	relayBin := opts.relayBin
	if relayBin == "" {
		self, err := os.Executable()
		if err != nil {
			return err
		}
		relayBin = filepath.Join(filepath.Dir(self), "outbox-relay")
	}
	work, err := os.MkdirTemp("", "outbox-relay-dev-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	url, n := opts.databaseURL, defaultNames()
	streams := true // the relay can stream: wal_level logical, a role with REPLICATION
	if url == "" {
		say("DATABASE_URL is not set: starting a private PostgreSQL (wal_level=logical) from the local binaries")
		cluster, err := pgtest.StartCluster(ctx, pgtest.Options{})
		if err != nil {
			return fmt.Errorf("start a private cluster: %w", err)
		}
		defer func() {
			say("stopping the private cluster and removing %s", cluster.Dir())
			cluster.Close()
		}()
		if err := cluster.CreateDatabase(ctx, "outbox"); err != nil {
			return err
		}
		url = cluster.URL("outbox")
		say("database: %s, in %s (removed when you stop)", target(url), cluster.Dir())
	} else {
		n = devNames()
		a, err := attach(ctx, url, n, say)
		if err != nil {
			return err
		}
		streams = a.streams
		// The objects go on a fresh context: Ctrl-C has ended ctx.
		defer func() {
			if cerr := a.remove(context.Background()); cerr != nil && err == nil {
				err = cerr
			}
		}()
	}

	// A webhook receiver standing in for n8n: it prints every delivery.
	var received atomic.Int64
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: receiver(say, &received), ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	defer srv.Close()

	cfgPath := filepath.Join(work, "relay.yaml")
	if err := os.WriteFile(cfgPath, []byte(relayConfig(url, n, filepath.Join(work, "data"), "http://"+ln.Addr().String()+"/webhook/outbox")), 0o600); err != nil {
		return err
	}

	say("outbox-relay migrate --config %s", cfgPath)
	if err := relayCommand(ctx, relayBin, out, "migrate", "--config", cfgPath).Run(); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}

	say("outbox-relay run --config %s --embedded-nats", cfgPath)
	relayCtx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	relay := &relayProcess{cmd: relayCommand(relayCtx, relayBin, out, "run", "--config", cfgPath, "--embedded-nats"), done: make(chan struct{})}
	if err := relay.cmd.Start(); err != nil {
		return err
	}
	go func() { relay.err = relay.cmd.Wait(); close(relay.done) }()
	// Whatever happens next, the relay stops (SIGTERM, then its
	// WaitDelay) before the deferred clean-up drops its slot.
	defer func() { stopRelay(); <-relay.done }()

	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", target(url), err)
	}
	defer conn.Close(context.Background())

	if streams {
		// Rows written before the slot exists belong to the claim path;
		// wait for the stream so the samples show it.
		if err := waitStreaming(ctx, conn, n.slot, relay, say); err != nil {
			return err
		}
	}
	return publishSamples(ctx, conn, n, opts.once, &received, relay, say)
}

// relayProcess is the running relay; done is closed once it has exited,
// with err its exit.
type relayProcess struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// receiver answers 204 to every request and prints the event: its row id,
// type, aggregate and payload, and the headers a receiver deduplicates on.
func receiver(say sayer, received *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var env struct {
			ID            int64           `json:"id"`
			EventType     string          `json:"event_type"`
			AggregateType string          `json:"aggregate_type"`
			AggregateID   string          `json:"aggregate_id"`
			Payload       json.RawMessage `json:"payload"`
		}
		body, _ := io.ReadAll(r.Body)
		json.Unmarshal(body, &env)
		received.Add(1)
		// "event <id>": the outbox row's id, which a replay sends again.
		say("webhook received event %d: %s %s/%s %s (webhook-id %s, attempt %s)", env.ID, env.EventType, env.AggregateType, env.AggregateID,
			env.Payload, r.Header.Get("webhook-id"), r.Header.Get("webhook-attempt"))
		w.WriteHeader(http.StatusNoContent)
	})
}

// relayConfig is the relay's configuration for the tour: the names n, the
// webhook receiver, console logs (colored only on a terminal).
func relayConfig(url string, n names, dataDir, hookURL string) string {
	return fmt.Sprintf(`database_url: %q
outbox:
  table: %s
  ledger_table: %s
  checkpoint_table: %s
  publish_function: %s
source:
  slot: %s
  publication: %s
data_dir: %q
sinks:
  - name: dev-webhook
    type: webhook
    url: %s
http:
  listen: 127.0.0.1:0
log: {level: info, format: console}
`, url, n.outbox, n.ledger, n.checkpoint, n.publish, n.slot, n.publication, dataDir, hookURL)
}

// waitStreaming waits until the relay streams from slot, saying so; after
// 20 s it goes on, saying where to look: the claim path delivers the samples
// either way.
func waitStreaming(ctx context.Context, conn *pgx.Conn, slot string, relay *relayProcess, say sayer) error {
	start := time.Now()
	told := false
	for {
		var streaming bool
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active)", slot).Scan(&streaming); err != nil {
			return err
		}
		if streaming {
			return nil
		}
		switch waited := time.Since(start); {
		case waited > 20*time.Second:
			say("the relay is not streaming from slot %s after 20 s: its log above says why (outbox-relay doctor too); going on, the claim path delivers the samples", slot)
			return nil
		case waited > 2*time.Second && !told:
			say("waiting for the relay to stream from slot %s …", slot)
			told = true
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-relay.done:
			return fmt.Errorf("the relay exited before it streamed: %v (its log is above)", relay.err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// publishSamples publishes a sample event every 2 s until ctx ends; with
// once, three, then it waits until the webhook has them and stops the relay.
func publishSamples(ctx context.Context, conn *pgx.Conn, n names, once bool, received *atomic.Int64, relay *relayProcess, say sayer) error {
	samples := []struct{ typ, agg, id, payload string }{
		{"lead.created", "lead", "L1", `{"name": "Ada", "source": "web"}`},
		{"lead.qualified", "lead", "L1", `{"score": 87}`},
		{"order.placed", "order", "O7", `{"total": 42.5, "currency": "EUR"}`},
	}
	stamp := time.Now().UTC().Format("150405")
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	publish := "SELECT " + n.publishQuoted() + "($1, $2, $3, $4, $5::jsonb)"
	for i := 0; ; i++ {
		if !once || i < len(samples) {
			s := samples[i%len(samples)]
			key := fmt.Sprintf("sample-%s-%d", stamp, i+1)
			var result string
			if err := conn.QueryRow(ctx, publish, s.typ, s.agg, s.id, key, s.payload).Scan(&result); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return fmt.Errorf("publish %s: %w", key, err)
			}
			say("%s(%s, %s/%s, %s) = %s", n.publish, s.typ, s.agg, s.id, key, result)
		}
		if once && received.Load() >= int64(len(samples)) {
			say("all %d sample events arrived; stopping the relay", len(samples))
			relay.cmd.Process.Signal(syscall.SIGTERM)
			<-relay.done
			if relay.err != nil {
				return fmt.Errorf("relay exited: %w", relay.err)
			}
			return nil
		}
		wait := tick.C
		if once {
			wait = time.After(100 * time.Millisecond)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-relay.done:
			return fmt.Errorf("relay exited early: %v", relay.err)
		case <-wait:
		}
		if once && i > 600 {
			return errors.New("sample events did not arrive within a minute")
		}
	}
}

// relayCommand runs the outbox-relay binary with our output; cancelling ctx
// sends SIGTERM, the relay's graceful stop.
func relayCommand(ctx context.Context, bin string, out io.Writer, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 40 * time.Second
	return cmd
}
