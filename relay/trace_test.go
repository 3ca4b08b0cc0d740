package relay_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-relay/outbox-relay/relay"
)

const (
	testTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	testTracestate  = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
)

func TestParseTraceContext(t *testing.T) {
	tests := []struct {
		name       string
		raw        string // "" for a NULL column
		parent     string // want Traceparent
		state      string // want Tracestate
		wantErr    bool
		wantParent bool // want a valid SpanContext
	}{
		{name: "NULL"},
		{name: "JSON null", raw: `null`},
		{name: "empty object", raw: `{}`},
		{name: "traceparent and tracestate", raw: `{"traceparent": "` + testTraceparent + `", "tracestate": "` + testTracestate + `"}`,
			parent: testTraceparent, state: testTracestate, wantParent: true},
		{name: "traceparent alone", raw: `{"traceparent": "` + testTraceparent + `"}`, parent: testTraceparent, wantParent: true},
		{name: "header-cased keys", raw: `{"Traceparent": "` + testTraceparent + `", "TRACESTATE": "a=b"}`,
			parent: testTraceparent, state: "a=b", wantParent: true},
		{name: "other keys ignored", raw: `{"traceparent": "` + testTraceparent + `", "baggage": "k=v"}`, parent: testTraceparent, wantParent: true},
		{name: "not sampled is still valid", raw: `{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"}`,
			parent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", wantParent: true},
		{name: "a future version with more fields is forwarded as is", raw: `{"traceparent": "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz"}`,
			parent: "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz", wantParent: true},
		{name: "upper-case hex", raw: `{"traceparent": "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"}`, wantErr: true},
		{name: "zero trace id", raw: `{"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}`, wantErr: true},
		{name: "zero parent id", raw: `{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"}`, wantErr: true},
		{name: "version ff", raw: `{"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`, wantErr: true},
		{name: "version 00 with more fields", raw: `{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz"}`, wantErr: true},
		{name: "short", raw: `{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"}`, wantErr: true},
		{name: "line break in a future version", raw: `{"traceparent": "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x\r\nX-Evil: 1"}`, wantErr: true},
		{name: "bad tracestate is dropped alone", raw: `{"traceparent": "` + testTraceparent + `", "tracestate": "not a list member"}`,
			parent: testTraceparent, wantErr: true, wantParent: true},
		{name: "line break in tracestate", raw: `{"traceparent": "` + testTraceparent + `", "tracestate": "a=b\r\nX-Evil: 1"}`,
			parent: testTraceparent, wantErr: true, wantParent: true},
		{name: "tracestate without traceparent", raw: `{"tracestate": "a=b"}`, wantErr: true},
		{name: "a bare traceparent string", raw: `"` + testTraceparent + `"`, wantErr: true},
		{name: "number", raw: `{"traceparent": 1}`, wantErr: true},
		{name: "array", raw: `[1]`, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var raw []byte
			if tt.raw != "" {
				raw = []byte(tt.raw)
			}
			h, err := relay.ParseTraceContext(raw)
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, want error %v", err, tt.wantErr)
			}
			if h.Traceparent != tt.parent || h.Tracestate != tt.state {
				t.Fatalf("got traceparent %q tracestate %q, want %q %q", h.Traceparent, h.Tracestate, tt.parent, tt.state)
			}
			if sc := h.SpanContext(); sc.IsValid() != tt.wantParent || (sc.IsValid() && !sc.IsRemote()) {
				t.Fatalf("span context valid=%v remote=%v, want valid=%v and remote", sc.IsValid(), sc.IsRemote(), tt.wantParent)
			}
		})
	}
}

// answeringSink answers every Send with the next error of its list.
type answeringSink struct {
	mu      sync.Mutex
	answers []error
}

func (s *answeringSink) Name() string { return "hook" }

func (s *answeringSink) Send(_ context.Context, _ *relay.Delivery, done func(error)) {
	s.mu.Lock()
	err := s.answers[0]
	s.answers = s.answers[1:]
	s.mu.Unlock()
	go done(err)
}

func (s *answeringSink) Close(context.Context) error { return nil }

// TestTracedSink: each attempt is a span, a child of the producer's trace
// context, with the sink, attempt and outcome; an event without a trace
// context gets a root span.
func TestTracedSink(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	sink := &answeringSink{answers: []error{relay.TransientError(errors.New("503 Service Unavailable"), 0), nil, nil}}
	routes := relay.TraceRoutes([]relay.Route{{Sink: sink, Events: []string{"order.*"}, Hold: true}}, tp)
	if len(routes) != 1 || routes[0].Sink.Name() != "hook" || !routes[0].Hold || routes[0].Events[0] != "order.*" {
		t.Fatalf("routes changed: %+v", routes)
	}
	traced := routes[0].Sink

	typ := "order.placed"
	h, err := relay.ParseTraceContext([]byte(`{"traceparent": "` + testTraceparent + `", "tracestate": "` + testTracestate + `"}`))
	if err != nil {
		t.Fatal(err)
	}
	ev := &relay.Event{ID: 7, EventKey: "k7", EventType: &typ, Trace: h}
	send := func(d *relay.Delivery) error {
		errc := make(chan error, 1)
		traced.Send(context.Background(), d, func(err error) { errc <- err })
		return <-errc
	}
	if err := send(&relay.Delivery{Event: ev, Attempt: 1}); err == nil {
		t.Fatal("the sink's error did not reach done")
	}
	if err := send(&relay.Delivery{Event: ev, Attempt: 2, Replay: 1}); err != nil {
		t.Fatal(err)
	}
	if err := send(&relay.Delivery{Event: &relay.Event{ID: 8, EventKey: "k8"}, Attempt: 1}); err != nil {
		t.Fatal(err)
	}

	spans := rec.Ended()
	if len(spans) != 3 {
		t.Fatalf("%d spans, want 3", len(spans))
	}
	want := []struct {
		outcome string
		attempt int64
		status  codes.Code
	}{{"transient", 1, codes.Error}, {relay.OutcomeDelivered, 2, codes.Unset}, {relay.OutcomeDelivered, 1, codes.Unset}}
	for i, s := range spans {
		attrs := map[attribute.Key]attribute.Value{}
		for _, kv := range s.Attributes() {
			attrs[kv.Key] = kv.Value
		}
		if s.Name() != "deliver hook" || s.SpanKind() != trace.SpanKindProducer {
			t.Errorf("span %d: name %q kind %v", i, s.Name(), s.SpanKind())
		}
		if attrs[relay.AttrSink].AsString() != "hook" || attrs[relay.AttrOutcome].AsString() != want[i].outcome ||
			attrs[relay.AttrAttempt].AsInt64() != want[i].attempt || s.Status().Code != want[i].status {
			t.Errorf("span %d: attributes %v status %v, want outcome %s attempt %d status %v", i, s.Attributes(), s.Status(), want[i].outcome, want[i].attempt, want[i].status)
		}
	}
	for _, s := range spans[:2] {
		if !s.Parent().Equal(h.SpanContext()) || !s.Parent().IsRemote() || s.SpanContext().TraceID() != h.SpanContext().TraceID() {
			t.Errorf("span %s: parent %v, want the producer's %v", s.Name(), s.Parent(), h.SpanContext())
		}
		if s.SpanContext().TraceState().String() != testTracestate {
			t.Errorf("tracestate %q not carried", s.SpanContext().TraceState())
		}
	}
	if spans[0].Status().Description != "transient: 503 Service Unavailable" {
		t.Errorf("status description %q", spans[0].Status().Description)
	}
	for _, kv := range spans[1].Attributes() {
		if kv.Key == relay.AttrReplay && kv.Value.AsInt64() != 1 {
			t.Errorf("replay attribute %v", kv.Value)
		}
	}
	if spans[2].Parent().IsValid() {
		t.Errorf("an event without trace context has parent %v, want a root span", spans[2].Parent())
	}
}

// TestTracedSinkKeepsRuns: a traced RunSink is still one (else tracing
// would turn a sink's ordered batches off), and each event of a run gets
// its own span with its own outcome.
func TestTracedSinkKeepsRuns(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	retry := relay.TransientError(errors.New("retry"), 0)
	sink := newFakeRunSink("hook", 10, func(req []*relay.Delivery) []error { return []error{nil, retry} })
	traced, ok := relay.TraceRoutes([]relay.Route{{Sink: sink}}, tp)[0].Sink.(relay.RunSink)
	if !ok || traced.MaxRun() != 10 {
		t.Fatalf("traced sink %T is not a RunSink with MaxRun 10", traced)
	}
	ds := []*relay.Delivery{{Event: event(1, "a"), Attempt: 1}, {Event: event(2, "a"), Attempt: 1}}
	if n := traced.FitRun(ds, 1); n != 2 {
		t.Fatalf("FitRun = %d, want 2", n)
	}
	errc := make(chan []error, 1)
	traced.SendRun(context.Background(), ds, func(errs []error) { errc <- errs })
	if errs := <-errc; len(errs) != 2 || errs[0] != nil || errs[1] != retry {
		t.Fatalf("outcomes %v, want the sink's", errs)
	}
	var outcomes []string
	for _, s := range rec.Ended() {
		for _, kv := range s.Attributes() {
			if kv.Key == relay.AttrOutcome {
				outcomes = append(outcomes, kv.Value.AsString())
			}
		}
	}
	if want := []string{relay.OutcomeDelivered, "transient"}; !slices.Equal(outcomes, want) {
		t.Errorf("span outcomes %v, want %v", outcomes, want)
	}
}
