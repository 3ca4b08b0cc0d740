package nats_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/relay"
)

// resender drives a sink as the engine does for these tests: it sends
// events through the shared Send API, and re-sends each one that failed
// (whatever its class) with the same event key, so the same Nats-Msg-Id,
// until it is delivered. It counts outcomes and repeats.
type resender struct {
	s       relay.Sink
	backoff time.Duration

	todo      chan int
	delivered atomic.Int64
	resends   atomic.Int64
	attempts  []atomic.Int32

	mu       sync.Mutex
	outcomes map[string]int // "delivered" or a failure class → count
	firstErr map[string]string
	// events records when each outcome class happened, for recovery times.
	events []outcomeEvent

	allDone chan struct{}
	once    sync.Once
}

type outcomeEvent struct {
	at    time.Time
	class string
}

// newResender starts the goroutine that feeds s; Add queues events.
func newResender(tb testing.TB, s relay.Sink, n int, backoff time.Duration) *resender {
	r := &resender{
		s: s, backoff: backoff,
		todo:     make(chan int, n+1),
		attempts: make([]atomic.Int32, n),
		outcomes: map[string]int{},
		firstErr: map[string]string{},
		allDone:  make(chan struct{}),
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-ctx.Done():
				return
			case i := <-r.todo:
				r.send(ctx, i)
			}
		}
	}()
	tb.Cleanup(func() { cancel(); <-stopped })
	return r
}

// Add queues event i (0 ≤ i < n) for its first send.
func (r *resender) Add(i int) { r.todo <- i }

func (r *resender) send(ctx context.Context, i int) {
	attempt := r.attempts[i].Add(1)
	d := delivery(i)
	d.Attempt = int(attempt)
	r.s.Send(ctx, d, func(err error) {
		name := "delivered"
		if err != nil {
			name = class(err).String()
		}
		r.mu.Lock()
		r.outcomes[name]++
		if err != nil && r.firstErr[name] == "" {
			r.firstErr[name] = err.Error()
		}
		r.events = append(r.events, outcomeEvent{at: time.Now(), class: name})
		r.mu.Unlock()
		if err == nil {
			if r.delivered.Add(1) == int64(len(r.attempts)) {
				r.once.Do(func() { close(r.allDone) })
			}
			return
		}
		if ctx.Err() != nil {
			return
		}
		r.resends.Add(1)
		// done must not block: re-queue from another goroutine.
		go func() {
			time.Sleep(r.backoff)
			select {
			case r.todo <- i:
			case <-ctx.Done():
			}
		}()
	})
}

// Wait waits until every one of the n events was delivered, failing tb at
// the timeout.
func (r *resender) Wait(tb testing.TB, timeout time.Duration) {
	tb.Helper()
	select {
	case <-r.allDone:
	case <-time.After(timeout):
		tb.Fatalf("only %d of %d events delivered after %s; outcomes %s", r.delivered.Load(), len(r.attempts), timeout, r.Summary())
	}
}

// Summary renders the outcome counts and the first error of each class.
func (r *resender) Summary() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(r.outcomes)) {
		fmt.Fprintf(&b, "%s=%d ", name, r.outcomes[name])
	}
	fmt.Fprintf(&b, "resends=%d", r.resends.Load())
	for _, name := range slices.Sorted(maps.Keys(r.firstErr)) {
		fmt.Fprintf(&b, "\n  first %s: %s", name, r.firstErr[name])
	}
	return b.String()
}

// Outcomes returns a copy of the outcome counts.
func (r *resender) Outcomes() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.outcomes)
}

// Recovery returns how long after since the last failure was reported
// (the fault's visible span), or 0 when none was after since.
func (r *resender) Recovery(since time.Time) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	var last time.Time
	for _, e := range r.events {
		if e.class != "delivered" && e.at.After(since) && e.at.After(last) {
			last = e.at
		}
	}
	if last.IsZero() {
		return 0
	}
	return last.Sub(since)
}

// verifyExactlyOnce reads the stream and fails tb unless it holds each of
// evt-0 … evt-(n-1) exactly once and nothing else.
func verifyExactlyOnce(tb testing.TB, js jetstream.JetStream, stream string, n int) {
	tb.Helper()
	seen := make([]int, n)
	for _, m := range stored(tb, js, stream) {
		id := m.Headers().Get(jetstream.MsgIDHeader)
		i, err := strconv.Atoi(strings.TrimPrefix(id, scopedID("evt-")))
		if err != nil || i < 0 || i >= n {
			tb.Fatalf("unexpected message %q in the stream", id)
		}
		seen[i]++
	}
	var lost, twice []int
	for i, c := range seen {
		switch {
		case c == 0:
			lost = append(lost, i)
		case c > 1:
			twice = append(twice, i)
		}
	}
	if len(lost) > 0 || len(twice) > 0 {
		tb.Fatalf("stream %s: %d of %d events lost (first %v), %d stored more than once (first %v)",
			stream, len(lost), n, lost[:min(len(lost), 10)], len(twice), twice[:min(len(twice), 10)])
	}
}
