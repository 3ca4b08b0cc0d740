package console_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/console"
	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const (
	adminToken = "admin-token-0123456789"
	readToken  = "read-token-0123456789"
)

// fixture is the API on a migrated database with two sinks, hook (every
// event) and nats (order.*), and what the server logged.
type fixture struct {
	pool   *pgxpool.Pool
	tables admin.Tables
	srv    *httptest.Server
	logs   *syncBuffer
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func MustServer(tb testing.TB) *fixture {
	tb.Helper()
	ctx := context.Background()
	url := pgtest.NewDatabase(tb)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatal(err)
	}
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		tb.Fatal(err)
	}
	conn.Close(ctx)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	n := migrations.DefaultNames()
	f := &fixture{pool: pool, logs: &syncBuffer{},
		tables: admin.Tables{Outbox: n.Outbox, Ledger: n.Ledger, Checkpoint: n.Checkpoint,
			Sinks: []admin.Sink{{Name: "hook", Events: []string{"*"}}, {Name: "nats", Events: []string{"order.*"}}}}}
	done := make(chan struct{})
	tb.Cleanup(func() { close(done) })
	s := console.New(console.Config{AdminToken: adminToken, ReadToken: readToken, Feed: relay.NewFeed(false), Done: done,
		Logger: zerolog.New(f.logs)})
	s.Attach(console.Backend{DB: pool, Tables: f.tables, Where: admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")},
		Health: func() console.Health { return console.Health{Ready: true} }})
	mux := http.NewServeMux()
	s.Register(mux)
	f.srv = httptest.NewServer(mux)
	tb.Cleanup(f.srv.Close)
	return f
}

// MustInsert inserts an event and returns its id.
func (f *fixture) MustInsert(tb testing.TB, key, eventType, status string) int64 {
	tb.Helper()
	var id int64
	err := f.pool.QueryRow(context.Background(), `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, attempts, last_error)
		VALUES ($1, 'order', $2, $2, '{"card": "4111-SECRET"}', $3, 3, CASE WHEN $3 IN ('failed', 'held') THEN 'sink hook: 400 Bad Request' END) RETURNING id`,
		eventType, key, status).Scan(&id)
	if err != nil {
		tb.Fatal(err)
	}
	return id
}

func (f *fixture) MustLedger(tb testing.TB, key, sink, state string) {
	tb.Helper()
	if _, err := f.pool.Exec(context.Background(), `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		VALUES ($1, $2, $3, 1, CASE WHEN $3 = 'delivered' THEN now() END)`, key, sink, state); err != nil {
		tb.Fatal(err)
	}
}

func (f *fixture) status(tb testing.TB, id int64) string {
	tb.Helper()
	var s string
	if err := f.pool.QueryRow(context.Background(), `SELECT status FROM integration_outbox WHERE id = $1`, id).Scan(&s); err != nil {
		tb.Fatal(err)
	}
	return s
}

// call sends a request with token (none when ""), the body as JSON when
// not nil, and the extra headers; it returns the status and the body.
func (f *fixture) call(tb testing.TB, method, path, token string, body any, headers ...string) (int, string) {
	tb.Helper()
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			tb.Fatal(err)
		}
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, f.srv.URL+path, r)
	if err != nil {
		tb.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(out)
}

// expect fails tb unless the answer has the status and every want.
func expect(tb testing.TB, what string, status int, body string, wantStatus int, want ...string) {
	tb.Helper()
	if status != wantStatus {
		tb.Errorf("%s: %d %s, want %d", what, status, strings.TrimSpace(body), wantStatus)
		return
	}
	for _, w := range want {
		if !strings.Contains(body, w) {
			tb.Errorf("%s: %s does not say %q", what, strings.TrimSpace(body), w)
		}
	}
}

// TestAPI_Tokens: every endpoint needs a token (401 without, with a clear
// message); the read-only token reads but may not act (403, naming the
// token to use), and the refusal is logged.
func TestAPI_Tokens(t *testing.T) {
	f := MustServer(t)
	id := f.MustInsert(t, "a", "order.placed", "failed")
	for _, tc := range []struct {
		method, path, token string
		body                any
		status              int
		want                []string
	}{
		{"GET", "/api/v1/status", "", nil, 401, []string{"unauthorized", "Authorization: Bearer", "http.admin_token"}},
		{"GET", "/api/v1/status", "wrong-token-0123456789", nil, 401, []string{"unauthorized"}},
		{"GET", "/api/v1/dead-letters", "", nil, 401, nil},
		{"GET", "/api/v1/feed", "", nil, 401, nil},
		{"POST", "/api/v1/dead-letters/retry", "", map[string]any{"ids": []int64{id}}, 401, nil},
		{"GET", "/api/v1/nothing-here", "", nil, 401, nil},
		{"GET", "/api/v1/status", readToken, nil, 200, []string{`"access":"read"`}},
		{"GET", "/api/v1/dead-letters", readToken, nil, 200, []string{`"event_key":"a"`}},
		{"POST", "/api/v1/dead-letters/retry", readToken, map[string]any{"ids": []int64{id}}, 403, []string{"read-only token (http.admin_read_token) cannot retry dead letters", "http.admin_token"}},
		{"POST", "/api/v1/dead-letters/discard", readToken, map[string]any{"ids": []int64{id}}, 403, []string{"cannot discard dead letters"}},
		{"POST", "/api/v1/replay", readToken, map[string]any{"ids": []int64{id}}, 403, []string{"cannot replay events"}},
		{"GET", "/api/v1/status", adminToken, nil, 200, []string{`"access":"admin"`}},
		{"GET", "/api/v1/nothing-here", adminToken, nil, 404, []string{"no such endpoint: GET /api/v1/nothing-here"}},
		{"GET", "/api/v1/dead-letters/retry", adminToken, nil, 404, []string{"no such endpoint: GET /api/v1/dead-letters/retry"}},
	} {
		status, body := f.call(t, tc.method, tc.path, tc.token, tc.body)
		expect(t, fmt.Sprintf("%s %s with %q", tc.method, tc.path, tc.token), status, body, tc.status, tc.want...)
	}
	if got := f.status(t, id); got != "failed" {
		t.Errorf("the refused actions changed the row: %s", got)
	}
	if logs := f.logs.String(); !strings.Contains(logs, `"refused":"the read-only token"`) || !strings.Contains(logs, `"action":"retry dead letters"`) {
		t.Errorf("the refusals are not logged:\n%s", logs)
	}
}

// TestAPI_CrossSiteRefused: a browser's POST from another site is refused
// (403) even with the admin token, and changes nothing; one from the
// console's own origin, or from a client that is not a browser, acts.
func TestAPI_CrossSiteRefused(t *testing.T) {
	f := MustServer(t)
	a := f.MustInsert(t, "a", "order.placed", "failed")
	b := f.MustInsert(t, "b", "order.placed", "failed")
	c := f.MustInsert(t, "c", "order.placed", "failed")
	status, body := f.call(t, "POST", "/api/v1/dead-letters/retry", adminToken, map[string]any{"ids": []int64{a}},
		"Origin", "https://evil.example", "Sec-Fetch-Site", "cross-site")
	expect(t, "cross-site POST", status, body, 403, "cross-site request refused", "https://evil.example")
	status, body = f.call(t, "POST", "/api/v1/dead-letters/retry", adminToken, map[string]any{"ids": []int64{a}},
		"Origin", "https://evil.example")
	expect(t, "POST with a foreign Origin", status, body, 403, "cross-site request refused")
	if got := f.status(t, a); got != "failed" {
		t.Fatalf("a cross-site request changed the row: %s", got)
	}
	status, body = f.call(t, "POST", "/api/v1/dead-letters/retry", adminToken, map[string]any{"ids": []int64{b}},
		"Origin", f.srv.URL, "Sec-Fetch-Site", "same-origin")
	expect(t, "same-origin POST", status, body, 200, `"rows":1`)
	status, body = f.call(t, "POST", "/api/v1/dead-letters/retry", adminToken, map[string]any{"ids": []int64{c}})
	expect(t, "POST from curl", status, body, 200, `"rows":1`)
	if logs := f.logs.String(); !strings.Contains(logs, `"refused":"a cross-site request"`) {
		t.Errorf("the cross-site request is not logged:\n%s", logs)
	}
}

// TestAPI_Off: without an admin token nothing is served: 404 everywhere.
func TestAPI_Off(t *testing.T) {
	s := console.New(console.Config{ReadToken: readToken})
	mux := http.NewServeMux()
	s.Register(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, path := range []string{"/api/v1/status", "/console/", "/console/console.js"} {
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.Header.Set("Authorization", "Bearer "+readToken)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 404 {
			t.Errorf("GET %s without http.admin_token: %d, want 404", path, resp.StatusCode)
		}
	}
}

// TestAPI_StartingAnswers503: until the relay has connected, the reads say
// so (503), rather than fail.
func TestAPI_StartingAnswers503(t *testing.T) {
	s := console.New(console.Config{AdminToken: adminToken})
	mux := http.NewServeMux()
	s.Register(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	req, _ := http.NewRequest("GET", srv.URL+"/api/v1/status", nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	expect(t, "status while starting", resp.StatusCode, string(body), 503, "the relay is starting")
}

// TestAPI_Status: the relays' status as `status --json` has it (mode,
// leader, slot with its lag), with the rows, each sink and what needs a
// look; no secret and no payload.
func TestAPI_Status(t *testing.T) {
	f := MustServer(t)
	f.MustInsert(t, "a", "order.placed", "failed")
	if _, err := f.pool.Exec(context.Background(), "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')"); err != nil {
		t.Fatal(err)
	}
	status, body := f.call(t, "GET", "/api/v1/status", adminToken, nil)
	expect(t, "status", status, body, 200, `"mode":"stopped"`, `"slot":{"name":"outbox_relay","server":"primary","exists":true`, `"lag_bytes":`,
		`"rows":{`, `"sinks":[{"name":"hook","events":["*"]`, `{"name":"nats","events":["order.*"]`, `"last_minute":{`,
		`"rate_per_second":`, `"chart":{"step_seconds":5`, `"state":`, `"errors":[`, `"delivered_last_hour":{"hook":0,"nats":0}`)
	var st struct {
		State   string `json:"state"`
		Summary string `json:"summary"`
		Relay   struct {
			Ready bool `json:"ready"`
		} `json:"relay"`
	}
	if err := json.Unmarshal([]byte(body), &st); err != nil {
		t.Fatal(err)
	}
	if st.State == "" || st.Summary == "" || !st.Relay.Ready {
		t.Errorf("state %q summary %q relay %+v", st.State, st.Summary, st.Relay)
	}
	if strings.Contains(body, "SECRET") || strings.Contains(body, "postgres://") || strings.Contains(body, "password") {
		t.Errorf("status shows a payload or a secret: %s", body)
	}
}

// TestAPI_DeadLetters: the dead letters page by id, filter by status, sink
// and type, and refuse bad input with a message naming it.
func TestAPI_DeadLetters(t *testing.T) {
	f := MustServer(t)
	a := f.MustInsert(t, "a", "order.placed", "failed")
	b := f.MustInsert(t, "b", "invoice.sent", "held")
	c := f.MustInsert(t, "c", "order.placed", "failed")
	f.MustInsert(t, "d", "order.placed", "done")
	f.MustLedger(t, "c", "hook", "delivered")

	status, body := f.call(t, "GET", "/api/v1/dead-letters?limit=2", adminToken, nil)
	expect(t, "first page", status, body, 200, `"more":true`, fmt.Sprintf(`"next_after":%d`, b), `"event_key":"a"`, `"event_key":"b"`)
	if strings.Contains(body, `"event_key":"c"`) || strings.Contains(body, "SECRET") {
		t.Errorf("first page: %s", body)
	}
	status, body = f.call(t, "GET", fmt.Sprintf("/api/v1/dead-letters?limit=2&after=%d", b), adminToken, nil)
	expect(t, "second page", status, body, 200, `"more":false`, `"event_key":"c"`, `"ledger":[{"sink":"hook","state":"delivered"`)

	for _, tc := range []struct {
		query string
		want  []int64
	}{
		{"status=held", []int64{b}},
		{"sink=hook", []int64{a, b}},
		{"sink=nats", []int64{a, c}},
		{"type=invoice.*", []int64{b}},
		{"status=failed&type=invoice.*", nil},
	} {
		status, body := f.call(t, "GET", "/api/v1/dead-letters?"+tc.query, adminToken, nil)
		var page struct {
			Events []struct {
				ID int64 `json:"id"`
			} `json:"events"`
		}
		if status != 200 || json.Unmarshal([]byte(body), &page) != nil {
			t.Errorf("%s: %d %s", tc.query, status, body)
			continue
		}
		var got []int64
		for _, e := range page.Events {
			got = append(got, e.ID)
		}
		if fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("%s: %v, want %v", tc.query, got, tc.want)
		}
	}

	for _, tc := range []struct{ query, want string }{
		{"sink=kafka", `sink: no such sink \"kafka\" (configured: hook, nats)`},
		{"type=[oops", `type \"[oops\" is not a valid glob`},
		{"status=done", `status \"done\": failed, held or discarded`},
		{"after=abc", `after \"abc\": an event id`},
		{"limit=0", `limit \"0\": from 1 to 500`},
		{"since=yesterday", `since \"yesterday\": write an RFC 3339 time`},
		{"sort=id", `unknown parameter \"sort\"`},
	} {
		status, body := f.call(t, "GET", "/api/v1/dead-letters?"+tc.query, adminToken, nil)
		expect(t, tc.query, status, body, 400, tc.want)
	}
}

// TestAPI_RetryAndDiscard: retry and discard are the dlq commands'
// (admin.ActionRetry, admin.ActionDiscard): retry resets the event and its
// undelivered ledger rows; discard settles it; a dry run changes nothing;
// an action that matches nothing says so (422); each action is logged with
// what it changed and from where.
func TestAPI_RetryAndDiscard(t *testing.T) {
	f := MustServer(t)
	a := f.MustInsert(t, "a", "order.placed", "failed")
	b := f.MustInsert(t, "b", "order.placed", "held")
	c := f.MustInsert(t, "c", "invoice.sent", "failed")
	f.MustLedger(t, "a", "hook", "delivered")
	f.MustLedger(t, "a", "nats", "unknown")

	status, body := f.call(t, "POST", "/api/v1/dead-letters/retry", adminToken, map[string]any{"all": true, "dry_run": true})
	expect(t, "dry run", status, body, 200, `"dry_run":true`, `"selected":3`, `"rows":0`, "3 events would be retried")
	if f.status(t, a) != "failed" {
		t.Fatal("a dry run changed a row")
	}

	status, body = f.call(t, "POST", "/api/v1/dead-letters/retry", adminToken, map[string]any{"ids": []int64{a}})
	expect(t, "retry", status, body, 200, `"selected":1`, `"rows":1`, `"ledger_rows":1`, "retried 1 event, cleared 1 ledger rows")
	if got := f.status(t, a); got != "pending" {
		t.Errorf("retried row: %s", got)
	}
	status, body = f.call(t, "POST", "/api/v1/dead-letters/retry", adminToken, map[string]any{"ids": []int64{a}})
	expect(t, "retry again", status, body, 422, "nothing to retry: no failed or held event matches")

	// Discard by filter: the sink nats takes order.*, so c (invoice) stays.
	status, body = f.call(t, "POST", "/api/v1/dead-letters/discard", adminToken, map[string]any{"sink": "nats"})
	expect(t, "discard for nats", status, body, 200, `"rows":1`, "discarded 1 event")
	if f.status(t, b) != "discarded" || f.status(t, c) != "failed" {
		t.Errorf("after discard: b %s, c %s", f.status(t, b), f.status(t, c))
	}

	for _, tc := range []struct {
		path string
		body any
		want string
	}{
		{"dead-letters/retry", map[string]any{}, "say which events to retry: ids, a filter (sink, event_type, since), or all: true"},
		{"dead-letters/retry", map[string]any{"ids": []int64{}}, "ids: the list is empty"},
		{"dead-letters/retry", map[string]any{"sink": "kafka"}, `sink: no such sink \"kafka\"`},
		{"dead-letters/retry", map[string]any{"event_type": "[x"}, "is not a valid glob"},
		{"dead-letters/discard", map[string]any{"idz": []int64{c}}, `unknown field \"idz\"`},
		{"dead-letters/discard", map[string]any{"since": "last week"}, `since \"last week\": write an RFC 3339 time`},
		{"dead-letters/discard", "not an object", "request body"},
	} {
		status, body := f.call(t, "POST", "/api/v1/"+tc.path, adminToken, tc.body)
		expect(t, fmt.Sprintf("%s %v", tc.path, tc.body), status, body, 400, tc.want)
	}

	logs := f.logs.String()
	for _, want := range []string{`"action":"retry"`, `"rows":1`, `"ledger_rows":1`, `"id_list":[` + fmt.Sprint(a) + `]`, `"from":"127.0.0.1:`,
		`"action":"discard"`, `"sink":"nats"`, `admin API: discarded events`} {
		if !strings.Contains(logs, want) {
			t.Errorf("the action log lacks %s:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, "would be retried") || strings.Count(logs, `"message":"admin API: retried events"`) != 1 {
		t.Errorf("a dry run or a refused retry was logged as an action:\n%s", logs)
	}
}

// TestAPI_Replay: replay is the replay command's (admin.ActionReplay); a
// replay of nothing is an error that says why, naming the events in flight
// it left alone.
func TestAPI_Replay(t *testing.T) {
	f := MustServer(t)
	done := f.MustInsert(t, "a", "order.placed", "done")
	f.MustLedger(t, "a", "hook", "delivered")
	f.MustLedger(t, "a", "nats", "delivered")
	pending := f.MustInsert(t, "p", "order.placed", "pending")

	for _, tc := range []struct {
		body   any
		status int
		want   string
	}{
		{map[string]any{}, 400, "say what to replay: since"},
		{map[string]any{"event_type": "order.*"}, 400, "say what to replay"},
		{map[string]any{"all": true, "since": "1h"}, 400, "all: replay takes since and/or ids"},
		{map[string]any{"ids": []int64{pending}}, 422, "nothing to replay: no done, failed or held event matches; 1 matching event is pending or processing"},
		{map[string]any{"since": "2999-01-01"}, 422, "nothing to replay: no done, failed or held event matches"},
		{map[string]any{"ids": []int64{done}, "sink": "kafka"}, 400, `no such sink \"kafka\" (configured: hook, nats)`},
	} {
		status, body := f.call(t, "POST", "/api/v1/replay", adminToken, tc.body)
		expect(t, fmt.Sprintf("replay %v", tc.body), status, body, tc.status, tc.want)
	}

	status, body := f.call(t, "POST", "/api/v1/replay", adminToken, map[string]any{"since": "1h", "event_type": "order.*", "sink": "nats", "dry_run": true})
	expect(t, "replay preview", status, body, 200, `"selected":1`, "1 event would be replayed")
	status, body = f.call(t, "POST", "/api/v1/replay", adminToken, map[string]any{"ids": []int64{done}, "sink": "nats"})
	expect(t, "replay to nats", status, body, 200, `"rows":1`, `"ledger_rows":1`, "replayed 1 event")
	var ledgerRows []string
	rows, _ := f.pool.Query(context.Background(), `SELECT action FROM integration_idempotency WHERE event_key = 'a' ORDER BY action`)
	ledgerRows, _ = pgx.CollectRows(rows, pgx.RowTo[string])
	if f.status(t, done) != "pending" || fmt.Sprint(ledgerRows) != "[hook]" {
		t.Errorf("after a replay to nats: status %s, ledger rows %v (want hook's only)", f.status(t, done), ledgerRows)
	}
}

// TestAPI_EventLookup: one event by key (a key with a slash and a space
// included) or by id, as `outbox-relay event` shows it (admin.LookupEvent):
// its state and each sink's ledger row, the payload's size and never the
// payload; an event the outbox does not hold is a 404, bad input a 400.
func TestAPI_EventLookup(t *testing.T) {
	f := MustServer(t)
	id := f.MustInsert(t, "crm/lead 42", "order.placed", "failed")
	f.MustLedger(t, "crm/lead 42", "nats", "delivered")

	for _, path := range []string{"/api/v1/events/crm%2Flead%2042", "/api/v1/events/crm/lead%2042", fmt.Sprintf("/api/v1/events?id=%d", id)} {
		status, body := f.call(t, "GET", path, readToken, nil)
		expect(t, path, status, body, 200, fmt.Sprintf(`"id":%d`, id), `"event_key":"crm/lead 42"`, `"state":"failed"`,
			`"name":"nats"`, `"delivered":true`, `"name":"hook"`, `"payload_bytes":`)
		if strings.Contains(body, "SECRET") {
			t.Errorf("%s shows the payload: %s", path, body)
		}
	}
	for _, tc := range []struct {
		path   string
		status int
		want   string
	}{
		{"/api/v1/events/nobody", 404, "no such event"},
		{"/api/v1/events?id=987654", 404, "no such event"},
		{"/api/v1/events?id=abc", 400, `id \"abc\": an event id`},
		{"/api/v1/events", 400, "name the event"},
		{"/api/v1/events/x?id=1", 400, "not both"},
	} {
		status, body := f.call(t, "GET", tc.path, adminToken, nil)
		expect(t, tc.path, status, body, tc.status, tc.want)
	}
}
