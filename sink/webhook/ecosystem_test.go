package webhook_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

const (
	traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	tracestate  = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
	ceSource    = "/shop/public/integration_outbox"
)

func mustTrace(tb testing.TB, raw string) relay.TraceHeaders {
	tb.Helper()
	h, err := relay.ParseTraceContext([]byte(raw))
	if err != nil {
		tb.Fatal(err)
	}
	return h
}

// TestTraceHeaders: the producer's traceparent and tracestate go out as
// stored, the same on a retry and on a replay; an event without trace
// context has neither header.
func TestTraceHeaders(t *testing.T) {
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL})

	d := newDelivery("k1", `{"a":1}`)
	d.Event.Trace = mustTrace(t, `{"traceparent": "`+traceparent+`", "tracestate": "`+tracestate+`"}`)
	for _, attempt := range []struct{ attempt, replay int }{{1, 0}, {2, 0}, {1, 1}} {
		d.Attempt, d.Replay = attempt.attempt, attempt.replay
		if err := send(t, s, d); err != nil {
			t.Fatal(err)
		}
	}
	if err := send(t, s, newDelivery("k2", `{}`)); err != nil {
		t.Fatal(err)
	}
	reqs := rc.Requests()
	for i, r := range reqs[:3] {
		if got := r.Header.Values("traceparent"); len(got) != 1 || got[0] != traceparent {
			t.Errorf("request %d: traceparent %q", i, got)
		}
		if got := r.Header.Values("tracestate"); len(got) != 1 || got[0] != tracestate {
			t.Errorf("request %d: tracestate %q", i, got)
		}
	}
	if reqs[3].Header.Get("traceparent") != "" || reqs[3].Header.Get("tracestate") != "" {
		t.Errorf("an event without trace context sent %q %q", reqs[3].Header.Get("traceparent"), reqs[3].Header.Get("tracestate"))
	}
}

// ceEvent is an event as the stream decodes it, with every attribute.
func ceEvent() *relay.Event {
	typ, aggType, aggID := "order.placed", "order", "42"
	return &relay.Event{
		ID: 7, EventKey: "order-42-placed", EventType: &typ, AggregateType: &aggType, AggregateID: &aggID,
		Payload:    []byte(`{"total": 12.50, "items": ["a"]}`),
		CreatedAt:  time.Date(2026, 12, 2, 16, 17, 36, 123456000, time.UTC),
		CommitTime: time.Date(2026, 12, 2, 16, 17, 36, 200001000, time.UTC),
	}
}

// decodeCloudEvent reads a request the way a receiver using the CloudEvents
// Go SDK does.
func decodeCloudEvent(t *testing.T, r request) (specVersion, id, source, typ, subject, contentType string, tm time.Time, data []byte) {
	t.Helper()
	msg := cehttp.NewMessage(r.Header, io.NopCloser(bytes.NewReader(r.Body)))
	if enc := msg.ReadEncoding(); enc != binding.EncodingBinary {
		t.Fatalf("encoding %v, want binary", enc)
	}
	ev, err := binding.ToEvent(context.Background(), msg)
	if err != nil {
		t.Fatalf("the CloudEvents SDK cannot read the request: %v", err)
	}
	if err := ev.Validate(); err != nil {
		t.Fatalf("invalid CloudEvent: %v", err)
	}
	return ev.SpecVersion(), ev.ID(), ev.Source(), ev.Type(), ev.Subject(), ev.DataContentType(), ev.Time(), ev.Data()
}

// TestCloudEvents decodes what the receiver gets with the CloudEvents SDK
// and checks every attribute, on both paths and for a replay.
func TestCloudEvents(t *testing.T) {
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Format: webhook.FormatCloudEvents, CloudEventsSource: ceSource,
		Headers: map[string]string{"ce-tenant": "acme"}})

	stream := ceEvent()
	claim := ceEvent()
	claim.CommitTime = time.Time{} // the claim path does not know it
	bare := ceEvent()
	bare.AggregateType, bare.AggregateID, bare.Payload, bare.CommitTime, bare.CreatedAt = nil, nil, nil, time.Time{}, time.Time{}
	tests := []struct {
		name    string
		d       *relay.Delivery
		id      string
		subject string
		time    time.Time
		data    string
	}{
		{"stream", &relay.Delivery{Event: stream, Body: []byte("envelope"), Attempt: 1}, "order-42-placed", "order/42", stream.CommitTime, string(stream.Payload)},
		{"claim path: created_at", &relay.Delivery{Event: claim, Body: []byte("envelope"), Attempt: 3}, "order-42-placed", "order/42", claim.CreatedAt, string(claim.Payload)},
		{"replay: the replay's id", &relay.Delivery{Event: claim, Body: []byte("envelope"), Attempt: 1, Replay: 2}, "order-42-placed~r2", "order/42", claim.CreatedAt, string(claim.Payload)},
		{"no aggregate, time or payload", &relay.Delivery{Event: bare, Body: []byte("envelope"), Attempt: 1}, "order-42-placed", "", time.Time{}, "null"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := send(t, s, tt.d); err != nil {
				t.Fatal(err)
			}
			r := rc.Requests()[i]
			specVersion, id, source, typ, subject, contentType, tm, data := decodeCloudEvent(t, r)
			if specVersion != "1.0" || id != tt.id || id != r.Header.Get("webhook-id") || source != ceSource || typ != "order.placed" ||
				subject != tt.subject || contentType != "application/json" || !tm.Equal(tt.time) || string(data) != tt.data {
				t.Fatalf("got specversion %q id %q (webhook-id %q) source %q type %q subject %q datacontenttype %q time %v data %s;\nwant 1.0 %q %q order.placed %q application/json %v %s",
					specVersion, id, r.Header.Get("webhook-id"), source, typ, subject, contentType, tm, data,
					tt.id, ceSource, tt.subject, tt.time, tt.data)
			}
			if r.Header.Get("ce-tenant") != "acme" {
				t.Errorf("a configured ce- header (an extension attribute) is missing: %v", r.Header)
			}
			if tt.subject == "" && r.Header.Get("ce-subject") != "" || tt.time.IsZero() && r.Header.Get("ce-time") != "" {
				t.Errorf("attributes without a value were sent: %v", r.Header)
			}
		})
	}
}

// TestCloudEventsPercentEncoding: attribute values that are not printable
// ASCII without space, '"' or '%' are percent-encoded, as the HTTP binding
// requires, and a conforming receiver decodes them back.
func TestCloudEventsPercentEncoding(t *testing.T) {
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Format: webhook.FormatCloudEvents, CloudEventsSource: "/my db/outbox"})
	ev := ceEvent()
	typ, aggID := `order "placed" 100%`, "Euro € 😀"
	ev.EventType, ev.AggregateID = &typ, &aggID
	if err := send(t, s, &relay.Delivery{Event: ev, Body: []byte("x"), Attempt: 1}); err != nil {
		t.Fatal(err)
	}
	h := rc.Requests()[0].Header
	for name, want := range map[string]string{
		"ce-type":    "order%20%22placed%22%20100%25",
		"ce-subject": "order/Euro%20%E2%82%AC%20%F0%9F%98%80",
		"ce-source":  "/my%20db/outbox",
	} {
		if got := h.Get(name); got != want {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
	}
	for name, want := range map[string]string{"ce-type": typ, "ce-subject": "order/" + aggID} {
		if got, err := url.PathUnescape(h.Get(name)); err != nil || got != want {
			t.Errorf("%s decodes to %q (%v), want %q", name, got, err, want)
		}
	}
}

// TestCloudEventsNoType: an event without a type cannot be a CloudEvent: it
// is Permanent, and nothing is sent.
func TestCloudEventsNoType(t *testing.T) {
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Format: webhook.FormatCloudEvents, CloudEventsSource: ceSource})
	ev := ceEvent()
	ev.EventType = nil
	err := send(t, s, &relay.Delivery{Event: ev, Body: []byte("x"), Attempt: 1})
	if class, _ := relay.Classify(err); class != relay.Permanent || !errors.Is(err, relay.ErrNoEventType) {
		t.Fatalf("err = %v, want Permanent wrapping ErrNoEventType", err)
	}
	if n := len(rc.Requests()); n != 0 {
		t.Fatalf("%d requests sent", n)
	}
}

// TestCloudEventsSignsThePayload: with standard-webhooks auth the signature
// covers the body sent, the payload.
func TestCloudEventsSignsThePayload(t *testing.T) {
	rc := MustReceiver(t, nil)
	const secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	s := MustSink(t, webhook.Config{URL: rc.URL, Format: webhook.FormatCloudEvents, CloudEventsSource: ceSource,
		Auth: webhook.Auth{Type: webhook.AuthStandardWebhooks, Secret: secret}})
	ev := ceEvent()
	if err := send(t, s, &relay.Delivery{Event: ev, Body: []byte("envelope"), Attempt: 1}); err != nil {
		t.Fatal(err)
	}
	r := rc.Requests()[0]
	if string(r.Body) != string(ev.Payload) {
		t.Fatalf("body %s, want the payload", r.Body)
	}
	var ts int64
	for _, c := range r.Header.Get("webhook-timestamp") {
		ts = ts*10 + int64(c-'0')
	}
	want, err := webhook.Sign(secret, r.Header.Get("webhook-id"), ts, ev.Payload)
	if err != nil || r.Header.Get("webhook-signature") != want {
		t.Fatalf("signature %q, want %q (%v)", r.Header.Get("webhook-signature"), want, err)
	}
}

func TestFormatConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  webhook.Config
		want string // "" for no error
	}{
		{"envelope", webhook.Config{Format: webhook.FormatEnvelope}, ""},
		{"cloudevents", webhook.Config{Format: webhook.FormatCloudEvents, CloudEventsSource: ceSource}, ""},
		{"cloudevents without a source", webhook.Config{Format: webhook.FormatCloudEvents}, "needs a source"},
		{"a source with the envelope", webhook.Config{CloudEventsSource: ceSource}, "only used with format cloudevents"},
		{"unknown format", webhook.Config{Format: "xml"}, `format "xml"`},
		{"a ce- attribute the sink sets", webhook.Config{Format: webhook.FormatCloudEvents, CloudEventsSource: ceSource,
			Headers: map[string]string{"ce-type": "x"}}, "set by the sink"},
		{"an extension attribute", webhook.Config{Format: webhook.FormatCloudEvents, CloudEventsSource: ceSource,
			Headers: map[string]string{"ce-tenant": "x"}}, ""},
		{"traceparent is the event's", webhook.Config{Headers: map[string]string{"traceparent": "x"}}, "set by the sink"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.cfg.Name, tt.cfg.URL = "test", "http://127.0.0.1:1/"
			s, err := webhook.New(tt.cfg)
			if s != nil {
				defer s.Close(context.Background())
			}
			if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
				t.Fatalf("err = %v, want %q", err, tt.want)
			}
		})
	}
}
