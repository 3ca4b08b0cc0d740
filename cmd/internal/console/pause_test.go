package console_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// TestAPI_PauseAndResume: a pause through the API is the row the CLI
// writes, status shows it on the sink, a second pause changes nothing, and
// resume lifts it; an unknown sink is a 404 naming the configured ones; the
// read-only token may not pause (403), nor may a request without a token
// (401), and the refusal and the actions are logged.
func TestAPI_PauseAndResume(t *testing.T) {
	f := MustServer(t)

	status, body := f.call(t, "POST", "/api/v1/sinks/hook/pause", "", nil)
	expect(t, "pause without a token", status, body, 401, "unauthorized")
	status, body = f.call(t, "POST", "/api/v1/sinks/hook/pause", readToken, nil)
	expect(t, "pause with the read-only token", status, body, 403, "read-only token (http.admin_read_token) cannot pause sink hook", "http.admin_token")
	status, body = f.call(t, "POST", "/api/v1/sinks/hook/resume", readToken, nil)
	expect(t, "resume with the read-only token", status, body, 403, "cannot resume sink hook")
	status, body = f.call(t, "POST", "/api/v1/sinks/nope/pause", adminToken, nil)
	expect(t, "pause an unknown sink", status, body, 404, `no such sink \"nope\" (configured: hook, nats)`)
	status, body = f.call(t, "POST", "/api/v1/sinks/nope/resume", adminToken, nil)
	expect(t, "resume an unknown sink", status, body, 404, "no such sink")
	if n := f.pauses(t); n != 0 {
		t.Fatalf("refused requests paused %d sinks", n)
	}

	status, body = f.call(t, "POST", "/api/v1/sinks/hook/pause", adminToken, map[string]any{"reason": "n8n upgrade"})
	expect(t, "pause", status, body, 200, `"changed":true`, `"reason":"n8n upgrade"`, "sink hook paused")
	status, body = f.call(t, "POST", "/api/v1/sinks/hook/pause", adminToken, nil)
	expect(t, "pause again", status, body, 200, `"changed":false`, "already paused")
	status, body = f.call(t, "GET", "/api/v1/status", readToken, nil)
	expect(t, "status while paused", status, body, 200, `"paused":{"sink":"hook"`, "sink hook is paused")
	if strings.Contains(body, `"paused":{"sink":"nats"`) {
		t.Errorf("status shows nats paused: %s", body)
	}

	status, body = f.call(t, "POST", "/api/v1/sinks/hook/resume", adminToken, nil)
	expect(t, "resume", status, body, 200, `"changed":true`, "sink hook resumed")
	status, body = f.call(t, "POST", "/api/v1/sinks/hook/resume", adminToken, nil)
	expect(t, "resume again", status, body, 200, `"changed":false`, "was not paused")
	if n := f.pauses(t); n != 0 {
		t.Fatalf("%d sinks paused after the resume", n)
	}
	logs := f.logs.String()
	for _, want := range []string{`"refused":"the read-only token"`, `"action":"pause sink hook"`, `"message":"admin API: pause sink"`, `"message":"admin API: resume sink"`, `"reason":"n8n upgrade"`} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs do not say %s:\n%s", want, logs)
		}
	}
}

// pauses counts the rows of the pauses table.
func (f *fixture) pauses(tb testing.TB) int {
	tb.Helper()
	var n int
	if err := f.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+migrations.SinkPausesTable(f.tables.Outbox).Quoted()).Scan(&n); err != nil {
		tb.Fatal(err)
	}
	return n
}

// namedSink is a relay.Sink that only has a name: the metrics' label.
type namedSink string

func (s namedSink) Name() string                                         { return string(s) }
func (namedSink) Send(context.Context, *relay.Delivery, func(err error)) {}
func (namedSink) Close(context.Context) error                            { return nil }

// TestAPI_StatusShowsTheRateLimit: a sink's rate limit and the time its
// lane waited on it are on its row of the status, from the relay's
// metrics; a sink without a limit shows 0.
func TestAPI_StatusShowsTheRateLimit(t *testing.T) {
	f := MustServer(t)
	relay.InitMetrics([]relay.Route{{Sink: namedSink("hook"), RateLimit: relay.NewRateLimit(200, 20)}, {Sink: namedSink("nats")}})
	status, body := f.call(t, "GET", "/api/v1/status", readToken, nil)
	expect(t, "status", status, body, 200, `"rate_limit_wait_seconds":`)
	var st struct {
		Sinks []struct {
			Name      string  `json:"name"`
			RateLimit float64 `json:"rate_limit_per_second"`
		} `json:"sinks"`
	}
	if err := json.Unmarshal([]byte(body), &st); err != nil {
		t.Fatal(err)
	}
	limits := map[string]float64{}
	for _, s := range st.Sinks {
		limits[s.Name] = s.RateLimit
	}
	if limits["hook"] != 200 || limits["nats"] != 0 {
		t.Errorf("rate limits %v, want hook 200 and nats 0", limits)
	}
}
