package webhook_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// TestURLByField: a url's CEL actions are rendered per event, path-escaped
// (docs/sinks.md, "Routing by field"); one that fails on an event, or a URL
// past MaxURLBytes, fails that event permanently, naming the expression,
// and sends nothing.
func TestURLByField(t *testing.T) {
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.RequestURI)
		mu.Unlock()
	}))
	t.Cleanup(srv.Close)
	s := MustSink(t, webhook.Config{URL: srv.URL + "/hooks/{{ payload.region }}?type={{ event_type }}"})
	for _, tc := range []struct {
		name, payload, want, err string
	}{
		{"plain", `{"region": "eu"}`, "/hooks/eu?type=order.placed", ""},
		{"escaped", `{"region": "eu west/1?#"}`, "/hooks/eu%20west%2F1%3F%23?type=order.placed", ""},
		{"missing field", `{"zone": "eu"}`, "", "{{ payload.region }}: no such key: region"},
		{"too long", `{"region": "` + strings.Repeat("e", webhook.MaxURLBytes) + `"}`, "", "more than 2048"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			got = nil
			mu.Unlock()
			d := newDelivery("k-"+tc.name, `{}`)
			d.Event.Payload = []byte(tc.payload)
			err := send(t, s, d)
			mu.Lock()
			defer mu.Unlock()
			if tc.err != "" {
				if class, _ := relay.Classify(err); err == nil || class != relay.Permanent || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("send: %v, want a permanent error with %q", err, tc.err)
				}
				if len(got) != 0 {
					t.Fatalf("sent %v, want nothing", got)
				}
				return
			}
			if err != nil || len(got) != 1 || got[0] != tc.want {
				t.Fatalf("send: %v, requests %v; want one to %s", err, got, tc.want)
			}
		})
	}
}

func TestURLByFieldErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  webhook.Config
		want string
	}{
		{"in the host", webhook.Config{URL: "http://{{ payload.host }}/x"}, "scheme and host"},
		{"right after the host", webhook.Config{URL: "http://h.example{{ payload.port }}"}, "only after the host"},
		{"compile", webhook.Config{URL: "http://h.example/{{ payload.region + }}"}, "Syntax error"},
		{"not CEL", webhook.Config{URL: "http://h.example/{{.EventType}}"}, "CEL expression"},
		{"unclosed", webhook.Config{URL: "http://h.example/{{ payload.region"}, "without its }}"},
		{"batch", webhook.Config{URL: "http://h.example/{{ payload.region }}", Batch: webhook.Batch{MaxEvents: 10}}, "cannot batch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Name = "t"
			_, err := webhook.New(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New: %v, want an error with %q", err, tc.want)
			}
		})
	}
}
