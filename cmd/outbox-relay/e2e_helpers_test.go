package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// delivery is one raw request or message as a destination saw it.
type delivery struct {
	EventKey string // from the body: catches a repeat sent with a wrong id
	ID       int64
	Agg      string
	IdemKey  string // webhook-id / Nats-Msg-Id
	Body     string
	At       time.Time
	From     string // the X-Test-Relay header: which relay sent it, when a test sets it per relay
}

func parseDelivery(body []byte, idem string) delivery {
	var env struct {
		ID            int64   `json:"id"`
		EventKey      string  `json:"event_key"`
		AggregateType *string `json:"aggregate_type"`
		AggregateID   *string `json:"aggregate_id"`
	}
	json.Unmarshal(body, &env)
	agg := ""
	if env.AggregateType != nil && env.AggregateID != nil {
		agg = *env.AggregateType + "/" + *env.AggregateID
	}
	return delivery{EventKey: env.EventKey, ID: env.ID, Agg: agg, IdemKey: idem, Body: string(body), At: time.Now()}
}

// natsIdemKey is what a consumer of the stream deduplicates a message on
// within its deployment: the Nats-Msg-Id without the scope of the
// deployment that published it (docs/sinks.md, "Message ids"). A Msg-Id
// that is not so scoped is returned whole, for the test to fail on.
func natsIdemKey(h nats.Header) string {
	id := h.Get(jetstream.MsgIDHeader)
	if key, ok := strings.CutPrefix(id, h.Get(natssink.HeaderDeployment)+":"); ok && h.Get(natssink.HeaderDeployment) != "" {
		return key
	}
	return id
}

// receiver is a webhook destination that records every request.
type receiver struct {
	*httptest.Server
	mu    sync.Mutex
	got   []delivery
	reply func(d delivery) int // status to answer; nil: 204
}

func newReceiver(t *testing.T) *receiver {
	r := &receiver{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodPost { // doctor's OPTIONS probe delivers nothing
			w.WriteHeader(http.StatusNoContent)
			return
		}
		body, _ := io.ReadAll(req.Body)
		d := parseDelivery(body, req.Header.Get("webhook-id"))
		d.From = req.Header.Get("X-Test-Relay")
		r.mu.Lock()
		reply := r.reply
		r.mu.Unlock()
		status := http.StatusNoContent
		if reply != nil {
			status = reply(d)
		}
		if status < 300 {
			r.mu.Lock()
			r.got = append(r.got, d)
			r.mu.Unlock()
		}
		w.WriteHeader(status)
	}))
	t.Cleanup(r.Close)
	return r
}

func (r *receiver) setReply(f func(d delivery) int) {
	r.mu.Lock()
	r.reply = f
	r.mu.Unlock()
}

func (r *receiver) deliveries() []delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// streamMessages reads every message of the OUTBOX stream.
func streamMessages(t *testing.T, url string) []delivery {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("nats: %v", err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stream, err := js.Stream(ctx, "OUTBOX")
	if err != nil {
		return nil
	}
	info, err := stream.Info(ctx)
	if err != nil || info.State.Msgs == 0 {
		return nil
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	var out []delivery
	for uint64(len(out)) < info.State.Msgs {
		batch, err := cons.FetchNoWait(1000)
		if err != nil {
			t.Fatalf("fetch: %v", err)
		}
		n := 0
		for m := range batch.Messages() {
			out = append(out, parseDelivery(m.Data(), natsIdemKey(m.Headers())))
			n++
		}
		if n == 0 {
			time.Sleep(20 * time.Millisecond)
		}
	}
	return out
}

// deployment returns the Deployment the relay's NATS sink derives from the
// setup's database (no msg_id_prefix), scoping every event (a new outbox).
func (s *setup) deployment(t *testing.T) natssink.Deployment {
	t.Helper()
	id, err := admin.ReadIdentity(context.Background(), s.pool)
	if err != nil {
		t.Fatal(err)
	}
	outbox := relay.QualifiedName{Schema: "public", Name: "integration_outbox"}
	return natssink.Deployment{ID: natssink.DeploymentID(id.SystemIdentifier, id.Database, outbox.Quoted()), ScopedFrom: 1}
}

// setup is a migrated database, a NATS server and a webhook receiver.
type setup struct {
	url  string
	pool *pgxpool.Pool
	nats *natstest.Server
	hook *receiver
	dir  string
}

func newSetup(t *testing.T, dbURL string) *setup {
	t.Helper()
	return newSetupWith(t, dbURL, migrations.Options{Names: migrations.DefaultNames()})
}

func newSetupWith(t *testing.T, dbURL string, opts migrations.Options) *setup {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrations.Migrate(ctx, conn, opts); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return &setup{url: dbURL, pool: pool, nats: natstest.Start(t), hook: newReceiver(t), dir: t.TempDir()}
}

// configFile writes a relay config for this setup; extra is appended YAML
// for the webhook sink.
func (s *setup) configFile(t *testing.T, extraHook string) string {
	t.Helper()
	return s.configFileWith(t, extraHook, "")
}

// configFileWith also appends top-level YAML (a source: section, say).
func (s *setup) configFileWith(t *testing.T, extraHook, extraTop string) string {
	t.Helper()
	path := filepath.Join(s.dir, "relay.yaml")
	cfg := fmt.Sprintf(`database_url: %q
data_dir: %q
delivery:
  backoff: [1m]
sinks:
  - name: nats
    type: nats
    url: %s
  - name: hook
    type: webhook
    url: %s
%s
log: {level: debug, format: json}
shutdown_timeout: 10s
http: {listen: "127.0.0.1:0"}
%s
`, s.url, filepath.Join(s.dir, "data"), s.nats.URL(), s.hook.URL, extraHook, extraTop)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// startInProcess runs the relay in this process until the test ends.
func (s *setup) startInProcess(t *testing.T, cfgPath string) (stop func()) {
	t.Helper()
	// Every line is checked for a repeated key as it is written (logLines).
	return runInProcess(t, config.Options{Path: cfgPath}, zerolog.New(newLogLines(t, zerolog.NewTestWriter(t))).Level(zerolog.InfoLevel).With().Timestamp().Logger())
}

// runInProcess loads the configuration and runs the relay in this process
// with log until the test ends or stop is called; stop waits for it to exit.
func runInProcess(t *testing.T, opts config.Options, log zerolog.Logger) (stop func()) {
	t.Helper()
	cfg, err := config.Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runRelay(ctx, cfg, log) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("relay: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Error("relay did not stop within 30s")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// syncBuffer collects a log written from several goroutines (or a
// subprocess's output copied by exec).
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

// relayBinary builds the outbox-relay binary once per test run, in a
// directory pgtest.Main removes after the tests.
var relayBinary = sync.OnceValues(func() (string, error) {
	dir, err := pgtest.SharedDir("outbox-relay-bin-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "outbox-relay")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build: %v\n%s", err, out)
	}
	return bin, nil
})

// startProcess runs the relay binary as a subprocess (for kill -9).
func (s *setup) startProcess(t *testing.T, cfgPath string, logFile io.Writer) *exec.Cmd {
	t.Helper()
	bin, err := relayBinary()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--config", cfgPath)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	return cmd
}

// publishWriters inserts perWriter events from each of writers concurrent
// connections; writer w owns aggregates "w<w>-<n>" for n < aggregates.
func (s *setup) publishWriters(t *testing.T, writers, perWriter, aggregates int, prefix string) {
	t.Helper()
	s.publishWritersPaced(t, writers, perWriter, aggregates, prefix, 0)
}

// publishWritersPaced is publishWriters with a pause after each event.
func (s *setup) publishWritersPaced(t *testing.T, writers, perWriter, aggregates int, prefix string, pause time.Duration) {
	t.Helper()
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			ctx := context.Background()
			for i := range perWriter {
				agg := fmt.Sprintf("w%d-%d", w, i%aggregates)
				key := fmt.Sprintf("%s-w%d-%d", prefix, w, i)
				var res string
				if err := s.pool.QueryRow(ctx, `SELECT outbox_publish('order.placed', 'order', $1, $2, jsonb_build_object('i', $3::int, 'pad', repeat('x', 250)))`,
					agg, key, i).Scan(&res); err != nil {
					t.Errorf("publish %s: %v", key, err)
					return
				}
				if pause > 0 {
					time.Sleep(pause)
				}
			}
		})
	}
	wg.Wait()
}

func (s *setup) keys(t *testing.T, where string) map[string]bool {
	t.Helper()
	rows, err := s.pool.Query(context.Background(), "SELECT event_key FROM integration_outbox WHERE "+where)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, k := range keys {
		out[k] = true
	}
	return out
}

func (s *setup) scalar(t *testing.T, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := s.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func (s *setup) slotLSN(t *testing.T) (confirmed, current relay.LSN) {
	t.Helper()
	err := s.pool.QueryRow(context.Background(), `SELECT coalesce((SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'outbox_relay'), '0/0'),
		pg_current_wal_lsn()::text`).Scan(&confirmed, &current)
	if err != nil {
		t.Fatal(err)
	}
	return confirmed, current
}

func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkOrder asserts that, per aggregate, first deliveries arrive in
// increasing id order.
func checkOrder(t *testing.T, sink string, ds []delivery) {
	t.Helper()
	seen := map[string]bool{}
	last := map[string]int64{}
	for _, d := range ds {
		if seen[d.EventKey] {
			continue
		}
		seen[d.EventKey] = true
		if d.ID < last[d.Agg] {
			t.Fatalf("%s: aggregate %s got event %d after %d", sink, d.Agg, d.ID, last[d.Agg])
		}
		last[d.Agg] = d.ID
	}
}

func byKey(ds []delivery) map[string][]delivery {
	out := map[string][]delivery{}
	for _, d := range ds {
		out[d.EventKey] = append(out[d.EventKey], d)
	}
	return out
}

var _ = strings.Contains

// doneSQL is the SQL condition "the outbox row o is done": the settlement
// writes a delivered row's status (docs/operations.md, "what the relay
// writes back").
const doneSQL = `(o.status = 'done')`

// doneRows counts the outbox rows that are done (doneSQL) and match where.
func (s *setup) doneRows(t *testing.T, where string) int64 {
	t.Helper()
	return s.scalar(t, "SELECT count(*) FROM integration_outbox AS o WHERE "+doneSQL+" AND ("+where+")")
}

// waitDone waits until want rows matching where are done: the delivered
// record is written with the checkpoint that follows the deliveries.
func (s *setup) waitDone(t *testing.T, where string, want int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := s.doneRows(t, where)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d rows done (%s), want %d", n, where, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
