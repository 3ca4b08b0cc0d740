package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// recorded is one webhook request with its headers.
type recorded struct {
	Header http.Header
	Body   []byte
}

// headerReceiver is a webhook destination that records every request with
// its headers and answers reply's status (204 when nil).
type headerReceiver struct {
	*httptest.Server
	mu    sync.Mutex
	reqs  []recorded
	reply func(r recorded) int
}

func newHeaderReceiver(t *testing.T, reply func(r recorded) int) *headerReceiver {
	rc := &headerReceiver{reply: reply}
	rc.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		r := recorded{Header: req.Header.Clone(), Body: body}
		rc.mu.Lock()
		rc.reqs = append(rc.reqs, r)
		rc.mu.Unlock()
		status := http.StatusNoContent
		if rc.reply != nil {
			status = rc.reply(r)
		}
		w.WriteHeader(status)
	}))
	t.Cleanup(rc.Close)
	return rc
}

// requests returns the requests for event key so far (by webhook-id, which
// a replay suffixes).
func (rc *headerReceiver) requests(key string) []recorded {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	var out []recorded
	for _, r := range rc.reqs {
		if id := r.Header.Get("webhook-id"); id == key || strings.HasPrefix(id, key+"~r") {
			out = append(out, r)
		}
	}
	return out
}

// otlpReceiver is an OTLP/HTTP trace endpoint (POST /v1/traces, protobuf)
// that keeps the spans it receives, with their resource's service.name.
type otlpReceiver struct {
	*httptest.Server
	mu       sync.Mutex
	spans    []*tracepb.Span
	services []string
}

func newOTLPReceiver(t *testing.T) *otlpReceiver {
	rc := &otlpReceiver{}
	rc.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodPost || req.URL.Path != "/v1/traces" || req.Header.Get("Content-Type") != "application/x-protobuf" {
			t.Errorf("OTLP request %s %s (%s)", req.Method, req.URL.Path, req.Header.Get("Content-Type"))
			http.Error(w, "unexpected request", http.StatusBadRequest)
			return
		}
		var body io.Reader = req.Body
		if req.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(req.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = zr
		}
		raw, err := io.ReadAll(body)
		var export coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(raw, &export)
		}
		if err != nil {
			t.Errorf("OTLP request body: %v", err)
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		rc.mu.Lock()
		for _, rs := range export.ResourceSpans {
			service := ""
			for _, kv := range rs.GetResource().GetAttributes() {
				if kv.Key == "service.name" {
					service = kv.GetValue().GetStringValue()
				}
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					rc.spans = append(rc.spans, s)
					rc.services = append(rc.services, service)
				}
			}
		}
		rc.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.Write(out)
	}))
	t.Cleanup(rc.Close)
	return rc
}

// span is what the tests check of one received span.
type span struct {
	Name, Service         string
	Kind                  tracepb.Span_SpanKind
	TraceID, ParentSpanID string // hex
	Sink, Outcome, Key    string
	Attempt, Replay       int64
	StatusError           bool
	StatusMessage         string
}

func (rc *otlpReceiver) received() []span {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	out := make([]span, len(rc.spans))
	for i, s := range rc.spans {
		sp := span{Name: s.Name, Service: rc.services[i], Kind: s.Kind,
			TraceID: hex.EncodeToString(s.TraceId), ParentSpanID: hex.EncodeToString(s.ParentSpanId),
			StatusError: s.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR, StatusMessage: s.GetStatus().GetMessage()}
		for _, kv := range s.Attributes {
			switch kv.Key {
			case "outbox_relay.sink":
				sp.Sink = kv.GetValue().GetStringValue()
			case "outbox_relay.outcome":
				sp.Outcome = kv.GetValue().GetStringValue()
			case "outbox_relay.event_key":
				sp.Key = kv.GetValue().GetStringValue()
			case "outbox_relay.attempt":
				sp.Attempt = kv.GetValue().GetIntValue()
			case "outbox_relay.replay":
				sp.Replay = kv.GetValue().GetIntValue()
			}
		}
		out[i] = sp
	}
	return out
}

// ecosystemConfig writes a relay config with a NATS and a webhook sink,
// each with the extra YAML sinkExtra; a failed attempt goes to the claim
// path at once and is retried there after a second.
func (s *setup) ecosystemConfig(t *testing.T, hookURL, sinkExtra string) string {
	t.Helper()
	path := filepath.Join(s.dir, "relay.yaml")
	cfg := fmt.Sprintf(`database_url: %q
data_dir: %q
delivery:
  inline_attempts: 1
  backoff: [1s]
sinks:
  - name: nats
    type: nats
    url: %s
%s
  - name: hook
    type: webhook
    url: %s
%s
log: {level: debug, format: json}
shutdown_timeout: 10s
http: {listen: "127.0.0.1:0"}
`, s.url, filepath.Join(s.dir, "data"), s.nats.URL(), sinkExtra, hookURL, sinkExtra)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// messagesOf returns the stored messages of the OUTBOX stream whose
// Outbox-Event-Key is key.
func messagesOf(t *testing.T, srv *natstest.Server, key string) []jetstream.Msg {
	t.Helper()
	var out []jetstream.Msg
	forEachOutboxMessage(t, srv, func(m jetstream.Msg) {
		if m.Headers().Get("Outbox-Event-Key") == key {
			out = append(out, m)
		}
	})
	return out
}

// replay runs `outbox-relay replay --ids <id of key> --yes` once the row is
// done, so the claim path delivers it again to every sink.
func (s *setup) replay(t *testing.T, cfgPath, key string) {
	t.Helper()
	eventually(t, 30*time.Second, key+" done", func() bool {
		return s.doneRows(t, "o.event_key = '"+strings.ReplaceAll(key, "'", "''")+"'") == 1
	})
	id := s.scalar(t, "SELECT id FROM integration_outbox WHERE event_key = $1", key)
	var out, errOut bytes.Buffer
	if code := Execute(context.Background(), []string{"replay", "--config", cfgPath, "--ids", fmt.Sprint(id), "--yes"}, &out, &errOut); code != 0 {
		t.Fatalf("replay: exit %d\n%s%s", code, out.String(), errOut.String())
	}
}

// TestTraceContext_EndToEnd: an application attaches a W3C trace context
// with outbox_publish; the webhook and NATS receive its traceparent and
// tracestate unchanged on the first attempt, on the retry the claim path
// makes after the receiver failed it, and on an operator replay; an invalid
// trace context is dropped and the event still delivered. With
// OTEL_EXPORTER_OTLP_ENDPOINT set, an OTLP receiver gets a span per attempt
// whose parent is the producer's span, with sink, attempt and outcome.
func TestTraceContext_EndToEnd(t *testing.T) {
	otlp := newOTLPReceiver(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.URL)
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
	t.Setenv("OTEL_SERVICE_NAME", "")

	const (
		traceID    = "4bf92f3577b34da6a3ce929d0e0e4736"
		parentID   = "00f067aa0ba902b7"
		tp         = "00-" + traceID + "-" + parentID + "-01"
		tracestate = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
	)
	s := newSetup(t, pgtest.NewDatabase(t))
	var failedOnce sync.Once
	hook := newHeaderReceiver(t, func(r recorded) int {
		status := http.StatusNoContent
		if r.Header.Get("webhook-id") == "traced" {
			failedOnce.Do(func() { status = http.StatusServiceUnavailable })
		}
		return status
	})
	cfgPath := s.ecosystemConfig(t, hook.URL, "")
	s.startInProcess(t, cfgPath)
	s.waitSlot(t)

	ctx := context.Background()
	publish := func(key string, traceContext any) {
		t.Helper()
		var res string
		if err := s.pool.QueryRow(ctx, `SELECT outbox_publish('order.placed', 'order', '42', $1, '{"n": 1}', $2::jsonb)`, key, traceContext).Scan(&res); err != nil || res != "inserted" {
			t.Fatalf("publish %s: %q %v", key, res, err)
		}
	}
	publish("traced", fmt.Sprintf(`{"traceparent": %q, "tracestate": %q}`, tp, tracestate))
	publish("bad-trace", `{"traceparent": "00-not-a-trace-01"}`)
	publish("untraced", nil)
	if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', '43', 'five-args', '{}')`); err != nil {
		t.Fatal(err)
	}

	eventually(t, 30*time.Second, "every event at the webhook (traced twice) and in NATS", func() bool {
		return len(hook.requests("traced")) == 2 && len(hook.requests("bad-trace")) == 1 && len(hook.requests("untraced")) == 1 &&
			len(hook.requests("five-args")) == 1 && len(messagesOf(t, s.nats, "traced")) == 1 &&
			len(messagesOf(t, s.nats, "bad-trace")) == 1 && len(messagesOf(t, s.nats, "untraced")) == 1
	})
	// The retry was the claim path's: the stream diverted the event.
	if n := s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE event_key = 'traced' AND handoff_at IS NOT NULL"); n != 1 {
		t.Fatalf("the traced event was not diverted to the claim path (%d)", n)
	}
	s.replay(t, cfgPath, "traced")
	eventually(t, 30*time.Second, "the replay at both sinks", func() bool {
		return len(hook.requests("traced")) == 3 && len(messagesOf(t, s.nats, "traced")) == 2
	})

	// The headers: the same on the first attempt, the retry and the replay.
	reqs := hook.requests("traced")
	if reqs[2].Header.Get("webhook-id") != "traced~r1" {
		t.Fatalf("third request %q, want the replay", reqs[2].Header.Get("webhook-id"))
	}
	for i, r := range reqs {
		if got := r.Header.Values("traceparent"); len(got) != 1 || got[0] != tp || r.Header.Get("tracestate") != tracestate {
			t.Errorf("webhook request %d (attempt %s): traceparent %q tracestate %q", i, r.Header.Get("webhook-attempt"), r.Header.Values("traceparent"), r.Header.Get("tracestate"))
		}
	}
	for i, m := range messagesOf(t, s.nats, "traced") {
		if m.Headers().Get("traceparent") != tp || m.Headers().Get("tracestate") != tracestate {
			t.Errorf("NATS message %d (%s): traceparent %q tracestate %q", i, m.Headers().Get("Nats-Msg-Id"), m.Headers().Get("traceparent"), m.Headers().Get("tracestate"))
		}
	}
	for _, key := range []string{"bad-trace", "untraced", "five-args"} {
		if h := hook.requests(key)[0].Header; h.Get("traceparent") != "" || h.Get("tracestate") != "" {
			t.Errorf("%s: webhook got traceparent %q", key, h.Get("traceparent"))
		}
	}
	for _, key := range []string{"bad-trace", "untraced"} {
		if h := messagesOf(t, s.nats, key)[0].Headers(); h.Get("traceparent") != "" {
			t.Errorf("%s: NATS got traceparent %q", key, h.Get("traceparent"))
		}
	}

	// The spans: children of the producer's span, one per attempt.
	want := []struct {
		sink, outcome string
		replay        int64
	}{{"hook", "transient", 0}, {"hook", "delivered", 0}, {"hook", "delivered", 1}, {"nats", "delivered", 0}, {"nats", "delivered", 1}}
	var traced []span
	eventually(t, 20*time.Second, "the spans of the traced event", func() bool {
		traced = traced[:0]
		for _, sp := range otlp.received() {
			if sp.Key == "traced" {
				traced = append(traced, sp)
			}
		}
		return len(traced) >= len(want)
	})
	if len(traced) != len(want) {
		t.Fatalf("%d spans for the traced event, want %d: %+v", len(traced), len(want), traced)
	}
	for _, w := range want {
		i := slices.IndexFunc(traced, func(sp span) bool { return sp.Sink == w.sink && sp.Outcome == w.outcome && sp.Replay == w.replay })
		if i < 0 {
			t.Errorf("no span with sink %s outcome %s replay %d: %+v", w.sink, w.outcome, w.replay, traced)
			continue
		}
		sp := traced[i]
		if sp.TraceID != traceID || sp.ParentSpanID != parentID {
			t.Errorf("span %+v: trace %s parent %s, want the producer's %s %s", sp, sp.TraceID, sp.ParentSpanID, traceID, parentID)
		}
		if sp.Name != "deliver "+w.sink || sp.Kind != tracepb.Span_SPAN_KIND_PRODUCER || sp.Service != "outbox-relay" || sp.Attempt < 1 {
			t.Errorf("span %+v: want name %q, kind producer, service outbox-relay, an attempt", sp, "deliver "+w.sink)
		}
		if w.outcome == "transient" && (!sp.StatusError || !strings.Contains(sp.StatusMessage, "503")) {
			t.Errorf("failed attempt's span %+v: want status Error with the 503", sp)
		}
	}
	if i := slices.IndexFunc(traced, func(sp span) bool { return sp.Sink == "hook" && sp.Outcome == "transient" }); i >= 0 && traced[i].Attempt != 1 {
		t.Errorf("the failed attempt's span has attempt %d, want 1", traced[i].Attempt)
	}
	// Events without a (valid) trace context get root spans.
	for _, key := range []string{"bad-trace", "untraced", "five-args"} {
		i := slices.IndexFunc(otlp.received(), func(sp span) bool { return sp.Key == key })
		if i < 0 {
			t.Errorf("no span for %s", key)
			continue
		}
		if sp := otlp.received()[i]; sp.ParentSpanID != "" || sp.TraceID == traceID {
			t.Errorf("%s: span %+v, want a root span of a new trace", key, sp)
		}
	}
}

// TestCloudEvents_EndToEnd: with format: cloudevents, a webhook receiver
// and a NATS consumer decode each event with the CloudEvents SDK and get
// every attribute: the stream path's ce-time is the commit time, the claim
// path's (a replay) created_at; ce-id is the delivery id of each sink; the
// data is the payload. An event without a type is dead-lettered.
func TestCloudEvents_EndToEnd(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	hook := newHeaderReceiver(t, nil)
	cfgPath := s.ecosystemConfig(t, hook.URL, "    format: cloudevents")
	s.startInProcess(t, cfgPath)
	s.waitSlot(t)

	ctx := context.Background()
	// The commit comes at least 50 ms after created_at (now(): the
	// transaction's start).
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', '42', 'ce-1', '{"total": 12.50, "items": ["a"]}')`); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT outbox_publish(NULL, 'order', '43', 'ce-untyped', '{}')`); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT pg_sleep(0.05)"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var (
		database, payload string
		created           time.Time
	)
	if err := s.pool.QueryRow(ctx, `SELECT current_database(), payload::text, created_at FROM integration_outbox WHERE event_key = 'ce-1'`).Scan(&database, &payload, &created); err != nil {
		t.Fatal(err)
	}
	source := "/" + database + "/public/integration_outbox"

	type attrs struct {
		specVersion, id, source, typ, subject, contentType string
		time                                               time.Time
		data                                               string
	}
	check := func(where string, got attrs, id string, commit bool) {
		t.Helper()
		wantTime := "created_at " + created.String()
		timeOK := got.time.Equal(created)
		if commit {
			wantTime = "the commit time, 50 ms to 10 s after created_at " + created.String()
			timeOK = got.time.Sub(created) >= 50*time.Millisecond && got.time.Sub(created) < 10*time.Second
		}
		if got.specVersion != "1.0" || got.id != id || got.source != source || got.typ != "order.placed" || got.subject != "order/42" ||
			got.contentType != "application/json" || got.data != payload || !timeOK {
			t.Errorf("%s: %+v;\nwant specversion 1.0, id %q, source %q, type order.placed, subject order/42, datacontenttype application/json, data %s, time %s",
				where, got, id, source, payload, wantTime)
		}
	}
	fromHTTP := func(r recorded) attrs {
		t.Helper()
		msg := cehttp.NewMessage(r.Header, io.NopCloser(bytes.NewReader(r.Body)))
		if enc := msg.ReadEncoding(); enc != binding.EncodingBinary {
			t.Fatalf("webhook request encoding %v, want binary", enc)
		}
		ev, err := binding.ToEvent(ctx, msg)
		if err == nil {
			err = ev.Validate()
		}
		if err != nil {
			t.Fatalf("the CloudEvents SDK cannot read the webhook request: %v (%v)", err, r.Header)
		}
		return attrs{ev.SpecVersion(), ev.ID(), ev.Source(), ev.Type(), ev.Subject(), ev.DataContentType(), ev.Time(), string(ev.Data())}
	}
	fromNATS := func(m jetstream.Msg) attrs {
		t.Helper()
		ev, err := natstest.ReadCloudEvent(m.Headers(), m.Data())
		if err != nil {
			t.Fatalf("the NATS message is not a valid CloudEvent: %v (%v)", err, m.Headers())
		}
		return attrs{ev.SpecVersion(), ev.ID(), ev.Source(), ev.Type(), ev.Subject(), ev.DataContentType(), ev.Time(), string(ev.Data())}
	}

	eventually(t, 30*time.Second, "the event at both sinks", func() bool {
		return len(hook.requests("ce-1")) == 1 && len(messagesOf(t, s.nats, "ce-1")) == 1
	})
	check("webhook, stream path", fromHTTP(hook.requests("ce-1")[0]), "ce-1", true)
	// NATS's ce-id is its Nats-Msg-Id, scoped by the deployment.
	scope := s.deployment(t).ID + ":"
	check("NATS, stream path", fromNATS(messagesOf(t, s.nats, "ce-1")[0]), scope+"ce-1", true)

	s.replay(t, cfgPath, "ce-1")
	eventually(t, 30*time.Second, "the replay at both sinks", func() bool {
		return len(hook.requests("ce-1")) == 2 && len(messagesOf(t, s.nats, "ce-1")) == 2
	})
	replayed := hook.requests("ce-1")[1]
	check("webhook, replay (claim path)", fromHTTP(replayed), replayed.Header.Get("webhook-id"), false)
	if replayed.Header.Get("webhook-id") != "ce-1~r1" {
		t.Errorf("replay webhook-id %q", replayed.Header.Get("webhook-id"))
	}
	m := messagesOf(t, s.nats, "ce-1")[1]
	check("NATS, replay (claim path)", fromNATS(m), scope+"ce-1~r1", false)
	if natsIdemKey(m.Headers()) != "ce-1~r1" {
		t.Errorf("replay Nats-Msg-Id %q, want ce-1~r1 scoped by the deployment", m.Headers().Get("Nats-Msg-Id"))
	}

	// No type, no CloudEvent: dead-lettered, naming the attribute.
	eventually(t, 30*time.Second, "the untyped event dead-lettered", func() bool {
		return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE event_key = 'ce-untyped' AND status = 'failed' AND last_error LIKE '%ce-type%'`) == 1
	})
	if n := len(hook.requests("ce-untyped")); n != 0 {
		t.Errorf("the untyped event reached the webhook %d times", n)
	}
}

// TestNewTracerProvider: nothing is exported unless the standard
// environment names an OTLP endpoint; OTEL_SDK_DISABLED and another
// OTEL_TRACES_EXPORTER turn it off; a protocol other than http/protobuf is
// refused with the fix.
func TestNewTracerProvider(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		want    bool
		wantErr string
	}{
		{"default: nothing", nil, false, ""},
		{"endpoint", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, true, ""},
		{"traces endpoint", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, true, ""},
		{"http/protobuf", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, true, ""},
		{"SDK disabled", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}, false, ""},
		{"exporter none", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"}, false, ""},
		{"grpc", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, false, "http/protobuf only"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, k := range []string{envOTLPEndpoint, envOTLPTracesEndpoint, envOTLPProtocol, envOTLPTracesProtocol, envSDKDisabled, envTracesExporter} {
				t.Setenv(k, tt.env[k])
			}
			tp, err := newTracerProvider(context.Background(), zerolog.Nop())
			if tp != nil {
				defer tp.Shutdown(context.Background())
			}
			if (tp != nil) != tt.want || tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("provider %v, err %v; want a provider %v, error %q", tp != nil, err, tt.want, tt.wantErr)
			}
		})
	}
	if got := redactEndpoint("https://user:pw@collector:4318/v1/traces?token=x"); got != "https://collector:4318/v1/traces" {
		t.Errorf("redactEndpoint: %q", got)
	}
}
