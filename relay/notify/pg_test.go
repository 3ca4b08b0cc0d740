package notify_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/notify"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// The notifier against PostgreSQL (ledger/admin's store) and an HTTP
// receiver (sink/webhook's sender): the tests of docs/operations.md,
// "Dead-letter notifications".

func TestMain(m *testing.M) { pgtest.Main(m) }

// testInterval is the notifiers' interval in these tests.
const testInterval = 200 * time.Millisecond

var outbox = relay.QualifiedName{Schema: "public", Name: "integration_outbox"}

// mustDB returns a pool on a new migrated database.
func mustDB(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	ctx := context.Background()
	url := pgtest.NewDatabase(tb)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// mustDeadLetters inserts n rows dead-lettered at sink (status failed, as
// the engine writes them), in one transaction, and returns their ids.
func mustDeadLetters(tb testing.TB, pool *pgxpool.Pool, n int, sink, prefix string) []int64 {
	tb.Helper()
	rows, err := pool.Query(context.Background(), `
INSERT INTO integration_outbox (event_type, event_key, payload, status, attempts, last_error, processed_at)
SELECT 'order.created', $1 || '-' || g, '{}', 'failed', 1, 'sink ' || $2 || ': receiver answered 400 Bad Request', now()
  FROM generate_series(1, $3::int) AS g
RETURNING id`, prefix, sink, n)
	if err != nil {
		tb.Fatalf("insert dead letters: %v", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		tb.Fatalf("insert dead letters: %v", err)
	}
	slices.Sort(ids)
	return ids
}

// notified returns the id of the channel's mark, or -1 without a mark: the
// rows here are settled in id order, so a mark at or after a row's id is
// past it.
func notified(tb testing.TB, pool *pgxpool.Pool, channel string) int64 {
	tb.Helper()
	var id int64 = -1
	err := pool.QueryRow(context.Background(), fmt.Sprintf(`SELECT notified_id FROM %s WHERE channel = $1`,
		migrations.NotifyStateTable(outbox).Quoted()), channel).Scan(&id)
	if err != nil && err != pgx.ErrNoRows {
		tb.Fatal(err)
	}
	return id
}

// notification is the json format as a receiver reads it.
type notification struct {
	ID     string         `json:"id"`
	Sink   string         `json:"sink"`
	Count  int            `json:"count"`
	More   bool           `json:"more"`
	Events []notify.Event `json:"events"`
	From   string         // the X-Test-Relay header
}

// receiver is a notification target: it records what it accepted.
type receiver struct {
	*httptest.Server
	mu  sync.Mutex
	got []notification
}

func mustReceiver(tb testing.TB) *receiver {
	tb.Helper()
	r := &receiver{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		var n notification
		if err := json.Unmarshal(body, &n); err != nil {
			tb.Errorf("notification %s: %v", body, err)
		}
		n.From = req.Header.Get("X-Test-Relay")
		r.mu.Lock()
		defer r.mu.Unlock()
		r.got = append(r.got, n)
		w.WriteHeader(http.StatusNoContent)
	}))
	tb.Cleanup(r.Close)
	return r
}

// of returns the accepted notifications of sink.
func (r *receiver) of(sink string) []notification {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []notification
	for _, n := range r.got {
		if n.Sink == sink {
			out = append(out, n)
		}
	}
	return out
}

// startNotifier runs a notifier of the sinks n8n and nats on pool, posting
// to url as relay owner, until the test ends or stop is called; stop waits
// for Run to return.
func startNotifier(tb testing.TB, pool *pgxpool.Pool, url, owner string) (stop func()) {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	store, err := admin.NewNotifyStore(ctx, pool, outbox, owner)
	if err != nil {
		tb.Fatal(err)
	}
	sender, err := webhook.NewNotifier(webhook.NotifierConfig{URL: url, Format: webhook.NotifyJSON, Timeout: testInterval / 2,
		Headers: map[string]string{"X-Test-Relay": owner}})
	if err != nil {
		tb.Fatal(err)
	}
	n, err := notify.New(notify.Config{Store: store, Sender: sender, Sinks: []string{"n8n", "nats"}, Interval: testInterval,
		Logger: zerolog.New(zerolog.NewTestWriter(tb)).With().Str("owner", owner).Logger()})
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					tb.Errorf("Run: %v", err)
				}
			case <-time.After(10 * time.Second):
				tb.Error("the notifier did not stop within 10s of its context's end")
			}
			_ = sender.Close(context.Background())
		})
	}
	tb.Cleanup(stop)
	return stop
}

// waitFor polls cond every 20 ms until it holds, failing the test with what
// after timeout.
func waitFor(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("waited %s for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitMarks waits until the notifier has made the marks of its channels:
// its first pass.
func waitMarks(tb testing.TB, pool *pgxpool.Pool) {
	tb.Helper()
	waitFor(tb, 10*time.Second, "the notifier's first pass to make its marks", func() bool {
		return notified(tb, pool, "n8n") >= 0 && notified(tb, pool, "nats") >= 0 && notified(tb, pool, notify.AnySink) >= 0
	})
}

func eventIDs(n notification) []int64 {
	var ids []int64
	for _, e := range n.Events {
		ids = append(ids, e.ID)
	}
	return ids
}

// TestNotify_BurstIsOneNotification: 500 events dead-lettered at once make
// one notification, counting 500 and naming the first five; the passes
// after it (a later notification of another sink shows they ran) do not
// send it again.
func TestNotify_BurstIsOneNotification(t *testing.T) {
	pool := mustDB(t)
	rc := mustReceiver(t)
	startNotifier(t, pool, rc.URL, "relay-a")
	waitMarks(t, pool)

	ids := mustDeadLetters(t, pool, 500, "n8n", "burst")
	waitFor(t, 10*time.Second, "the burst's notification", func() bool { return len(rc.of("n8n")) > 0 })
	later := mustDeadLetters(t, pool, 3, "nats", "later")
	waitFor(t, 10*time.Second, "the later notification of nats", func() bool { return len(rc.of("nats")) > 0 })

	got := rc.of("n8n")
	if len(got) != 1 {
		t.Fatalf("%d notifications of n8n, want 1: %+v", len(got), got)
	}
	if n := got[0]; n.Count != 500 || n.More || !slices.Equal(eventIDs(n), ids[:5]) {
		t.Errorf("notification %+v, want 500 dead letters, the first five %v", n, ids[:5])
	}
	if n := rc.of("nats")[0]; n.Count != 3 || !slices.Equal(eventIDs(n), later) {
		t.Errorf("notification of nats %+v, want its 3 dead letters %v", n, later)
	}
	if len(rc.of(notify.AnySink)) != 0 {
		t.Errorf("notifications of %q: %+v, want none", notify.AnySink, rc.of(notify.AnySink))
	}
}

// TestNotify_RestartNeitherRepeatsNorLoses: a notifier stopped after its
// summary was recorded and started again (a new relay process: a new
// owner) does not send that summary again, and notifies once of the dead
// letters settled while it was stopped.
func TestNotify_RestartNeitherRepeatsNorLoses(t *testing.T) {
	pool := mustDB(t)
	rc := mustReceiver(t)
	stop := startNotifier(t, pool, rc.URL, "relay-before")
	waitMarks(t, pool)
	first := mustDeadLetters(t, pool, 10, "n8n", "first")
	waitFor(t, 10*time.Second, "the first summary to be recorded", func() bool { return notified(t, pool, "n8n") >= first[len(first)-1] })
	stop()

	whileStopped := mustDeadLetters(t, pool, 7, "n8n", "stopped")
	startNotifier(t, pool, rc.URL, "relay-after")
	waitFor(t, 10*time.Second, "the summary of the dead letters settled while stopped",
		func() bool { return notified(t, pool, "n8n") >= whileStopped[len(whileStopped)-1] })
	mustDeadLetters(t, pool, 1, "nats", "later")
	waitFor(t, 10*time.Second, "a later notification of nats", func() bool { return len(rc.of("nats")) > 0 })

	got := rc.of("n8n")
	if len(got) != 2 {
		t.Fatalf("%d notifications of n8n, want 2 (one before the restart, one after): %+v", len(got), got)
	}
	if got[0].Count != 10 || got[0].From != "relay-before" || !slices.Equal(eventIDs(got[0]), first[:5]) {
		t.Errorf("before the restart: %+v, want the first 10", got[0])
	}
	if got[1].Count != 7 || got[1].From != "relay-after" || !slices.Equal(eventIDs(got[1]), whileStopped[:5]) {
		t.Errorf("after the restart: %+v, want the 7 settled while stopped", got[1])
	}
}

// TestNotify_TwoRelaysNeverSendTheSameWindow: two notifiers on one
// database (an HA pair) notify each dead letter once between them: the
// counts of all notifications add up to the dead letters, and no
// notification is sent twice.
func TestNotify_TwoRelaysNeverSendTheSameWindow(t *testing.T) {
	pool := mustDB(t)
	rc := mustReceiver(t)
	startNotifier(t, pool, rc.URL, "relay-a")
	startNotifier(t, pool, rc.URL, "relay-b")
	waitMarks(t, pool)

	want := map[string]int{}
	last := map[string]int64{}
	for i := range 12 {
		sink := []string{"n8n", "nats"}[i%2]
		ids := mustDeadLetters(t, pool, 20, sink, fmt.Sprintf("b%d", i))
		want[sink] += len(ids)
		last[sink] = ids[len(ids)-1]
		time.Sleep(testInterval / 3) // the dead letters of several windows
	}
	for sink, id := range last {
		waitFor(t, 20*time.Second, "every dead letter of "+sink+" notified", func() bool { return notified(t, pool, sink) >= id })
	}

	from := map[string]int{}
	for sink, total := range want {
		seen := map[string]bool{}
		sum := 0
		for _, n := range rc.of(sink) {
			if seen[n.ID] {
				t.Errorf("notification %s of %s sent twice", n.ID, sink)
			}
			seen[n.ID] = true
			sum += n.Count
			from[n.From]++
		}
		if sum != total {
			t.Errorf("%s: the notifications count %d dead letters, want %d: %+v", sink, sum, total, rc.of(sink))
		}
	}
	t.Logf("notifications sent by relay: %v", from)
}
