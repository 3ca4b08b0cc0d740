package webhook_test

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// TestDown_FollowsTheLastAnswer: the sink reports itself down (for /readyz,
// docs/sinks.md, "A server down at start") once a request finds the
// receiver down — a 404 of an n8n workflow not published, a 401, no
// connection — naming why, and up again at the next answer that is not.
// A failure of the event's own (a 400, a 500) does not make it down.
func TestDown_FollowsTheLastAnswer(t *testing.T) {
	var status atomic.Int32
	status.Store(404)
	rc := MustReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
		st := int(status.Load())
		w.WriteHeader(st)
		if st == 404 {
			_, _ = w.Write([]byte(n8nNotRegistered))
		}
	})
	s := MustSink(t, webhook.Config{URL: rc.URL, Concurrency: 1})
	if err := s.Down(); err != nil {
		t.Fatalf("Down before any request = %v, want nil (nothing known yet)", err)
	}
	_ = send(t, s, newDelivery("k-1", `{}`))
	err := s.Down()
	if err == nil || !strings.Contains(err.Error(), "not registered") {
		t.Fatalf("Down after a 404 of n8n = %v, want the sink-down reason naming it", err)
	}
	status.Store(500)
	_ = send(t, s, newDelivery("k-2", `{}`))
	if err := s.Down(); err != nil {
		t.Fatalf("Down after a 500 = %v, want nil: the receiver answered, the failure is the event's", err)
	}
	status.Store(401)
	_ = send(t, s, newDelivery("k-3", `{}`))
	if err := s.Down(); err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("Down after a 401 = %v, want it down naming the 401", err)
	}
	status.Store(204)
	if err := send(t, s, newDelivery("k-4", `{}`)); err != nil {
		t.Fatalf("send: %v", err)
	}
	if err := s.Down(); err != nil {
		t.Fatalf("Down after a 204 = %v, want nil", err)
	}
	rc.Close()
	// The first request may go out on the connection the receiver just
	// closed (an outcome in doubt, which says nothing); the next dials.
	for i := 0; i < 3 && s.Down() == nil; i++ {
		_ = send(t, s, newDelivery("k-5", `{}`))
	}
	if err := s.Down(); err == nil || !strings.Contains(err.Error(), "cannot connect") {
		t.Fatalf("Down with the receiver gone = %v, want it down naming the connection", err)
	}
}
