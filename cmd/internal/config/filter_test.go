package config_test

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestFilter_CompileErrors: a filter that does not compile fails the
// configuration, naming the key, the line of the YAML and the position in
// the expression (docs/sinks.md, "Filters").
func TestFilter_CompileErrors(t *testing.T) {
	const head = "source:\n  mode: poll\nsinks:\n  - name: ok\n    type: webhook\n    url: http://h/w\n  - name: hook\n    type: webhook\n    url: http://h/w\n"
	for _, tc := range []struct {
		name, filter string
		want         []string
	}{
		{"syntax", `    filter: 'payload.amount >'`, []string{"relay.yaml:10: sinks[1].filter:", "line 1, column 17", "Syntax error"}},
		{"undeclared", `    filter: 'event_type == "a" && amount > 1'`, []string{"relay.yaml:10: sinks[1].filter:", "line 1, column 22", "undeclared reference to 'amount'"}},
		{"block scalar", "    filter: |\n      event_type == \"a\" &&\n        payload.amount >> 1", []string{"relay.yaml:10: sinks[1].filter:", "line 2, column 19"}},
		{"not bool", `    filter: 'event_type'`, []string{"relay.yaml:10: sinks[1].filter:", "gives string; it must give bool"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := load(t, head+tc.filter+"\n")
			for _, w := range tc.want {
				requireErrorContains(t, err, w)
			}
		})
	}
}

func TestFilter_Compiled(t *testing.T) {
	c := MustLoad(t, "source:\n  mode: poll\nsinks:\n  - name: hook\n    type: webhook\n    url: http://h/w\n    filter: payload.amount > 100\n")
	f := c.Sinks[0].CompiledFilter()
	if f == nil {
		t.Fatal("CompiledFilter is nil")
	}
	typ := "order.created"
	for payload, want := range map[string]bool{`{"amount": 101}`: true, `{"amount": 100}`: false} {
		r := relay.Route{Events: c.Sinks[0].Events, Filter: f}
		if got, err := r.Takes(&relay.Event{EventType: &typ, Payload: []byte(payload)}); got != want || err != nil {
			t.Errorf("Takes(%s) = %v, %v; want %v", payload, got, err, want)
		}
	}
}

// TestSubject_ByFieldErrors: a subject's CEL action that does not compile
// fails the configuration, naming the key and the line.
func TestSubject_ByFieldErrors(t *testing.T) {
	_, err := load(t, "source:\n  mode: poll\nsinks:\n  - name: n\n    type: nats\n    subject: 'orders.{{ payload.region + }}'\n")
	requireErrorContains(t, err, "relay.yaml:6: sinks[0].subject:")
	requireErrorContains(t, err, "{{ payload.region + }}")
	MustLoad(t, "source:\n  mode: poll\nsinks:\n  - name: n\n    type: nats\n    subject: 'orders.{{ payload.region }}.{{.EventType}}'\n")
}
