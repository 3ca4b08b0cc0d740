package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Trace context (docs/ecosystem.md): an application may attach the W3C
// trace context of the request that wrote an event, in the outbox's
// trace_context column. The sinks forward it, unchanged on every attempt
// and replay, as traceparent and tracestate headers; with tracing on
// (TraceRoutes), every delivery attempt is a span whose parent is that
// context. This file uses only the OpenTelemetry API: the SDK and its
// exporter are the command's business.

// TraceHeaders is the W3C trace context of an event, as the sinks forward
// it. The zero value means none.
type TraceHeaders struct {
	// Traceparent is a valid traceparent, byte for byte as the application
	// stored it; "" when none.
	Traceparent string
	// Tracestate is the tracestate stored with it, when it is valid; ""
	// otherwise.
	Tracestate string

	parent trace.SpanContext // Traceparent parsed, remote
}

// SpanContext returns the producer's span context (remote), or an invalid
// one when there is no trace context.
func (h TraceHeaders) SpanContext() trace.SpanContext { return h.parent }

// traceCarrier is the trace_context column: the object an OpenTelemetry
// propagator fills (keys match in any case, as HTTP header names do).
type traceCarrier struct {
	Traceparent string `json:"traceparent"`
	Tracestate  string `json:"tracestate"`
}

// ParseTraceContext reads the trace_context column's text (jsonb), as W3C
// Trace Context says a receiver reads the two headers: a traceparent that is
// not valid is dropped, and its tracestate with it; a tracestate that is not
// valid is dropped alone. The error says what was dropped; the returned
// TraceHeaders hold what is left, which is always safe to send as header
// values. nil, JSON null and an object without traceparent or tracestate
// mean no trace context, which is not an error. Other keys (baggage, vendor
// headers) are ignored.
func ParseTraceContext(raw []byte) (TraceHeaders, error) {
	if raw == nil {
		return TraceHeaders{}, nil
	}
	var c traceCarrier
	if err := json.Unmarshal(raw, &c); err != nil {
		return TraceHeaders{}, fmt.Errorf("trace_context is not a JSON object of strings: %w", err)
	}
	switch {
	case c.Traceparent == "" && c.Tracestate == "":
		return TraceHeaders{}, nil
	case c.Traceparent == "":
		return TraceHeaders{}, errors.New("trace_context has a tracestate without a traceparent")
	}
	// The propagator checks the version, lower-case hex ids that are not
	// all zero, and the flags. A future version may carry more fields: it
	// is forwarded as stored, so it must also be a plain header token.
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(),
		propagation.MapCarrier{"traceparent": c.Traceparent}))
	if !sc.IsValid() || !headerToken(c.Traceparent) {
		return TraceHeaders{}, fmt.Errorf("trace_context: traceparent %q is not a valid W3C traceparent", ShortError(c.Traceparent))
	}
	h := TraceHeaders{Traceparent: c.Traceparent, parent: sc}
	if c.Tracestate != "" {
		ts, err := trace.ParseTraceState(c.Tracestate)
		if err != nil {
			return h, fmt.Errorf("trace_context: tracestate dropped: %w", err)
		}
		h.Tracestate = c.Tracestate
		h.parent = h.parent.WithTraceState(ts)
	}
	return h, nil
}

// headerToken reports whether s is printable ASCII without spaces.
func headerToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] >= 0x7f {
			return false
		}
	}
	return s != ""
}

// readTrace sets ev.Trace from ev.TraceContext once the engine takes the
// event. A bad value never stops a delivery: it is dropped and logged (see
// invalidTraceLog).
func (e *Engine) readTrace(ev *Event) {
	if ev.TraceContext == nil || ev.Trace.Traceparent != "" {
		return
	}
	h, err := ParseTraceContext(ev.TraceContext)
	ev.Trace = h
	if err != nil {
		invalidTraces.report(e, ev, err)
	}
}

// invalidTraceLog keeps bad trace contexts from flooding the log: the first
// is logged at once, then at most one line a minute with the count since.
type invalidTraceLog struct {
	mu      sync.Mutex
	last    time.Time
	dropped int
}

var invalidTraces invalidTraceLog

func (l *invalidTraceLog) report(e *Engine, ev *Event, err error) {
	l.mu.Lock()
	now := time.Now()
	if !l.last.IsZero() && now.Sub(l.last) < time.Minute {
		l.dropped++
		l.mu.Unlock()
		return
	}
	since := l.dropped
	l.last, l.dropped = now, 0
	l.mu.Unlock()
	e.log.Warn().Int64("id", ev.ID).Str("event_key", ev.EventKey).Str("error", ShortError(err.Error())).
		Int("more_since_last_report", since).
		Msg("invalid trace context dropped: the event is delivered without it (docs/ecosystem.md)")
}

// Span attribute keys of a delivery span (docs/ecosystem.md).
const (
	AttrSink      = attribute.Key("outbox_relay.sink")
	AttrOutcome   = attribute.Key("outbox_relay.outcome")
	AttrAttempt   = attribute.Key("outbox_relay.attempt")
	AttrEventKey  = attribute.Key("outbox_relay.event_key")
	AttrEventID   = attribute.Key("outbox_relay.event_id")
	AttrEventType = attribute.Key("outbox_relay.event_type")
	AttrReplay    = attribute.Key("outbox_relay.replay")
)

// OutcomeDelivered is the outcome attribute of a span whose attempt was
// acknowledged; a failed attempt's is its ErrorClass ("transient",
// "unknown", "permanent", "sink-down").
const OutcomeDelivered = "delivered"

// TraceRoutes returns routes whose sinks record a span for every delivery
// attempt with tp's tracer; see TracedSink. The Route fields are kept.
func TraceRoutes(routes []Route, tp trace.TracerProvider) []Route {
	tracer := tp.Tracer("github.com/outbox-relay/outbox-relay/relay")
	out := make([]Route, len(routes))
	for i, r := range routes {
		r.Sink = TracedSink(r.Sink, tracer)
		out[i] = r
	}
	return out
}

// TracedSink wraps s so that every Send is a span of tracer: named
// "deliver <sink>", of kind producer, a child of the event's trace context
// when it has one (a new trace otherwise), from the call to Send until s
// reports the outcome. It carries the sink, the attempt, the event's id, key
// and type and the replay number, and ends with the outcome: "delivered"
// or the error's class, with status Error and the error's text for a
// failure. The outcome of an attempt is what the engine decides on; the
// span does not change it.
func TracedSink(s Sink, tracer trace.Tracer) Sink {
	ts := &tracedSink{Sink: s, tracer: tracer}
	if rs, ok := s.(RunSink); ok {
		// A run's events keep one span each, as when sent alone.
		return &tracedRunSink{tracedSink: ts, runs: rs}
	}
	return ts
}

type tracedSink struct {
	Sink
	tracer trace.Tracer
}

func (s *tracedSink) Send(ctx context.Context, d *Delivery, done func(error)) {
	span := s.start(d)
	s.Sink.Send(ctx, d, func(err error) {
		end(span, err)
		done(err)
	})
}

// start starts d's span.
func (s *tracedSink) start(d *Delivery) trace.Span {
	ev := d.Event
	// Not the sender's context: the span's parent is the producer's.
	parent := context.Background()
	if sc := ev.Trace.parent; sc.IsValid() {
		parent = trace.ContextWithRemoteSpanContext(parent, sc)
	}
	attrs := []attribute.KeyValue{
		AttrSink.String(s.Name()),
		AttrAttempt.Int(d.Attempt),
		AttrEventID.Int64(ev.ID),
		AttrEventKey.String(ev.EventKey),
	}
	if ev.EventType != nil {
		attrs = append(attrs, AttrEventType.String(*ev.EventType))
	}
	if d.Replay > 0 {
		attrs = append(attrs, AttrReplay.Int(d.Replay))
	}
	_, span := s.tracer.Start(parent, "deliver "+s.Name(), trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
	return span
}

// end ends a delivery's span with its outcome.
func end(span trace.Span, err error) {
	if err == nil {
		span.SetAttributes(AttrOutcome.String(OutcomeDelivered))
	} else {
		class, _ := Classify(err)
		span.SetAttributes(AttrOutcome.String(class.String()))
		span.SetStatus(codes.Error, ShortError(err.Error()))
	}
	span.End()
}

// tracedRunSink is a traced RunSink.
var _ RunSink = (*tracedRunSink)(nil)

type tracedRunSink struct {
	*tracedSink
	runs RunSink
}

func (s *tracedRunSink) MaxRun() int { return s.runs.MaxRun() }
func (s *tracedRunSink) FitRun(ds []*Delivery, aggregates int) int {
	return s.runs.FitRun(ds, aggregates)
}

func (s *tracedRunSink) SendRun(ctx context.Context, ds []*Delivery, done func([]error)) {
	spans := make([]trace.Span, len(ds))
	for i, d := range ds {
		spans[i] = s.start(d)
	}
	s.runs.SendRun(ctx, ds, func(errs []error) {
		for i, span := range spans {
			var err error
			if i < len(errs) {
				err = errs[i]
			}
			end(span, err)
		}
		done(errs)
	})
}
