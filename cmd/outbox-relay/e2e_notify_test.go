package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// notifyTarget is a dead-letter notification receiver (format json): it
// records the notifications it accepted and the time of every request, and
// answers 503 while down.
type notifyTarget struct {
	*httptest.Server
	mu       sync.Mutex
	down     bool
	attempts []time.Time
	accepted []notifyBody
}

// notifyBody is what the test reads of a notification.
type notifyBody struct {
	Sink   string `json:"sink"`
	Count  int    `json:"count"`
	Failed int    `json:"failed"`
	Events []struct {
		EventKey string `json:"event_key"`
	} `json:"events"`
	LastError   string `json:"last_error"`
	ListCommand string `json:"list_command"`
	ConsoleURL  string `json:"console_url"`
}

func newNotifyTarget(t *testing.T) *notifyTarget {
	n := &notifyTarget{}
	n.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		n.mu.Lock()
		defer n.mu.Unlock()
		n.attempts = append(n.attempts, time.Now())
		if n.down {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		var b notifyBody
		if err := json.Unmarshal(body, &b); err != nil {
			t.Errorf("notification %s: %v", body, err)
		}
		n.accepted = append(n.accepted, b)
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(n.Close)
	return n
}

func (n *notifyTarget) setDown(down bool) {
	n.mu.Lock()
	n.down = down
	n.mu.Unlock()
}

// attemptedAfter reports whether a request arrived after t.
func (n *notifyTarget) attemptedAfter(t time.Time) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.attempts) > 0 && n.attempts[len(n.attempts)-1].After(t)
}

// of returns the notifications of sink accepted so far.
func (n *notifyTarget) of(sink string) []notifyBody {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []notifyBody
	for _, b := range n.accepted {
		if b.Sink == sink {
			out = append(out, b)
		}
	}
	return out
}

// TestRelay_NotifyTargetDownDoesNotBlockDelivery: while the notification
// target is down, events keep reaching both sinks and the ones the webhook
// refuses are dead-lettered; the notifier keeps trying, and once the target
// is back its first notification counts every dead letter of the outage
// (docs/operations.md, "Dead-letter notifications").
func TestRelay_NotifyTargetDownDoesNotBlockDelivery(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.hook.setReply(func(d delivery) int {
		if strings.HasPrefix(d.EventKey, "bad-") {
			return http.StatusBadRequest // permanent: a dead letter
		}
		return http.StatusNoContent
	})
	target := newNotifyTarget(t)
	target.setDown(true)
	s.startInProcess(t, s.configFileWith(t, "", fmt.Sprintf(`notify:
  url: %q
  format: json
  interval: 300ms
  timeout: 200ms
  console_url: http://127.0.0.1:9187/console/
`, target.URL)))
	s.waitSlot(t)
	eventually(t, 10*time.Second, "the notifier's marks (its first pass)", func() bool {
		return s.scalar(t, `SELECT count(*) FROM integration_outbox_relay_notify`) == 3 // hook, nats, *
	})

	s.publishWriters(t, 2, 100, 10, "good")
	s.publishWriters(t, 1, 20, 20, "bad")
	eventually(t, 30*time.Second, "every good event at the webhook and every bad one dead-lettered, with the target down", func() bool {
		good := 0
		for k := range byKey(s.hook.deliveries()) {
			if strings.HasPrefix(k, "good-") {
				good++
			}
		}
		return good == 200 && s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE event_key LIKE 'bad-%' AND status = 'failed'`) == 20
	})
	eventually(t, 20*time.Second, "NATS to get every event", func() bool { return len(streamMessages(t, s.nats.URL())) == 220 })
	settled := time.Now()
	eventually(t, 10*time.Second, "a notification attempt after the last dead letter", func() bool { return target.attemptedAfter(settled) })
	if got := target.of("hook"); len(got) != 0 {
		t.Fatalf("notifications accepted while the target was down: %+v", got)
	}

	target.setDown(false)
	eventually(t, 10*time.Second, "the notification once the target is back", func() bool { return len(target.of("hook")) > 0 })
	got := target.of("hook")[0]
	if got.Count != 20 || got.Failed != 20 || len(got.Events) != 5 || got.ListCommand != "outbox-relay dlq list --sink hook" ||
		got.ConsoleURL != "http://127.0.0.1:9187/console/" || !strings.Contains(got.LastError, "sink hook: ") || !strings.Contains(got.LastError, "400") {
		t.Fatalf("notification %+v, want the outage's 20 dead letters of sink hook", got)
	}
	for _, e := range got.Events {
		if !strings.HasPrefix(e.EventKey, "bad-") {
			t.Errorf("notification names %s, not a dead letter", e.EventKey)
		}
	}
	if n := target.of("nats"); len(n) != 0 {
		t.Errorf("notifications of nats, which has no dead letter: %+v", n)
	}
}
