// Command outbox-relay-dev is what `make run` starts: with DATABASE_URL it
// attaches to that database; without it, it starts a private logical-WAL
// PostgreSQL cluster from the local binaries (the tests' harness). It then
// migrates with the outbox-relay binary, runs the relay with two sinks — the
// embedded NATS server and a small webhook receiver that prints what it gets —
// and publishes sample events, until Ctrl-C.
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
	if err := run(ctx, *relayBin, *once, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-dev: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, relayBin string, once bool, out io.Writer) error {
	say := func(format string, args ...any) { fmt.Fprintf(out, "==> "+format+"\n", args...) }
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

	url := os.Getenv("DATABASE_URL")
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
	}
	say("database: %s", url)

	say("outbox-relay migrate")
	if err := relayCommand(ctx, relayBin, out, "migrate", "--database-url", url).Run(); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}

	// A webhook receiver standing in for n8n: it prints every delivery.
	var received atomic.Int64
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var env struct {
			ID          int64           `json:"id"`
			EventType   string          `json:"event_type"`
			AggregateID string          `json:"aggregate_id"`
			Payload     json.RawMessage `json:"payload"`
		}
		body, _ := io.ReadAll(r.Body)
		json.Unmarshal(body, &env)
		received.Add(1)
		say("webhook received #%d %s %s %s (webhook-id %s, attempt %s)", env.ID, env.EventType, env.AggregateID,
			env.Payload, r.Header.Get("webhook-id"), r.Header.Get("webhook-attempt"))
		w.WriteHeader(http.StatusNoContent)
	})}
	go srv.Serve(ln)
	defer srv.Close()

	cfgPath := filepath.Join(work, "relay.yaml")
	cfg := fmt.Sprintf(`database_url: %q
data_dir: %q
sinks:
  - name: nats
    type: nats            # no url: the embedded NATS server with JetStream
  - name: dev-webhook
    type: webhook
    url: http://%s/webhook/outbox
http:
  listen: 127.0.0.1:0
log: {level: info, format: console}
`, url, filepath.Join(work, "data"), ln.Addr())
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return err
	}

	say("outbox-relay run --config %s", cfgPath)
	relayCtx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	relay := relayCommand(relayCtx, relayBin, out, "run", "--config", cfgPath)
	if err := relay.Start(); err != nil {
		return err
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Wait() }()

	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())

	// Rows written before the slot exists belong to the claim path; wait for
	// the stream so the samples show it.
	for streaming := false; !streaming; {
		if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active)").Scan(&streaming); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case err := <-relayDone:
			return fmt.Errorf("relay exited before streaming: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
	}

	samples := []struct{ typ, agg, id, payload string }{
		{"lead.created", "lead", "L1", `{"name": "Ada", "source": "web"}`},
		{"lead.qualified", "lead", "L1", `{"score": 87}`},
		{"order.placed", "order", "O7", `{"total": 42.5, "currency": "EUR"}`},
	}
	stamp := time.Now().UTC().Format("150405")
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for i := 0; ; i++ {
		if !once || i < len(samples) {
			s := samples[i%len(samples)]
			key := fmt.Sprintf("sample-%s-%d", stamp, i+1)
			var result string
			if err := conn.QueryRow(ctx, "SELECT outbox_publish($1, $2, $3, $4, $5::jsonb)", s.typ, s.agg, s.id, key, s.payload).Scan(&result); err != nil {
				return fmt.Errorf("publish %s: %w", key, err)
			}
			say("outbox_publish(%s, %s/%s, %s) = %s", s.typ, s.agg, s.id, key, result)
		}
		if once && received.Load() >= int64(len(samples)) {
			say("all %d sample events arrived; stopping the relay", len(samples))
			relay.Process.Signal(syscall.SIGTERM)
			if err := <-relayDone; err != nil {
				return fmt.Errorf("relay exited: %w", err)
			}
			return nil
		}
		wait := tick.C
		if once {
			wait = time.After(100 * time.Millisecond)
		}
		select {
		case <-ctx.Done():
			stopRelay()
			<-relayDone
			return nil
		case err := <-relayDone:
			return fmt.Errorf("relay exited early: %v", err)
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
