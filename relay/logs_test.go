package relay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// logBuffer collects an engine's JSON log lines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// lines returns the lines logged so far that match, decoded.
func (b *logBuffer) lines(t *testing.T, match func(line map[string]any) bool) []map[string]any {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	for raw := range bytes.Lines(b.buf.Bytes()) {
		var line map[string]any
		if err := json.Unmarshal(raw, &line); err != nil {
			t.Fatalf("log line %q: %v", raw, err)
		}
		if match(line) {
			out = append(out, line)
		}
	}
	return out
}

// startLoggedEngine is startEngine with the engine's lines at info and
// above captured, and its circuits on clock (nil: time.Now).
func startLoggedEngine(t *testing.T, cfg relay.EngineConfig, clock func() time.Time) (*relay.Engine, *logBuffer) {
	t.Helper()
	logs := &logBuffer{}
	cfg.Logger = zerolog.New(zerolog.MultiLevelWriter(logs, zerolog.NewTestWriter(t))).Level(zerolog.InfoLevel)
	e, err := relay.NewEngine(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if clock != nil {
		e.SetClock(clock)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { e.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return e, logs
}

// newWebhook is a webhook sink named n8n posting to url.
func newWebhook(t *testing.T, url string) *webhook.Sink {
	t.Helper()
	s, err := webhook.New(webhook.Config{Name: "n8n", URL: url})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close(context.Background()) })
	return s
}

// TestLogs_DeliveryFailureOncePerEventAndChange: a receiver fails one event
// several times. The relay logs the event's first failure at the sink with
// its status and next attempt, then only a change — another status, the
// diversion to the claim path, the dead letter — and, once it is delivered,
// one info line (docs/operations.md, "Logs"). Before, three 500s and a
// diversion logged nothing at all.
func TestLogs_DeliveryFailureOncePerEventAndChange(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name    string
		answers []int // the receiver's first answers; 200 after them
		policy  relay.Policy
		claims  int // claim passes after the stream's
		want    []string
	}{
		{name: "three 500s then 200", answers: []int{500, 500, 500}, policy: relay.Policy{InlineAttempts: 4},
			want: []string{"warn 500 attempt 1 next inline_retry", "info after 500 attempt 4 delivered"}},
		{name: "another status is a change", answers: []int{500, 500, 502}, policy: relay.Policy{InlineAttempts: 4},
			want: []string{"warn 500 attempt 1 next inline_retry", "warn 502 attempt 3 next inline_retry", "info after 502 attempt 4 delivered"}},
		{name: "the diversion is a change, the claim path's repeat is not", answers: []int{500, 500, 500, 500}, policy: relay.Policy{InlineAttempts: 3}, claims: 2,
			want: []string{"warn 500 attempt 1 next inline_retry", "warn 500 attempt 3 next claim_path", "info after 500 attempt 5 delivered"}},
		{name: "the dead letter is a change", answers: []int{500, 500}, policy: relay.Policy{InlineAttempts: 3, MaxAttempts: 2},
			want: []string{"warn 500 attempt 1 next inline_retry", "warn 500 attempt 2 next dead_letter"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var requests atomic.Int32
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if n := int(requests.Add(1)); n <= len(tt.answers) {
					w.WriteHeader(tt.answers[n-1])
					fmt.Fprint(w, `{"message":"Error in workflow"}`)
				}
			}))
			t.Cleanup(srv.Close)
			store := newFakeStore()
			rec := &claimRecorder{settled: map[int64]relay.Decision{}}
			e, logs := startLoggedEngine(t, relay.EngineConfig{Stream: store, Claim: &fakeClaimStore{settleClaim: rec.settle}, Owner: "me",
				Routes: []relay.Route{{Sink: newWebhook(t, srv.URL)}}, Policy: tt.policy}, nil)
			c := e.Stream()
			submit(t, c, event(1, "a"))
			c.Commit(100)
			waitSettledAt(t, c, 100)
			attempts := 0
			if _, diversions, _ := store.snapshot(); len(diversions) > 0 {
				attempts = diversions[1].Attempts
			}
			for range tt.claims {
				w := claimWork(1, "a")
				w.Event.Attempts = attempts
				rec.mu.Lock()
				delete(rec.settled, 1)
				rec.mu.Unlock()
				if _, err := e.SubmitClaimed(context.Background(), []*relay.Work{w}); err != nil {
					t.Fatal(err)
				}
				waitFor(t, "the claim pass settled", func() bool { _, ok := rec.decision(1); return ok })
				d, _ := rec.decision(1)
				attempts = d.Attempts
			}

			var got []string
			for _, l := range logs.lines(t, func(l map[string]any) bool { return l["event_key"] == "k1" }) {
				if l["sink"] != "n8n" || l["id"] != float64(1) {
					t.Errorf("line without the sink or the event's id: %v", l)
				}
				switch l["level"] {
				case "warn":
					if at, _ := l["next_at"].(string); (l["next"] == "inline_retry" || l["next"] == "claim_path") && at == "" {
						t.Errorf("line without the next attempt's time: %v", l)
					}
					got = append(got, fmt.Sprintf("warn %v attempt %v next %v", l["status"], l["attempt"], l["next"]))
				default:
					got = append(got, fmt.Sprintf("%v after %v attempt %v delivered", l["level"], l["after"], l["attempt"]))
				}
			}
			if strings.Join(got, "\n") != strings.Join(tt.want, "\n") {
				t.Fatalf("%d lines about the event:\n%s\nwant %d:\n%s", len(got), strings.Join(got, "\n"), len(tt.want), strings.Join(tt.want, "\n"))
			}
		})
	}
}

// fakeClock is a clock a test moves.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// TestLogs_CircuitOpensOnceSummarisesAndCloses: an n8n workflow is not
// published for 150 s (of the circuit's clock) while events keep coming.
// The relay logs the circuit opening once, naming the fix; a summary of the
// failed probes at most once a minute; and its closing once the workflow
// answers, with how long it was open and how many events waited
// (docs/operations.md, "Logs"). Before, every failed probe logged the
// opening again: a line every 2 s for as long as the sink was down.
func TestLogs_CircuitOpensOnceSummarisesAndCloses(t *testing.T) {
	t.Parallel()
	var published atomic.Bool
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		if !published.Load() {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprint(w, `{"code":404,"message":"The requested webhook \"POST outbox\" is not registered.","hint":"The workflow must be active for a production URL to run successfully."}`)
		}
	}))
	t.Cleanup(srv.Close)
	clock := &fakeClock{now: time.Now()}
	e, logs := startLoggedEngine(t, relay.EngineConfig{Stream: newFakeStore(), Routes: []relay.Route{{Sink: newWebhook(t, srv.URL)}}}, clock.Now)
	c := e.Stream()
	id := int64(0)
	next := func() {
		id++
		submit(t, c, event(id, fmt.Sprint(id)))
		c.Commit(relay.LSN(id * 100))
		waitSettledAt(t, c, relay.LSN(id*100))
	}

	next() // opens the circuit
	const probes = 75
	for range probes {
		clock.Add(2 * time.Second)
		next() // probes the sink: the circuit's cool-down has passed
		next() // waits: the circuit is open again
	}
	if n := requests.Load(); n != 1+probes {
		t.Fatalf("%d requests, want %d: one per cool-down of the circuit", n, 1+probes)
	}
	published.Store(true)
	clock.Add(2 * time.Second)
	next()

	sinkLines := logs.lines(t, func(l map[string]any) bool { return l["sink"] == "n8n" })
	var opened, summaries, closed []map[string]any
	for _, l := range sinkLines {
		msg, _ := l["message"].(string)
		switch {
		case strings.Contains(msg, "circuit open"):
			opened = append(opened, l)
		case strings.Contains(msg, "circuit still open"):
			summaries = append(summaries, l)
		case strings.Contains(msg, "circuit closed"):
			closed = append(closed, l)
		}
	}
	if len(opened) != 1 {
		t.Fatalf("%d lines open the circuit, want 1", len(opened))
	}
	if msg, _ := opened[0]["error"].(string); opened[0]["level"] != "warn" || !strings.Contains(msg, "not registered") || !strings.Contains(msg, "publish") {
		t.Errorf("the opening line does not say why and the fix (publish the workflow): %v", opened[0])
	}
	// 150 s open: a summary after 60 and after 120 s.
	if len(summaries) != 2 {
		t.Fatalf("%d summaries of the failed probes in 150 s, want 2 (one a minute): %v", len(summaries), summaries)
	}
	for i, l := range summaries {
		msg, _ := l["message"].(string)
		if want := fmt.Sprintf("circuit still open: %d probes failed since", 30*(i+1)); l["level"] != "warn" || !strings.Contains(msg, want) ||
			!strings.Contains(msg, "not registered") {
			t.Errorf("summary %d: %v, want %q and the last error", i+1, l, want)
		}
	}
	if len(closed) != 1 {
		t.Fatalf("%d lines close the circuit, want 1", len(closed))
	}
	// Event 1, each probe's and each that waited while open.
	if msg, _ := closed[0]["message"].(string); closed[0]["level"] != "info" || !strings.Contains(msg, "circuit closed after 2m32s: 151 events waited") {
		t.Errorf("the closing line: %v, want info \"circuit closed after 2m32s: 151 events waited\"", closed[0])
	}
	if other := len(sinkLines) - len(opened) - len(summaries) - len(closed); other != 0 {
		t.Errorf("%d other lines about the sink, want none (a sink-down failure is not the event's): %v", other, sinkLines)
	}
}
