package webhook_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/notify"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// MustNotifier builds a notifier for cfg, closed with t.Cleanup.
func MustNotifier(tb testing.TB, cfg webhook.NotifierConfig) *webhook.Notifier {
	tb.Helper()
	n, err := webhook.NewNotifier(cfg)
	if err != nil {
		tb.Fatalf("NewNotifier: %v", err)
	}
	tb.Cleanup(func() { _ = n.Close(context.Background()) })
	return n
}

// testSummary is a summary of 7 dead letters and 1 held event at sink n8n.
func testSummary() notify.Summary {
	at := time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)
	return notify.Summary{
		Sink: "n8n", Count: 8, Failed: 7, Held: 1,
		Events: []notify.Event{
			{ID: 101, EventKey: "order-101", Status: "failed"}, {ID: 102, EventKey: "<b>&", Status: "held"},
			{ID: 103, EventKey: "order-103", Status: "failed"}, {ID: 104, EventKey: "order-104", Status: "failed"},
			{ID: 105, EventKey: "order-105", Status: "failed"},
		},
		LastError: "sink n8n: webhook n8n: event \"order-108\": receiver answered 400 Bad Request: <html>",
		Since:     at, Until: at.Add(3 * time.Second),
		From: notify.Mark{At: at.Add(-time.Minute), ID: 100}, To: notify.Mark{At: at.Add(3 * time.Second), ID: 108},
		ConsoleURL: "http://127.0.0.1:9187/console/",
	}
}

// TestNotifier_SlackBody: the slack format carries the summary as text, in
// "text" and in a section block, with mrkdwn's reserved characters escaped,
// the commands, and a button to the console.
func TestNotifier_SlackBody(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	n := MustNotifier(t, webhook.NotifierConfig{URL: rc.URL + "/slack", Format: webhook.NotifySlack})
	if err := n.Send(context.Background(), testSummary()); err != nil {
		t.Fatalf("Send: %v", err)
	}
	reqs := rc.Requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want 1", len(reqs))
	}
	var body struct {
		Text   string `json:"text"`
		Blocks []struct {
			Type string `json:"type"`
			Text struct {
				Type, Text string
			} `json:"text"`
			Elements []struct {
				Type string `json:"type"`
				URL  string `json:"url"`
			} `json:"elements"`
		} `json:"blocks"`
	}
	if err := json.Unmarshal(reqs[0].Body, &body); err != nil {
		t.Fatalf("body %s: %v", reqs[0].Body, err)
	}
	for _, want := range []string{
		"*outbox-relay: 7 events dead-lettered and 1 event held for a decision at sink n8n*",
		"101 `order-101` (failed), 102 `&lt;b&gt;&amp;` (held)", "and 3 more",
		"Last error: sink n8n: webhook n8n: event \"order-108\": receiver answered 400 Bad Request: &lt;html&gt;",
		"List: `outbox-relay dlq list --sink n8n`", "Retry: `outbox-relay dlq retry --sink n8n`",
		"<http://127.0.0.1:9187/console/|open the console>",
	} {
		if !strings.Contains(body.Text, want) {
			t.Errorf("text lacks %q:\n%s", want, body.Text)
		}
	}
	if len(body.Blocks) != 2 || body.Blocks[0].Text.Text != body.Text || body.Blocks[0].Text.Type != "mrkdwn" ||
		len(body.Blocks[1].Elements) != 1 || body.Blocks[1].Elements[0].URL != "http://127.0.0.1:9187/console/" {
		t.Errorf("blocks = %+v, want the text in a section and the console's button", body.Blocks)
	}
	if ct := reqs[0].Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
}

// TestNotifier_JSONBody: the json format is the summary's fields, with the
// commands and the notification's id.
func TestNotifier_JSONBody(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	n := MustNotifier(t, webhook.NotifierConfig{URL: rc.URL, Format: webhook.NotifyJSON})
	s := testSummary()
	s.ConsoleURL = ""
	if err := n.Send(context.Background(), s); err != nil {
		t.Fatalf("Send: %v", err)
	}
	var got map[string]any
	if err := json.Unmarshal(rc.Requests()[0].Body, &got); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{
		"type": webhook.NotificationType, "id": s.ID(), "sink": "n8n", "count": 8.0, "failed": 7.0, "held": 1.0, "more": false,
		"last_error": s.LastError, "since": "2026-12-06T10:00:00Z", "until": "2026-12-06T10:00:03Z",
		"list_command": "outbox-relay dlq list --sink n8n", "retry_command": "outbox-relay dlq retry --sink n8n",
		"text": "outbox-relay: 7 events dead-lettered and 1 event held for a decision at sink n8n",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %#v, want %#v", k, got[k], v)
		}
	}
	if _, ok := got["console_url"]; ok {
		t.Error("console_url present without a console")
	}
	if events, _ := got["events"].([]any); len(events) != 5 || events[0].(map[string]any)["event_key"] != "order-101" {
		t.Errorf("events = %v, want the first 5", got["events"])
	}
}

// TestNotifier_AuthAndID: the request authenticates as a sink's would, and
// every send of one summary carries the same id.
func TestNotifier_AuthAndID(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	n := MustNotifier(t, webhook.NotifierConfig{URL: rc.URL, Headers: map[string]string{"X-Team": "ops"},
		Auth: webhook.Auth{Type: webhook.AuthJWT, Secret: "s3cret"}})
	s := testSummary()
	for range 2 {
		if err := n.Send(context.Background(), s); err != nil {
			t.Fatalf("Send: %v", err)
		}
	}
	reqs := rc.Requests()
	if id := reqs[0].Header.Get("Webhook-Id"); id == "" || id != reqs[1].Header.Get("Webhook-Id") || id != reqs[0].Header.Get("Idempotency-Key") {
		t.Errorf("ids %q, %q: want one id, the same on every send", id, reqs[1].Header.Get("Webhook-Id"))
	}
	if reqs[0].Header.Get("X-Team") != "ops" {
		t.Errorf("headers = %v, want X-Team", reqs[0].Header)
	}
	token, ok := strings.CutPrefix(reqs[0].Header.Get("Authorization"), "Bearer ")
	claims := jwt.MapClaims{}
	if _, err := jwt.ParseWithClaims(token, claims, func(*jwt.Token) (any, error) { return []byte("s3cret"), nil }); !ok || err != nil {
		t.Fatalf("Authorization %q: %v", reqs[0].Header.Get("Authorization"), err)
	}
	if claims["sink"] != "n8n" || claims["notification"] != reqs[0].Header.Get("Webhook-Id") {
		t.Errorf("claims = %v", claims)
	}
}

// TestNotifier_NotAccepted: a receiver that refuses, fails, is down or does
// not answer in time is an error, within the timeout; a 2xx is accepted.
func TestNotifier_NotAccepted(t *testing.T) {
	t.Parallel()
	status := func(code int) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(code) }
	}
	slow := MustReceiver(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	down := MustReceiver(t, nil)
	down.Close()
	for _, c := range []struct {
		name string
		url  string
		ok   bool
	}{
		{"204", MustReceiver(t, status(http.StatusNoContent)).URL, true},
		{"503", MustReceiver(t, status(http.StatusServiceUnavailable)).URL, false},
		{"400", MustReceiver(t, status(http.StatusBadRequest)).URL, false},
		{"401", MustReceiver(t, status(http.StatusUnauthorized)).URL, false},
		{"refused", down.URL, false},
		{"no answer in time", slow.URL, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := MustNotifier(t, webhook.NotifierConfig{URL: c.url, Timeout: 300 * time.Millisecond})
			start := time.Now()
			err := n.Send(context.Background(), testSummary())
			if (err == nil) != c.ok {
				t.Fatalf("Send = %v, want accepted %v", err, c.ok)
			}
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("Send took %s, want it bounded by the 300ms timeout", took)
			}
			if err != nil && strings.Contains(err.Error(), c.url) && c.name != "refused" {
				t.Errorf("error %v repeats the URL", err)
			}
		})
	}
}

// TestNotifier_NoSilentResend: a notification whose kept-alive connection
// is closed after the request was read, without an answer, reaches the
// receiver once: net/http does not send it again by itself.
func TestNotifier_NoSilentResend(t *testing.T) {
	t.Parallel()
	srv := mustDropSecond(t)
	n := MustNotifier(t, webhook.NotifierConfig{URL: "http://" + srv.ln.Addr().String() + "/notify"})
	first, second := testSummary(), testSummary()
	second.To.ID++
	if err := n.Send(context.Background(), first); err != nil {
		t.Fatalf("first: %v", err)
	}
	err := n.Send(context.Background(), second)
	if class, _ := relay.Classify(err); class != relay.Unknown {
		t.Fatalf("second: class %s, want unknown (%v)", class, err)
	}
	time.Sleep(300 * time.Millisecond) // room for a re-send to arrive
	got := srv.Requests()
	if len(got) != 2 || !strings.HasPrefix(got[0], "conn1/req1 ") || !strings.HasPrefix(got[1], "conn1/req2 ") {
		t.Fatalf("server read %q, want exactly one copy of each notification, on one connection", got)
	}
}

// TestNewNotifier_Invalid: a bad URL, format, header or auth is refused.
func TestNewNotifier_Invalid(t *testing.T) {
	for _, c := range []struct {
		cfg  webhook.NotifierConfig
		want string
	}{
		{webhook.NotifierConfig{URL: "ftp://x"}, "absolute http"},
		{webhook.NotifierConfig{URL: "http://x", Format: "xml"}, `format "xml"`},
		{webhook.NotifierConfig{URL: "http://x", Headers: map[string]string{"Content-Type": "text/plain"}}, "set by the sink itself"},
		{webhook.NotifierConfig{URL: "http://x", Auth: webhook.Auth{Type: webhook.AuthJWT}}, "needs a secret"},
	} {
		if _, err := webhook.NewNotifier(c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewNotifier(%+v) = %v, want an error with %q", c.cfg, err, c.want)
		}
	}
}
