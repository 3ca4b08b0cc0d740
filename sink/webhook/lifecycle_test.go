package webhook_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

func TestConcurrencyBound(t *testing.T) {
	t.Parallel()
	var current, peak atomic.Int32
	rc := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) {
		n := current.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		time.Sleep(40 * time.Millisecond)
		current.Add(-1)
	})
	s := MustSink(t, webhook.Config{URL: rc.URL, Concurrency: 3})

	const n = 15
	var wg sync.WaitGroup
	var calls atomic.Int32
	wg.Add(n)
	for i := range n {
		s.Send(context.Background(), newDelivery(fmt.Sprintf("k-%d", i), `{}`), func(err error) {
			if err != nil {
				t.Errorf("delivery %d: %v", i, err)
			}
			calls.Add(1)
			wg.Done()
		})
	}
	wg.Wait()
	if got := peak.Load(); got != 3 {
		t.Fatalf("receiver saw at most %d concurrent requests, want exactly 3", got)
	}
	if calls.Load() != n || len(rc.Requests()) != n {
		t.Fatalf("done called %d times, receiver saw %d requests, want %d", calls.Load(), len(rc.Requests()), n)
	}
}

func TestSendBlocksWhileFullUntilContextDone(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	rc := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) { <-release })
	s := MustSink(t, webhook.Config{URL: rc.URL, Concurrency: 1})

	first := make(chan error, 1)
	s.Send(context.Background(), newDelivery("first", `{}`), func(err error) { first <- err })

	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := sendCtx(t, ctx, s, newDelivery("second", `{}`))
	if took := time.Since(start); took < 100*time.Millisecond {
		t.Errorf("Send returned after %v, want it to block until the context's deadline", took)
	}
	if class, _ := relay.Classify(err); class != relay.Transient || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %s %v, want transient wrapping the deadline", class, err)
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatalf("first: %v", err)
	}
	if n := len(rc.Requests()); n != 1 {
		t.Fatalf("receiver saw %d requests, want 1", n)
	}
}

func TestCloseWaitsForInFlight(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	rc := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) { <-release })
	s := MustSink(t, webhook.Config{URL: rc.URL, Concurrency: 4})

	const n = 4
	var calls [n]atomic.Int32
	var errs [n]atomic.Value
	for i := range n {
		s.Send(context.Background(), newDelivery(fmt.Sprintf("k-%d", i), `{}`), func(err error) {
			if err != nil {
				errs[i].Store(err)
			}
			calls[i].Add(1)
		})
	}
	for deadline := time.Now().Add(5 * time.Second); len(rc.Requests()) < n; {
		if time.Now().After(deadline) {
			t.Fatalf("receiver saw %d requests, want %d", len(rc.Requests()), n)
		}
		time.Sleep(5 * time.Millisecond)
	}

	closed := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		closed <- s.Close(ctx)
	}()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) with requests in flight", err)
	case <-time.After(150 * time.Millisecond):
	}

	// A Send after Close reports ErrClosed at once, although every slot is
	// taken.
	err := send(t, s, newDelivery("late", `{}`))
	if class, _ := relay.Classify(err); class != relay.SinkDown || !errors.Is(err, webhook.ErrClosed) {
		t.Fatalf("Send after Close: %s %v, want sink-down wrapping ErrClosed", class, err)
	}

	close(release)
	if err := <-closed; err != nil {
		t.Fatalf("Close: %v", err)
	}
	for i := range n {
		if c := calls[i].Load(); c != 1 {
			t.Errorf("delivery %d: done called %d times before Close returned, want 1", i, c)
		}
		if err, _ := errs[i].Load().(error); err != nil {
			t.Errorf("delivery %d: %v", i, err)
		}
	}
	time.Sleep(50 * time.Millisecond)
	for i := range n {
		if c := calls[i].Load(); c != 1 {
			t.Errorf("delivery %d: done called %d times, want 1", i, c)
		}
	}
	if got := len(rc.Requests()); got != n {
		t.Errorf("receiver saw %d requests, want %d", got, n)
	}
	if err := s.Close(context.Background()); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestCloseDeadlineAbortsInFlight(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	rc := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	s := MustSink(t, webhook.Config{URL: rc.URL, Timeout: time.Minute})

	const n = 3
	results := make(chan error, 2*n)
	for i := range n {
		s.Send(context.Background(), newDelivery(fmt.Sprintf("k-%d", i), `{}`), func(err error) { results <- err })
	}
	for deadline := time.Now().Add(5 * time.Second); len(rc.Requests()) < n; {
		if time.Now().After(deadline) {
			t.Fatalf("receiver saw %d requests, want %d", len(rc.Requests()), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	err := s.Close(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "in flight") {
		t.Fatalf("Close: %v, want the deadline with requests in flight", err)
	}
	if got := len(results); got != n {
		t.Fatalf("%d done calls when Close returned, want %d", got, n)
	}
	for range n {
		if class, _ := relay.Classify(<-results); class != relay.Unknown {
			t.Errorf("aborted written request: class %s, want unknown", class)
		}
	}
}
