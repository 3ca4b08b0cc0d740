package nats_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

const (
	traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	tracestate  = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
	ceSource    = "/shop/public/integration_outbox"
)

// TestTraceHeaders: the producer's traceparent and tracestate are message
// headers, the same on a retry and on a replay; an event without trace
// context has neither.
func TestTraceHeaders(t *testing.T) {
	srv := natstest.Start(t)
	s := MustNew(t, testConfig(srv))
	js := MustJetStream(t, srv)

	tc, err := relay.ParseTraceContext([]byte(`{"traceparent": "` + traceparent + `", "tracestate": "` + tracestate + `"}`))
	if err != nil {
		t.Fatal(err)
	}
	d := delivery(1)
	d.Event.Trace = tc
	for _, attempt := range []struct{ attempt, replay int }{{1, 0}, {2, 0}, {1, 1}} {
		d.Attempt, d.Replay = attempt.attempt, attempt.replay
		if err := sendSync(t, s, d); err != nil {
			t.Fatal(err)
		}
	}
	if err := sendSync(t, s, delivery(2)); err != nil {
		t.Fatal(err)
	}
	msgs := stored(t, js, testStream)
	if len(msgs) != 3 { // the retry was a duplicate
		t.Fatalf("%d messages stored, want 3", len(msgs))
	}
	for i, m := range msgs[:2] {
		if got := m.Headers().Values(natssink.HeaderTraceparent); len(got) != 1 || got[0] != traceparent {
			t.Errorf("message %d: traceparent %q", i, got)
		}
		if got := m.Headers().Values(natssink.HeaderTracestate); len(got) != 1 || got[0] != tracestate {
			t.Errorf("message %d: tracestate %q", i, got)
		}
	}
	if h := msgs[2].Headers(); h.Get(natssink.HeaderTraceparent) != "" || h.Get(natssink.HeaderTracestate) != "" {
		t.Errorf("an event without trace context has %v", h)
	}
}

// TestCloudEvents decodes what a consumer reads from the stream as
// CloudEvents and checks every attribute, on both paths and for a replay.
func TestCloudEvents(t *testing.T) {
	srv := natstest.Start(t)
	cfg := testConfig(srv)
	cfg.Format, cfg.CloudEventsSource = natssink.FormatCloudEvents, ceSource
	s := MustNew(t, cfg)
	js := MustJetStream(t, srv)

	stream := delivery(1)
	stream.Event.CommitTime = time.Date(2026, 3, 1, 12, 0, 0, 200001000, time.UTC)
	claim := delivery(2) // the claim path does not know the commit time
	replay := delivery(2)
	replay.Replay = 1
	bare := delivery(3)
	bare.Event.AggregateType, bare.Event.AggregateID, bare.Event.Payload, bare.Event.CreatedAt = nil, nil, nil, time.Time{}
	bare.Event.EventKey = "evt 3 ü" // sent verbatim as the Msg-Id; percent-encoded as ce-id
	tests := []struct {
		name    string
		d       *relay.Delivery
		subject string
		time    time.Time
		data    string
	}{
		{"stream", stream, "order/O-1", stream.Event.CommitTime, string(stream.Event.Payload)},
		{"claim path: created_at", claim, "order/O-2", claim.Event.CreatedAt, string(claim.Event.Payload)},
		{"replay", replay, "order/O-2", replay.Event.CreatedAt, string(replay.Event.Payload)},
		{"no aggregate, time or payload", bare, "", time.Time{}, "null"},
	}
	for _, tt := range tests {
		if err := sendSync(t, s, tt.d); err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
	}
	msgs := stored(t, js, testStream)
	if len(msgs) != len(tests) {
		t.Fatalf("%d messages stored, want %d", len(msgs), len(tests))
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := msgs[i]
			ev, err := natstest.ReadCloudEvent(m.Headers(), m.Data())
			if err != nil {
				t.Fatalf("not a valid binary-mode CloudEvent: %v (headers %v)", err, m.Headers())
			}
			msgID := m.Headers().Get(jetstream.MsgIDHeader)
			if ev.SpecVersion() != "1.0" || ev.ID() != msgID || ev.Source() != ceSource || ev.Type() != "order.placed" ||
				ev.Subject() != tt.subject || ev.DataContentType() != "application/json" || !ev.Time().Equal(tt.time) || string(ev.Data()) != tt.data {
				t.Fatalf("got specversion %q id %q (Nats-Msg-Id %q) source %q type %q subject %q datacontenttype %q time %v data %s;\nwant 1.0, the Msg-Id, %q order.placed %q application/json %v %s",
					ev.SpecVersion(), ev.ID(), msgID, ev.Source(), ev.Type(), ev.Subject(), ev.DataContentType(), ev.Time(), ev.Data(),
					ceSource, tt.subject, tt.time, tt.data)
			}
			if tt.d.Replay > 0 && !strings.HasSuffix(ev.ID(), "~r1") {
				t.Errorf("replay id %q", ev.ID())
			}
			if m.Headers().Get(natssink.HeaderEventKey) == "" || m.Headers().Get("Content-Type") != "" {
				t.Errorf("headers %v: want the Outbox- headers and no Content-Type (which would mean structured mode)", m.Headers())
			}
		})
	}
}

// TestCloudEventsNoType: an event without a type cannot be a CloudEvent: it
// is Permanent, and nothing is published.
func TestCloudEventsNoType(t *testing.T) {
	srv := natstest.Start(t)
	cfg := testConfig(srv)
	cfg.Format, cfg.CloudEventsSource = natssink.FormatCloudEvents, ceSource
	s := MustNew(t, cfg)
	d := delivery(1)
	d.Event.EventType = nil
	err := sendSync(t, s, d)
	if class(err) != relay.Permanent || !errors.Is(err, relay.ErrNoEventType) {
		t.Fatalf("err = %v, want Permanent wrapping ErrNoEventType", err)
	}
}

func TestFormatConfig(t *testing.T) {
	tests := []struct {
		name   string
		format string
		source string
		want   string
	}{
		{"cloudevents without a source", natssink.FormatCloudEvents, "", "needs a source"},
		{"a source with the envelope", "", ceSource, "only used with format cloudevents"},
		{"unknown format", "xml", "", `format "xml"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := natssink.New(context.Background(), natssink.Config{Name: "n", URL: "nats://127.0.0.1:1", Deployment: testDeployment, Format: tt.format, CloudEventsSource: tt.source})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want %q", err, tt.want)
			}
		})
	}
}
