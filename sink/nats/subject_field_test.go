package nats_test

import (
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// TestRenderSubjectByField: a subject may hold CEL actions over the
// payload (docs/sinks.md, "Routing by field"), each value sanitised into
// one token, beside text and bare fields.
func TestRenderSubjectByField(t *testing.T) {
	for _, tc := range []struct {
		name, template, payload, want string
	}{
		{"payload field", "orders.{{ payload.region }}.{{.EventType}}", `{"region": "eu"}`, "orders.eu.order_placed"},
		{"forbidden characters", "orders.{{ payload.region }}", `{"region": "eu west.1 *>"}`, "orders.eu_west_1___"},
		{"number", "orders.{{ payload.shard }}", `{"shard": 3}`, "orders.3"},
		{"expression", `orders.{{ payload.amount > 100 ? "big" : "small" }}`, `{"amount": 150}`, "orders.big"},
		{"empty value", "orders.{{ payload.region }}", `{"region": ""}`, "orders._"},
		{"nested, with a column", "x.{{ aggregate_type }}.{{ payload.customer.tier }}", `{"customer": {"tier": "gold"}}`, "x.order.gold"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := &relay.Event{EventKey: "k", EventType: ptr("order.placed"), AggregateType: ptr("order"), Payload: []byte(tc.payload)}
			got, err := natssink.RenderSubject(tc.template, ev)
			if err != nil || got != tc.want {
				t.Fatalf("subject %q, %v; want %q", got, err, tc.want)
			}
		})
	}
	pattern, err := natssink.SubjectPattern("orders.{{ payload.region }}.{{.EventType}}")
	if err != nil || pattern != "orders.*.*" {
		t.Fatalf("pattern %q, %v; want orders.*.*", pattern, err)
	}
}

// TestRenderSubjectByFieldErrors: an expression that does not compile
// fails at start; one that fails on an event, or a subject too long, is
// that event's error, naming the expression.
func TestRenderSubjectByFieldErrors(t *testing.T) {
	for _, tc := range []struct {
		name, template, payload, want string
	}{
		{"compile", "orders.{{ payload.region + }}", `{}`, "Syntax error"},
		{"undeclared", "orders.{{ payload.region + nope }}", `{}`, "undeclared reference to 'nope'"},
		{"template action beside", "orders.{{ payload.region }}.{{printf \"%s\" .EventType}}", `{}`, "only text and bare fields"},
		{"missing field", "orders.{{ payload.region }}", `{"zone": "eu"}`, "{{ payload.region }}: no such key: region"},
		{"a map", "orders.{{ payload.customer }}", `{"customer": {"tier": "gold"}}`, "not a string, number or bool"},
		{"too long", "orders.{{ payload.region }}", `{"region": "` + strings.Repeat("e", natssink.MaxSubjectLen) + `"}`, "more than 3072"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := &relay.Event{EventKey: "k", EventType: ptr("order.placed"), Payload: []byte(tc.payload)}
			_, err := natssink.RenderSubject(tc.template, ev)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}
