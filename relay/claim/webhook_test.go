package claim_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// The claim path with the real webhook sink against an HTTP receiver that
// answers each event's first request with 503: the retry carries the same
// idempotency key and the same body (the stream's envelope), the attempt
// header counts, and each event ends delivered.
func TestWebhookSinkAgainstReceiver(t *testing.T) {
	f := MustFixture(t)
	type request struct {
		id, idempotencyKey, attempt string
		body                        []byte
	}
	var (
		mu       sync.Mutex
		requests = map[string][]request{}
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		id := r.Header.Get("Webhook-Id")
		mu.Lock()
		requests[id] = append(requests[id], request{id: id, idempotencyKey: r.Header.Get("Idempotency-Key"),
			attempt: r.Header.Get("Webhook-Attempt"), body: body})
		first := len(requests[id]) == 1
		mu.Unlock()
		if first {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	sink, err := webhook.New(webhook.Config{Name: "n8n", URL: srv.URL, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close(context.Background())

	keys := []string{"order-1", "order-2", "order-3"}
	for i, k := range keys {
		f.MustInsert(t, event{Key: k, AggType: "order", AggID: "A", Payload: `{"n": ` + string(rune('1'+i)) + `, "s": "é"}`})
	}
	MustStart(t, f, options{Routes: []relay.Route{{Sink: sink}}, All: true, PollInterval: 50 * time.Millisecond,
		Backoff: []time.Duration{200 * time.Millisecond}})
	waitFor(t, 20*time.Second, "every row done", func() bool { return f.MustStatusCount(t, "done") == int64(len(keys)) })

	mu.Lock()
	defer mu.Unlock()
	for _, k := range keys {
		reqs := requests[k]
		if len(reqs) != 2 {
			t.Errorf("%s: %d requests, want 2", k, len(reqs))
			continue
		}
		var want relay.Event
		var created pgtype.Timestamptz
		err := f.pool.QueryRow(context.Background(), `SELECT id, event_key, event_type, aggregate_type, aggregate_id, payload::text, created_at
			FROM integration_outbox WHERE event_key = $1`, k).Scan(&want.ID, &want.EventKey, &want.EventType,
			&want.AggregateType, &want.AggregateID, &want.Payload, &created)
		if err != nil {
			t.Fatal(err)
		}
		want.CreatedAt = created.Time
		for i, r := range reqs {
			if r.idempotencyKey != k || r.attempt != string(rune('1'+i)) {
				t.Errorf("%s request %d: Idempotency-Key %q, webhook-attempt %q", k, i+1, r.idempotencyKey, r.attempt)
			}
			if string(r.body) != string(want.AppendEnvelope(nil)) {
				t.Errorf("%s request %d: body %s, want %s", k, i+1, r.body, want.AppendEnvelope(nil))
			}
		}
	}
	if n := f.MustInt(t, `SELECT count(*) FROM integration_idempotency WHERE action = 'n8n' AND state = 'delivered'`); n != int64(len(keys)) {
		t.Errorf("%d delivered ledger pairs, want %d", n, len(keys))
	}
}
