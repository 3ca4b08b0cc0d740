package webhook_test

import (
	"context"
	"encoding/json"
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

var _ relay.RunSink = (*webhook.Sink)(nil)

// runOf returns deliveries of events ids, all of one aggregate.
func runOf(ids ...int) []*relay.Delivery {
	ds := make([]*relay.Delivery, len(ids))
	for i, id := range ids {
		ds[i] = sinktest.NewDelivery(id)
	}
	return ds
}

// TestBatch_MaxRunNeedsOrdered: a sink takes runs (MaxRun above 1) only with
// batch.ordered, the operator's declaration that the receiver keeps the
// contract; then a run is up to max_events long. Ordered without batching
// is refused.
func TestBatch_MaxRunNeedsOrdered(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		batch webhook.Batch
		want  int
	}{
		{"not batched", webhook.Batch{}, 1},
		{"batched", webhook.Batch{MaxEvents: 50}, 1},
		{"batched, ordered", webhook.Batch{MaxEvents: 50, Ordered: true}, 50},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := MustSink(t, webhook.Config{URL: "http://127.0.0.1:1/", Batch: tc.batch})
			if got := s.MaxRun(); got != tc.want {
				t.Errorf("MaxRun = %d, want %d", got, tc.want)
			}
		})
	}
	_, err := webhook.New(webhook.Config{Name: "b", URL: "http://127.0.0.1:1/", Batch: webhook.Batch{Ordered: true}})
	if err == nil || !strings.Contains(err.Error(), "batch.ordered") {
		t.Errorf("New with ordered and no max_events: %v, want an error naming batch.ordered", err)
	}
}

// TestBatch_FitRunCutsWhereOneRequestEnds: a run is never split across two
// requests, so FitRun ends it before the first event that would take the
// body over max_body, or that cannot be sent at all; a run whose first
// event cannot be sent is that event alone (its send dead-letters it).
func TestBatch_FitRunCutsWhereOneRequestEnds(t *testing.T) {
	t.Parallel()
	one := len(sinktest.NewDelivery(1).Body)
	wide := MustSink(t, webhook.Config{URL: "http://127.0.0.1:1/", Batch: webhook.Batch{MaxEvents: 4, Ordered: true}})
	narrow := MustSink(t, webhook.Config{URL: "http://127.0.0.1:1/", MaxBody: int64(3*one + 200),
		Batch: webhook.Batch{MaxEvents: 10, Ordered: true}})
	emptyKey := sinktest.NewDelivery(3)
	emptyKey.Event.EventKey = ""
	huge := sinktest.NewDelivery(1)
	huge.Body = []byte(`{"pad":"` + strings.Repeat("x", 4*one) + `"}`)
	for _, tc := range []struct {
		name string
		s    *webhook.Sink
		ds   []*relay.Delivery
		want int
	}{
		{"fits", wide, runOf(1, 2, 3), 3},
		{"over max_events", wide, runOf(1, 2, 3, 4, 5), 4},
		{"over max_body", narrow, runOf(1, 2, 3, 4), 3},
		{"an event that cannot be sent", wide, []*relay.Delivery{sinktest.NewDelivery(1), sinktest.NewDelivery(2), emptyKey}, 2},
		{"first event over max_body", narrow, []*relay.Delivery{huge, sinktest.NewDelivery(2)}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.s.FitRun(tc.ds, 1); got != tc.want {
				t.Errorf("FitRun = %d, want %d", got, tc.want)
			}
		})
	}
}

// TestBatch_FitRunSharesTheRequests: a run takes at most its share of a
// request when the aggregates the lane holds are spread evenly over the
// requests in flight: over 50 aggregates, 4 requests of 100 carry runs of 7
// (13 aggregates each) rather than two aggregates' runs of 40 each.
func TestBatch_FitRunSharesTheRequests(t *testing.T) {
	t.Parallel()
	s := MustSink(t, webhook.Config{URL: "http://127.0.0.1:1/", Concurrency: 4, Batch: webhook.Batch{MaxEvents: 100, Ordered: true}})
	ids := make([]int, 40)
	for i := range ids {
		ids[i] = i + 1
	}
	run := runOf(ids...)
	for _, tc := range []struct{ aggregates, want int }{{1, 40}, {4, 40}, {10, 33}, {50, 7}, {400, 1}, {1000, 1}} {
		if got := s.FitRun(run, tc.aggregates); got != tc.want {
			t.Errorf("FitRun(40 events, %d aggregates) = %d, want %d", tc.aggregates, got, tc.want)
		}
	}
}

// TestBatch_RunStaysWholeInOneRequest: a run goes in one request, its events
// side by side in its order; a run that does not fit in the batch being
// gathered starts the next one.
func TestBatch_RunStaysWholeInOneRequest(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Concurrency: 1, Batch: webhook.Batch{MaxEvents: 5, MaxWait: time.Second, Ordered: true}})
	// Send queues each event before it returns: the run comes after them.
	singles := sendAllAsync(s, runOf(1, 2, 3))
	run := runOf(4, 5, 6, 7)
	runDone := make(chan []error, 1)
	s.SendRun(context.Background(), run, func(errs []error) { runDone <- errs })
	for i, err := range singles() {
		if err != nil {
			t.Errorf("event %d: %v", i+1, err)
		}
	}
	select {
	case errs := <-runDone:
		if len(errs) != len(run) {
			t.Fatalf("%d outcomes for a run of %d", len(errs), len(run))
		}
		for i, err := range errs {
			if err != nil {
				t.Errorf("run event %d: %v", i+1, err)
			}
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the run's done was not called")
	}
	var got [][]string
	for _, r := range rc.Requests() {
		var ids []string
		for _, e := range mustElems(t, r.Body) {
			ids = append(ids, e.ID)
		}
		got = append(got, ids)
	}
	want := fmt.Sprint([][]string{{"evt-1", "evt-2", "evt-3"}, {"evt-4", "evt-5", "evt-6", "evt-7"}})
	if fmt.Sprint(got) != want {
		t.Errorf("requests %v, want %v: the run whole, in its order, in a request of its own", got, want)
	}
}

// sendAllAsync sends ds concurrently and returns a function that waits for
// their outcomes, in ds's order.
func sendAllAsync(s relay.Sink, ds []*relay.Delivery) func() []error {
	errs := make([]error, len(ds))
	var wg sync.WaitGroup
	for i, d := range ds {
		wg.Add(1)
		s.Send(context.Background(), d, func(err error) { errs[i] = err; wg.Done() })
	}
	return func() []error { wg.Wait(); return errs }
}

// TestBatch_OrderedRunsKeepOrder runs an ordered batching sink under the
// engine, against a receiver that keeps the contract: it applies a
// request's events in order and, per aggregate, none after the first it
// does not apply (retry or fail), answering those retry. Some events are
// answered retry at their first attempt, others fail. Every event must be
// applied after the earlier events of its aggregate were applied or
// failed, requests must carry several events of one aggregate, and each
// event must end delivered or dead-lettered.
func TestBatch_OrderedRunsKeepOrder(t *testing.T) {
	t.Parallel()
	const n = 240
	var mu sync.Mutex
	settled := map[int]bool{} // applied or failed
	retried := map[int]bool{} // answered retry for itself once
	var violations []string
	runs := 0
	rc := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		var elems []batchElem
		if err := json.NewDecoder(r.Body).Decode(&elems); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		stopped := map[int]bool{}
		seen := map[int]int{}
		var results []string
		for _, e := range elems {
			num, _ := strconv.Atoi(strings.TrimPrefix(e.ID, "evt-"))
			agg := num % 17
			if seen[agg]++; seen[agg] == 2 {
				runs++
			}
			if stopped[agg] {
				results = append(results, fmt.Sprintf(`{"id":%q,"result":"retry","message":"not applied: an earlier event of its aggregate was not"}`, e.ID))
				continue
			}
			for earlier := num - 17; earlier > 0; earlier -= 17 {
				if !settled[earlier] {
					violations = append(violations, fmt.Sprintf("evt-%d applied before evt-%d of its aggregate", num, earlier))
				}
			}
			result := "ok"
			switch {
			case num%11 == 0:
				result = "fail"
			case num%5 == 0 && !retried[num]:
				result = "retry"
				retried[num] = true
			}
			if result == "retry" {
				stopped[agg] = true
			} else {
				settled[num] = true
				if result == "fail" {
					stopped[agg] = true
				}
			}
			results = append(results, fmt.Sprintf(`{"id":%q,"result":%q}`, e.ID, result))
		}
		_, _ = w.Write([]byte(`{"results":[` + strings.Join(results, ",") + `]}`))
	})
	s := MustSink(t, webhook.Config{URL: rc.URL, Concurrency: 2, Batch: webhook.Batch{MaxEvents: 20, MaxWait: 5 * time.Millisecond, Ordered: true}})
	decisions := sinktest.StreamThroughEngine(t, s, n)

	mu.Lock()
	defer mu.Unlock()
	for _, v := range violations {
		t.Error(v)
	}
	if runs == 0 {
		t.Error("no request carried two events of one aggregate")
	}
	for i := 1; i <= n; i++ {
		want := relay.Done
		if i%11 == 0 {
			want = relay.DeadLetter
		}
		if got := decisions[int64(i)]; got != want {
			t.Errorf("evt-%d settled as %v, want %v", i, got, want)
		}
	}
}
