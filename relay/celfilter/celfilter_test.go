package celfilter_test

import (
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/celfilter"
)

func strp(s string) *string { return &s }

func TestCompileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, expr string
		want       []string
	}{
		{"syntax", `payload.amount >`, []string{"line 1, column 17", "Syntax error"}},
		{"second line", "event_type == \"a\" &&\n  nope > 1", []string{"line 2, column 3", "undeclared reference to 'nope'"}},
		{"not bool", `payload.amount + 1`, []string{"gives int; it must give bool"}},
		{"dyn", `payload.flag`, nil},
		{"string not bool", `event_type`, []string{"gives string; it must give bool"}},
		{"type error", `event_type > 1`, []string{"line 1, column 12", "no matching overload"}},
		{"too long", strings.Repeat("a", celfilter.MaxExprBytes+1), []string{"at most 4096"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := celfilter.Compile(tc.expr)
			if tc.want == nil {
				// dyn: accepted, checked on each event.
				if err != nil {
					t.Fatalf("Compile(%q): %v", tc.expr, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Compile(%q) succeeded", tc.expr)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Compile(%q) = %q, want it to contain %q", tc.expr, err, w)
				}
			}
		})
	}
}

func TestMatch(t *testing.T) {
	ev := func(typ, payload string) *relay.Event {
		return &relay.Event{ID: 7, EventKey: "k7", EventType: strp(typ), AggregateType: strp("order"), AggregateID: strp("o1"), Payload: []byte(payload)}
	}
	for _, tc := range []struct {
		name, expr string
		ev         *relay.Event
		want       bool
		err        string
	}{
		{"payload int vs double", `payload.amount > 100 && event_type == "order.created"`, ev("order.created", `{"amount": 150}`), true, ""},
		{"below", `payload.amount > 100`, ev("order.created", `{"amount": 50}`), false, ""},
		{"aggregate", `aggregate_type == "order" && aggregate_id.startsWith("o") && id == 7 && event_key == "k7"`, ev("x", `{}`), true, ""},
		{"nested and has", `has(payload.customer) && payload.customer.region in ["eu", "us"]`, ev("x", `{"customer": {"region": "eu"}}`), true, ""},
		{"has absent", `has(payload.customer)`, ev("x", `{}`), false, ""},
		{"missing field", `payload.amount > 100`, ev("x", `{"total": 1}`), false, "no such key: amount"},
		{"type error", `payload.amount > 100`, ev("x", `{"amount": "many"}`), false, "no such overload"},
		{"dyn not bool", `payload.flag`, ev("x", `{"flag": "yes"}`), false, "not a bool"},
		{"null payload", `payload.amount > 1`, &relay.Event{ID: 1}, false, "no such key"},
		{"null event_type", `event_type == ""`, &relay.Event{ID: 1}, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := celfilter.Compile(tc.expr)
			if err != nil {
				t.Fatal(err)
			}
			got, err := f.Match(tc.ev)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Match = %v, %v; want an error with %q", got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("Match = %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

// TestCostLimit: an expression too costly for one event fails on it
// instead of running on.
func TestCostLimit(t *testing.T) {
	f, err := celfilter.Compile(`payload.items.all(i, payload.items.all(j, i + j >= 0))`)
	if err != nil {
		t.Fatal(err)
	}
	items := make([]string, 300)
	for i := range items {
		items[i] = "1"
	}
	_, err = f.Match(&relay.Event{Payload: []byte(`{"items": [` + strings.Join(items, ",") + `]}`)})
	if err == nil || !strings.Contains(err.Error(), "cost limit") {
		t.Fatalf("Match = %v, want the cost limit exceeded", err)
	}
}

// TestTakesRuntimeError: a filter that fails on an event routes the pair
// with the error, which the engine dead-letters.
func TestTakesRuntimeError(t *testing.T) {
	f, err := celfilter.Compile(`payload.amount > 100`)
	if err != nil {
		t.Fatal(err)
	}
	r := &relay.Route{Events: []string{"*"}, Filter: f}
	takes, err := r.Takes(&relay.Event{EventType: strp("a"), Payload: []byte(`{}`)})
	if !takes || err == nil || !strings.HasPrefix(err.Error(), "filter: ") {
		t.Fatalf("Takes = %v, %v; want true and the filter's error", takes, err)
	}
	if takes, err := (&relay.Route{Events: []string{"b"}, Filter: f}).Takes(&relay.Event{EventType: strp("a")}); takes || err != nil {
		t.Fatalf("Takes of an unrouted type = %v, %v; want false, nil (globs first)", takes, err)
	}
}

func BenchmarkTakes(b *testing.B) {
	f, err := celfilter.Compile(`payload.amount > 100 && event_type == "order.created"`)
	if err != nil {
		b.Fatal(err)
	}
	r := &relay.Route{Events: []string{"order.*"}, Filter: f}
	payload := []byte(`{"amount": 150, "currency": "EUR", "customer": {"id": "c-1", "region": "eu"}, "lines": [{"sku": "a", "qty": 1}]}`)
	for b.Loop() {
		ev := &relay.Event{EventType: strp("order.created"), Payload: payload}
		if ok, err := r.Takes(ev); !ok || err != nil {
			b.Fatal(ok, err)
		}
	}
}

// BenchmarkTakesDecoded is BenchmarkTakes with the payload already
// decoded: what each further sink with a filter costs an event.
func BenchmarkTakesDecoded(b *testing.B) {
	f, err := celfilter.Compile(`payload.amount > 100 && event_type == "order.created"`)
	if err != nil {
		b.Fatal(err)
	}
	r := &relay.Route{Events: []string{"order.*"}, Filter: f}
	ev := &relay.Event{EventType: strp("order.created"), Payload: []byte(`{"amount": 150, "currency": "EUR", "customer": {"id": "c-1", "region": "eu"}, "lines": [{"sku": "a", "qty": 1}]}`)}
	for b.Loop() {
		if ok, err := r.Takes(ev); !ok || err != nil {
			b.Fatal(ok, err)
		}
	}
}
