package webhook_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

const n8nNotRegistered = `{"code":404,"message":"The requested webhook \"POST outbox\" is not registered.",` +
	`"hint":"The workflow must be active for a production URL to run successfully."}`

func TestOutcomes(t *testing.T) {
	t.Parallel()
	inTwoMinutes := time.Now().Add(2 * time.Minute).UTC().Format(http.TimeFormat)
	tests := []struct {
		name       string
		status     int
		header     map[string]string
		body       string
		cfg        webhook.Config
		delivered  bool
		class      relay.ErrorClass
		retryAfter [2]time.Duration // inclusive range
		contains   []string
		excludes   []string
	}{
		{name: "200", status: 200, delivered: true},
		{name: "204", status: 204, delivered: true},
		{name: "202 with body", status: 202, body: strings.Repeat("ok", 100_000), delivered: true},

		{name: "408 Retry-After seconds", status: 408, header: map[string]string{"Retry-After": "7"},
			class: relay.Transient, retryAfter: [2]time.Duration{7 * time.Second, 7 * time.Second}, contains: []string{"408"}},
		{name: "429 Retry-After HTTP-date", status: 429, header: map[string]string{"Retry-After": inTwoMinutes},
			class: relay.Transient, retryAfter: [2]time.Duration{115 * time.Second, 120 * time.Second}, contains: []string{"429 Too Many Requests"}},
		{name: "429 Retry-After capped at 1h", status: 429, header: map[string]string{"Retry-After": "86400"},
			class: relay.Transient, retryAfter: [2]time.Duration{time.Hour, time.Hour}},
		{name: "429 Retry-After huge", status: 429, header: map[string]string{"Retry-After": "99999999999999999999999"},
			class: relay.Transient, retryAfter: [2]time.Duration{time.Hour, time.Hour}},
		{name: "429 Retry-After past date", status: 429, header: map[string]string{"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"},
			class: relay.Transient},
		{name: "429 Retry-After garbage", status: 429, header: map[string]string{"Retry-After": "soon"},
			class: relay.Transient},
		{name: "425", status: 425, class: relay.Transient},
		{name: "500", status: 500, body: "boom", class: relay.Transient, contains: []string{"500 Internal Server Error", "boom"}},
		{name: "503 Retry-After", status: 503, header: map[string]string{"Retry-After": "30"},
			class: relay.Transient, retryAfter: [2]time.Duration{30 * time.Second, 30 * time.Second}},
		{name: "409 still processing", status: 409, class: relay.Transient, contains: []string{"409"}},
		{name: "409 means delivered", status: 409, cfg: webhook.Config{Treat409AsDelivered: true}, delivered: true},
		{name: "302 not followed", status: 302, header: map[string]string{"Location": "/elsewhere"},
			class: relay.Transient, contains: []string{"302", "redirects are not followed"}},

		{name: "401", status: 401, class: relay.SinkDown, contains: []string{"401", "credentials"}},
		{name: "403", status: 403, class: relay.SinkDown, contains: []string{"403", "credentials"}},
		{name: "404 n8n workflow not registered", status: 404, body: n8nNotRegistered,
			class: relay.SinkDown, contains: []string{"not registered", "publish (activate) the n8n workflow"}},

		{name: "400", status: 400, body: `{"error":"bad"}`, class: relay.Permanent, contains: []string{"400 Bad Request", `{"error":"bad"}`, `"k-1"`}},
		{name: "413", status: 413, body: "too big", class: relay.Permanent, contains: []string{"413", "too big"}},
		{name: "415", status: 415, body: "json only", class: relay.Permanent, contains: []string{"415", "json only"}},
		{name: "422 multi-line body on one line", status: 422, body: "line one\r\nline two\tand\x00three\n\n",
			class: relay.Permanent, contains: []string{"422 Unprocessable Entity", "line one line two and three"},
			excludes: []string{"\n", "\r", "\t", "\x00"}},
		{name: "422 long body cut at 512 bytes", status: 422, body: strings.Repeat("x", 2000),
			class: relay.Permanent, contains: []string{strings.Repeat("x", 512) + " …"}, excludes: []string{strings.Repeat("x", 513)}},
		{name: "422 empty body", status: 422, class: relay.Permanent, contains: []string{"(empty body)"}},
		{name: "422 control characters only", status: 422, body: "\x00\x1b\r\n", class: relay.Permanent, contains: []string{"(empty body)"}},
		{name: "422 invalid UTF-8", status: 422, body: "bad \xff byte", class: relay.Permanent, contains: []string{"bad \uFFFD byte"}},
		{name: "404 while n8n registers its webhooks", status: 404, body: "<pre>Cannot POST /webhook/outbox</pre>", class: relay.SinkDown,
			contains: []string{"404", "Cannot POST", "check the sink's url"}},
		{name: "200 while n8n starts up", status: 200, body: "n8n is starting up. Please wait", class: relay.Transient,
			retryAfter: [2]time.Duration{time.Second, time.Second}, contains: []string{"still starting"}},
		{name: "200 with another body", status: 200, body: "n8n is starting up. Please wait for nothing: ok", delivered: true},
		{name: "405", status: 405, class: relay.Permanent},
		{name: "configured permanent 503", status: 503, cfg: webhook.Config{PermanentStatuses: []int{503}},
			class: relay.Permanent, contains: []string{"503"}},
		{name: "400 outside a custom list is still permanent", status: 400, cfg: webhook.Config{PermanentStatuses: []int{503}},
			class: relay.Permanent},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			rc := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) {
				for k, v := range tt.header {
					w.Header().Set(k, v)
				}
				w.WriteHeader(tt.status)
				_, _ = w.Write([]byte(tt.body))
			})
			cfg := tt.cfg
			cfg.URL = rc.URL
			s := MustSink(t, cfg)
			err := send(t, s, newDelivery("k-1", `{"n":1}`))
			if got := len(rc.Requests()); got != 1 {
				t.Fatalf("receiver saw %d requests, want 1", got)
			}
			if tt.delivered {
				if err != nil {
					t.Fatalf("got %v, want delivered", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("got delivered, want %s", tt.class)
			}
			class, retryAfter := relay.Classify(err)
			if class != tt.class {
				t.Fatalf("class %s, want %s (%v)", class, tt.class, err)
			}
			if retryAfter < tt.retryAfter[0] || retryAfter > tt.retryAfter[1] {
				t.Errorf("RetryAfter %v, want %v..%v", retryAfter, tt.retryAfter[0], tt.retryAfter[1])
			}
			// The status the relay logs: the receiver's, unless it answered
			// 2xx (n8n starting up), which is no status of a failure.
			wantStatus := tt.status
			if tt.status < 300 {
				wantStatus = 0
			}
			var de *relay.DeliveryError
			if !errors.As(err, &de) || de.Status != wantStatus {
				t.Errorf("error %v: its Status is not %d", err, wantStatus)
			}
			msg := err.Error()
			for _, want := range tt.contains {
				if !strings.Contains(msg, want) {
					t.Errorf("error %q does not contain %q", msg, want)
				}
			}
			for _, bad := range tt.excludes {
				if strings.Contains(msg, bad) {
					t.Errorf("error %q contains %q", msg, bad)
				}
			}
		})
	}
}

// A receiver that cannot be reached fails every event alike: SinkDown, so
// an outage or a DNS failure does not use up the events' max_attempts.
func TestRefusedConnectionIsSinkDown(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	s := MustSink(t, webhook.Config{URL: "http://" + addr + "/hook"})
	err = send(t, s, newDelivery("k-1", `{}`))
	if class, _ := relay.Classify(err); class != relay.SinkDown {
		t.Fatalf("class %s, want sink-down (%v)", class, err)
	}
	if !strings.Contains(err.Error(), "cannot connect") || !strings.Contains(err.Error(), addr) {
		t.Errorf("error %q does not say it cannot connect to %s", err, addr)
	}
}

func TestUnresolvableHostIsSinkDown(t *testing.T) {
	t.Parallel()
	const host = "outbox-relay-no-such-host.invalid"
	s := MustSink(t, webhook.Config{URL: "http://" + host + "/hook", Timeout: 5 * time.Second})
	err := send(t, s, newDelivery("k-1", `{}`))
	if class, _ := relay.Classify(err); class != relay.SinkDown {
		t.Fatalf("class %s, want sink-down (%v)", class, err)
	}
	if !strings.Contains(err.Error(), host) {
		t.Errorf("error %q does not name the host %s", err, host)
	}
}

func TestTLSHandshakeFailureIsTransient(t *testing.T) {
	t.Parallel()
	// An http:// receiver spoken to over TLS: the handshake fails before
	// anything of the request is written.
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: strings.Replace(rc.URL, "http://", "https://", 1)})
	err := send(t, s, newDelivery("k-1", `{}`))
	if class, _ := relay.Classify(err); class != relay.Transient {
		t.Fatalf("class %s, want transient (%v)", class, err)
	}
	if n := len(rc.Requests()); n != 0 {
		t.Fatalf("receiver saw %d requests", n)
	}
}

func TestNoAnswerWithinTimeoutIsUnknown(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	rc := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	s := MustSink(t, webhook.Config{URL: rc.URL, Timeout: 300 * time.Millisecond})
	start := time.Now()
	err := send(t, s, newDelivery("k-1", `{"n":1}`))
	if class, _ := relay.Classify(err); class != relay.Unknown {
		t.Fatalf("class %s, want unknown (%v)", class, err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("took %v, want about the 300ms timeout", took)
	}
	if n := len(rc.Requests()); n != 1 {
		t.Fatalf("receiver saw %d requests, want 1", n)
	}
}

func TestOversizeBodyIsPermanentAndNotSent(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, MaxBody: 10})
	if err := send(t, s, newDelivery("fits", `0123456789`)); err != nil {
		t.Fatalf("10-byte body: %v", err)
	}
	err := send(t, s, newDelivery("too-big", `01234567890`))
	if class, _ := relay.Classify(err); class != relay.Permanent {
		t.Fatalf("class %s, want permanent (%v)", class, err)
	}
	for _, want := range []string{`"too-big"`, "11 bytes", "max_body of 10 bytes"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
	if n := len(rc.Requests()); n != 1 {
		t.Fatalf("receiver saw %d requests, want only the one that fits", n)
	}
}

func TestEmptyBodyIsPermanentAndNotSent(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL})
	err := send(t, s, newDelivery("k", ``))
	if class, _ := relay.Classify(err); class != relay.Permanent {
		t.Fatalf("class %s, want permanent (%v)", class, err)
	}
	if n := len(rc.Requests()); n != 0 {
		t.Fatalf("receiver saw %d requests", n)
	}
}

func TestCancelledContextIsTransientAndNotSent(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := sendCtx(t, ctx, s, newDelivery("k", `{}`))
	if class, _ := relay.Classify(err); class != relay.Transient || !errors.Is(err, context.Canceled) {
		t.Fatalf("got %s %v, want transient wrapping context.Canceled", class, err)
	}
	if n := len(rc.Requests()); n != 0 {
		t.Fatalf("receiver saw %d requests", n)
	}
}
