package webhook_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/sinktest"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// batchElem is one element of a batch request's array.
type batchElem struct {
	ID      string          `json:"id"`
	Attempt int             `json:"attempt"`
	Event   json.RawMessage `json:"event"`
}

func mustElems(tb testing.TB, body []byte) []batchElem {
	tb.Helper()
	var elems []batchElem
	if err := json.Unmarshal(body, &elems); err != nil {
		tb.Fatalf("batch body %q is not an array of events: %v", body, err)
	}
	return elems
}

// sendAll sends ds concurrently, as the engine's lane does, and returns
// each one's outcome in ds's order.
func sendAll(tb testing.TB, s relay.Sink, ds []*relay.Delivery) []error {
	tb.Helper()
	errs := make([]error, len(ds))
	var wg sync.WaitGroup
	for i, d := range ds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = send(tb, s, d)
		}()
	}
	wg.Wait()
	return errs
}

// sendInOrder queues ds one after another from one goroutine, so a batch
// carries them in ds's order, and returns each one's outcome in ds's order.
func sendInOrder(tb testing.TB, s relay.Sink, ds []*relay.Delivery) []error {
	tb.Helper()
	outcomes := make([]chan error, len(ds))
	for i, d := range ds {
		outcomes[i] = make(chan error, 1)
		s.Send(context.Background(), d, func(err error) { outcomes[i] <- err })
	}
	errs := make([]error, len(ds))
	deadline := time.After(20 * time.Second)
	for i, d := range ds {
		select {
		case errs[i] = <-outcomes[i]:
		case <-deadline:
			tb.Fatalf("done not called for %s", d.Event.EventKey)
		}
	}
	return errs
}

func deliveries(n int) []*relay.Delivery {
	ds := make([]*relay.Delivery, n)
	for i := range ds {
		ds[i] = sinktest.NewDelivery(i + 1)
	}
	return ds
}

func TestBatch_SinkSuite(t *testing.T) {
	sinktest.Run(t, func(t *testing.T) *sinktest.Harness {
		rc := MustReceiver(t, nil)
		return &sinktest.Harness{
			Sink: MustSink(t, webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: 10, MaxWait: 5 * time.Millisecond}}),
			Received: func() []sinktest.Message {
				var msgs []sinktest.Message
				for _, r := range rc.Requests() {
					for _, e := range mustElems(t, r.Body) {
						msgs = append(msgs, sinktest.Message{IdempotencyKey: e.ID, Body: e.Event, Attempt: e.Attempt})
					}
				}
				return msgs
			},
		}
	})
}

func TestBatch_PerEventAnswers(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte(`{"results":[{"id":"evt-1","result":"ok"},{"id":"evt-2","result":"retry","message":"busy"},` +
			`{"id":"evt-3","result":"fail","message":"bad address"},{"id":"evt-4","result":"maybe"}]}`))
	})
	s := MustSink(t, webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: 5, MaxWait: time.Second}})
	ds := deliveries(5)
	ds[2].Attempt = 3
	errs := sendAll(t, s, ds)

	reqs := rc.Requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want the 5 events in one", len(reqs))
	}
	elems := mustElems(t, reqs[0].Body)
	if len(elems) != 5 {
		t.Fatalf("batch of %d events, want 5", len(elems))
	}
	seen := map[string]batchElem{}
	for _, e := range elems {
		seen[e.ID] = e
	}
	for _, d := range ds {
		e, ok := seen[d.Event.EventKey]
		if !ok || string(e.Event) != string(d.Body) || e.Attempt != d.Attempt {
			t.Errorf("event %s in the batch as %+v, want its body and attempt %d", d.Event.EventKey, e, d.Attempt)
		}
	}
	if got := reqs[0].Header.Get("Outbox-Batch-Size"); got != "5" {
		t.Errorf("Outbox-Batch-Size = %q, want 5", got)
	}
	if id := reqs[0].Header.Get("Webhook-Id"); !strings.HasPrefix(id, "batch_") || reqs[0].Header.Get("Idempotency-Key") != id {
		t.Errorf("webhook-id %q, Idempotency-Key %q: want one batch_ id", id, reqs[0].Header.Get("Idempotency-Key"))
	}

	want := []struct {
		delivered bool
		class     relay.ErrorClass
		contains  string
	}{
		{delivered: true},
		{class: relay.Transient, contains: "busy"},
		{class: relay.Permanent, contains: "bad address"},
		{class: relay.Unknown, contains: `"maybe"`},
		{class: relay.Unknown, contains: "do not list it"},
	}
	for i, w := range want {
		err := errs[i]
		if w.delivered {
			if err != nil {
				t.Errorf("event %d: %v, want delivered", i+1, err)
			}
			continue
		}
		if class, _ := relay.Classify(err); err == nil || class != w.class || !strings.Contains(err.Error(), w.contains) {
			t.Errorf("event %d: %v, want %v containing %q", i+1, err, w.class, w.contains)
		}
	}
}

// TestBatch_ResentBatchHasANewRequestID: the request's webhook-id and
// Idempotency-Key name the request, not the events it carries. The same
// events sent again, at a later attempt or at the same attempt (as after a
// crash before the attempt was recorded), carry a new request id, so a
// receiver or gateway that dedupes on it never takes a re-send for the
// first send; each event's id in the body is unchanged.
func TestBatch_ResentBatchHasANewRequestID(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: 3, MaxWait: time.Second}})
	attempts := []int{1, 2, 2}
	for _, attempt := range attempts {
		ds := deliveries(3)
		for _, d := range ds {
			d.Attempt = attempt
		}
		for i, err := range sendInOrder(t, s, ds) {
			if err != nil {
				t.Fatalf("attempt %d, evt-%d: %v", attempt, i+1, err)
			}
		}
	}
	reqs := rc.Requests()
	if len(reqs) != len(attempts) {
		t.Fatalf("%d requests, want %d batches of 3", len(reqs), len(attempts))
	}
	seen := map[string]int{}
	for n, r := range reqs {
		id := r.Header.Get("Webhook-Id")
		if !strings.HasPrefix(id, "batch_") || r.Header.Get("Idempotency-Key") != id {
			t.Errorf("request %d: webhook-id %q, Idempotency-Key %q: want one batch_ id", n+1, id, r.Header.Get("Idempotency-Key"))
		}
		if first, ok := seen[id]; ok {
			t.Errorf("request %d (attempt %d) carries request id %q, as request %d (attempt %d) did", n+1, attempts[n], id, first+1, attempts[first])
		}
		seen[id] = n
		elems := mustElems(t, r.Body)
		if len(elems) != 3 {
			t.Fatalf("request %d carries %d events, want 3", n+1, len(elems))
		}
		for i, e := range elems {
			if want := fmt.Sprintf("evt-%d", i+1); e.ID != want || e.Attempt != attempts[n] {
				t.Errorf("request %d, element %d: id %q attempt %d, want id %q (unchanged) attempt %d", n+1, i+1, e.ID, e.Attempt, want, attempts[n])
			}
		}
	}
}

func TestBatch_PlainSuccess(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, body string }{
		{"empty", ""},
		{"n8n default", `{"message":"Workflow was started"}`},
		{"array of other items", `[{"result":"applied","event_key":"evt-1"}]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rc := MustReceiver(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte(tc.body)) })
			s := MustSink(t, webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: 3, MaxWait: time.Second}})
			for i, err := range sendAll(t, s, deliveries(3)) {
				if err != nil {
					t.Errorf("event %d: %v, want delivered by a plain 2xx", i+1, err)
				}
			}
			if n := len(rc.Requests()); n != 1 {
				t.Errorf("%d requests, want 1", n)
			}
		})
	}
}

func TestBatch_StatusAppliesToWholeBatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		status int
		class  relay.ErrorClass
	}{
		{http.StatusServiceUnavailable, relay.Transient},
		{http.StatusUnauthorized, relay.SinkDown},
		{http.StatusUnprocessableEntity, relay.Permanent},
	} {
		t.Run(strconv.Itoa(tc.status), func(t *testing.T) {
			t.Parallel()
			rc := MustReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
				w.WriteHeader(tc.status)
				_, _ = w.Write([]byte(`{"results":[{"id":"evt-1","result":"ok"}]}`))
			})
			s := MustSink(t, webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: 3, MaxWait: time.Second}})
			for i, err := range sendAll(t, s, deliveries(3)) {
				if class, _ := relay.Classify(err); err == nil || class != tc.class {
					t.Errorf("event %d: %v, want %v for the whole batch", i+1, err, tc.class)
				}
			}
		})
	}
}

// TestBatch_SignatureCoversWholeBody: a Standard Webhooks receiver verifies
// the batch request as one message (id, timestamp, the whole array).
func TestBatch_SignatureCoversWholeBody(t *testing.T) {
	t.Parallel()
	secret := []byte("batch-signing-secret")
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: 4, MaxWait: time.Second},
		Auth: webhook.Auth{Type: webhook.AuthStandardWebhooks, Secret: "whsec_" + base64.StdEncoding.EncodeToString(secret)}})
	for i, err := range sendAll(t, s, deliveries(4)) {
		if err != nil {
			t.Fatalf("event %d: %v", i+1, err)
		}
	}
	reqs := rc.Requests()
	if len(reqs) != 1 || len(mustElems(t, reqs[0].Body)) != 4 {
		t.Fatalf("%d requests, want one batch of 4", len(reqs))
	}
	r := reqs[0]
	mac := hmac.New(sha256.New, secret)
	fmt.Fprintf(mac, "%s.%s.%s", r.Header.Get("Webhook-Id"), r.Header.Get("Webhook-Timestamp"), r.Body)
	if want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil)); r.Header.Get("Webhook-Signature") != want {
		t.Errorf("webhook-signature %q, want %q over the whole body", r.Header.Get("Webhook-Signature"), want)
	}
}

// TestBatch_MaxWaitFlushes: a lone event goes after max_wait, without
// waiting for max_events.
func TestBatch_MaxWaitFlushes(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	const wait = 100 * time.Millisecond
	s := MustSink(t, webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: 100, MaxWait: wait}})
	start := time.Now()
	if err := send(t, s, sinktest.NewDelivery(1)); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	if took < wait || took > wait+2*time.Second {
		t.Errorf("a lone event was delivered after %s, want just over max_wait %s", took, wait)
	}
	if reqs := rc.Requests(); len(reqs) != 1 || len(mustElems(t, reqs[0].Body)) != 1 {
		t.Errorf("%d requests, want one batch of 1", len(reqs))
	}
}

// TestBatch_MaxBodySplits: a batch never passes max_body; the events that
// would take it over go in the next request.
func TestBatch_MaxBodySplits(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	one := len(sinktest.NewDelivery(1).Body)
	s := MustSink(t, webhook.Config{URL: rc.URL, MaxBody: int64(3*one + 200), Batch: webhook.Batch{MaxEvents: 10, MaxWait: 200 * time.Millisecond}})
	for i, err := range sendAll(t, s, deliveries(10)) {
		if err != nil {
			t.Fatalf("event %d: %v", i+1, err)
		}
	}
	total := 0
	for _, r := range rc.Requests() {
		if int64(len(r.Body)) > int64(3*one+200) {
			t.Errorf("a request of %d bytes, over max_body", len(r.Body))
		}
		total += len(mustElems(t, r.Body))
	}
	if total != 10 || len(rc.Requests()) < 4 {
		t.Errorf("%d events in %d requests, want 10 in at least 4", total, len(rc.Requests()))
	}
}

// TestBatch_PartialRetryKeepsOrder runs the batching sink under the engine:
// the receiver answers retry to some events and fail to others, and no
// event may reach it before every earlier event of its aggregate was
// answered ok or fail; a retried event comes back with its id and body.
func TestBatch_PartialRetryKeepsOrder(t *testing.T) {
	t.Parallel()
	const n = 120
	var mu sync.Mutex
	settled := map[int]bool{} // answered ok or fail
	bodies := map[string]string{}
	var violations []string
	rc := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		var results []string
		var elems []batchElem
		if err := json.NewDecoder(r.Body).Decode(&elems); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		for _, e := range elems {
			num, _ := strconv.Atoi(strings.TrimPrefix(e.ID, "evt-"))
			if prev, ok := bodies[e.ID]; ok && prev != string(e.Event) {
				violations = append(violations, e.ID+" came back with another body")
			}
			bodies[e.ID] = string(e.Event)
			for earlier := num - 17; earlier > 0; earlier -= 17 {
				if !settled[earlier] {
					violations = append(violations, fmt.Sprintf("evt-%d arrived before evt-%d of its aggregate was settled", num, earlier))
				}
			}
			result := "ok"
			switch {
			case num%7 == 0:
				result = "fail"
			case num%5 == 0 && e.Attempt == 1:
				result = "retry"
			}
			if result != "retry" {
				settled[num] = true
			}
			results = append(results, fmt.Sprintf(`{"id":%q,"result":%q}`, e.ID, result))
		}
		_, _ = w.Write([]byte(`{"results":[` + strings.Join(results, ",") + `]}`))
	})
	s := MustSink(t, webhook.Config{URL: rc.URL, Concurrency: 4, Batch: webhook.Batch{MaxEvents: 8, MaxWait: 5 * time.Millisecond}})
	decisions := sinktest.StreamThroughEngine(t, s, n)

	mu.Lock()
	defer mu.Unlock()
	for _, v := range violations {
		t.Error(v)
	}
	batched := false
	for _, r := range rc.Requests() {
		batched = batched || len(mustElems(t, r.Body)) > 1
	}
	if !batched {
		t.Error("no request carried more than one event")
	}
	for i := 1; i <= n; i++ {
		want := relay.Done
		if i%7 == 0 {
			want = relay.DeadLetter
		}
		if got := decisions[int64(i)]; got != want {
			t.Errorf("evt-%d settled as %v, want %v", i, got, want)
		}
	}
}

func TestBatch_Config(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  webhook.Config
		want string
	}{
		{"cloudevents", webhook.Config{Format: webhook.FormatCloudEvents, CloudEventsSource: "/s", Batch: webhook.Batch{MaxEvents: 10}}, "batch.max_events"},
		{"negative", webhook.Config{Batch: webhook.Batch{MaxEvents: -1}}, "must not be negative"},
		{"reserved header", webhook.Config{Headers: map[string]string{"Outbox-Batch-Size": "1"}}, "set by the sink itself"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Name, tc.cfg.URL = "b", "http://127.0.0.1:1/"
			if _, err := webhook.New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New: %v, want an error naming %q", err, tc.want)
			}
		})
	}
}

// TestBatch_CloseSendsGatheredEvents: an event still waiting for its batch
// when Close is called is sent, and its done called, before Close returns;
// a Send after Close reports ErrClosed.
func TestBatch_CloseSendsGatheredEvents(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s, err := webhook.New(webhook.Config{Name: "b", URL: rc.URL, Batch: webhook.Batch{MaxEvents: 10, MaxWait: 300 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	outcome := make(chan error, 1)
	s.Send(context.Background(), sinktest.NewDelivery(1), func(err error) { outcome <- err })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	select {
	case err := <-outcome:
		if err != nil {
			t.Errorf("the gathered event: %v, want delivered", err)
		}
	default:
		t.Fatal("Close returned before the gathered event's done was called")
	}
	if n := len(rc.Requests()); n != 1 {
		t.Errorf("%d requests, want 1", n)
	}
	if err := send(t, s, sinktest.NewDelivery(2)); !errors.Is(err, webhook.ErrClosed) {
		t.Errorf("Send after Close: %v, want ErrClosed", err)
	}
}

// TestBatch_NoAnswerIsUnknownForEveryEvent: a batch written without an
// answer leaves each of its events Unknown, so on_unknown (retry or hold)
// decides for each one as it does without batching.
func TestBatch_NoAnswerIsUnknownForEveryEvent(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, func(http.ResponseWriter, *http.Request) { time.Sleep(time.Second) })
	s := MustSink(t, webhook.Config{URL: rc.URL, Timeout: 200 * time.Millisecond, Batch: webhook.Batch{MaxEvents: 3, MaxWait: time.Second}})
	for i, err := range sendAll(t, s, deliveries(3)) {
		if class, _ := relay.Classify(err); err == nil || class != relay.Unknown {
			t.Errorf("event %d: %v, want unknown", i+1, err)
		}
	}
}

// TestBatch_StoppedSenderIsNotPosted: an event gathered in a batch whose
// sender's context ends before the batch goes (the engine halted on a lost
// lock, docs/operations-health.md "a lost lock") is not posted: its done
// reports it not sent (transient, so the engine hands it to the claim path
// without counting an attempt), and the events of live senders in the same
// batch go.
func TestBatch_StoppedSenderIsNotPosted(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Batch: webhook.Batch{MaxEvents: 100, MaxWait: 300 * time.Millisecond}})
	halted, halt := context.WithCancel(context.Background())
	outcomes := make(chan error, 3)
	s.Send(halted, sinktest.NewDelivery(1), func(err error) { outcomes <- err })
	s.Send(halted, sinktest.NewDelivery(2), func(err error) { outcomes <- err })
	live := make(chan error, 1)
	s.Send(context.Background(), sinktest.NewDelivery(3), func(err error) { live <- err })
	time.Sleep(50 * time.Millisecond) // gathered, not posted
	halt()
	for range 2 {
		select {
		case err := <-outcomes:
			if class, _ := relay.Classify(err); class != relay.Transient {
				t.Errorf("an event of the stopped sender: %v (class %v), want a transient not-sent error", err, class)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no outcome for an event of the stopped sender")
		}
	}
	select {
	case err := <-live:
		if err != nil {
			t.Errorf("the live sender's event: %v, want delivered", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no outcome for the live sender's event")
	}
	reqs := rc.Requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want 1 (the live event's)", len(reqs))
	}
	if elems := mustElems(t, reqs[0].Body); len(elems) != 1 {
		t.Errorf("the batch carried %d events, want only the live sender's", len(elems))
	}
}
