package webhook_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// request is one request as a test receiver saw it.
type request struct {
	Header http.Header
	Body   []byte
}

// receiver is an httptest server that records every request it reads and
// answers with respond (200 when nil).
type receiver struct {
	*httptest.Server
	mu       sync.Mutex
	requests []request
}

// MustReceiver starts a recording receiver, closed with t.Cleanup.
func MustReceiver(tb testing.TB, respond http.HandlerFunc) *receiver {
	tb.Helper()
	rc := &receiver{}
	rc.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		rc.mu.Lock()
		rc.requests = append(rc.requests, request{Header: r.Header.Clone(), Body: body})
		rc.mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(body)) // respond may read it again
		if respond != nil {
			respond(w, r)
		}
	}))
	tb.Cleanup(rc.Close)
	return rc
}

// Requests returns a copy of the requests read so far.
func (rc *receiver) Requests() []request {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return append([]request(nil), rc.requests...)
}

// MustSink builds a sink for cfg (Name defaults to "test"), closed with
// t.Cleanup.
func MustSink(tb testing.TB, cfg webhook.Config) *webhook.Sink {
	tb.Helper()
	if cfg.Name == "" {
		cfg.Name = "test"
	}
	s, err := webhook.New(cfg)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = s.Close(ctx)
	})
	return s
}

// newDelivery returns a first-attempt delivery of an event with key and
// body.
func newDelivery(key, body string) *relay.Delivery {
	typ := "order.placed"
	return &relay.Delivery{
		Event:   &relay.Event{ID: 1, EventKey: key, EventType: &typ, CreatedAt: time.Now()},
		Body:    []byte(body),
		Attempt: 1,
	}
}

// send delivers d synchronously, failing the test unless done is called
// exactly once.
func send(tb testing.TB, s relay.Sink, d *relay.Delivery) error {
	tb.Helper()
	return sendCtx(tb, context.Background(), s, d)
}

func sendCtx(tb testing.TB, ctx context.Context, s relay.Sink, d *relay.Delivery) error {
	tb.Helper()
	errs := make(chan error, 2)
	s.Send(ctx, d, func(err error) { errs <- err })
	select {
	case err := <-errs:
		select {
		case <-errs:
			tb.Fatalf("done called twice for %s", d.Event.EventKey)
		case <-time.After(20 * time.Millisecond):
		}
		return err
	case <-time.After(20 * time.Second):
		tb.Fatalf("done not called for %s", d.Event.EventKey)
		return nil
	}
}
