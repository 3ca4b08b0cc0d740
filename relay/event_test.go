package relay_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

func TestEnvelope(t *testing.T) {
	e := &relay.Event{ID: 42, EventKey: "lead-1 \"x\"\n", EventType: str("lead.created"), AggregateType: nil,
		AggregateID: str("L1 ✓"), Payload: []byte(`{"a": 1.0, "b": [true, null]}`),
		CreatedAt: time.Date(2026, 12, 2, 17, 4, 5, 120000, time.FixedZone("CET", 3600))}
	got := string(e.AppendEnvelope(nil))
	want := `{"id":42,"event_key":"lead-1 \"x\"\n","event_type":"lead.created","aggregate_type":null,` +
		`"aggregate_id":"L1 ✓","payload":{"a": 1.0, "b": [true, null]},"created_at":"2026-12-02T16:04:05.000120Z"}`
	if got != want {
		t.Fatalf("envelope\n got %s\nwant %s", got, want)
	}
	var v map[string]any
	if err := json.Unmarshal([]byte(got), &v); err != nil {
		t.Fatalf("not JSON: %v", err)
	}
	e.Payload = nil
	if err := json.Unmarshal(e.AppendEnvelope(nil), &v); err != nil || v["payload"] != nil {
		t.Fatalf("NULL payload: %v %v", v["payload"], err)
	}
	if got := string(e.AppendNudge(nil)); got != `{"id":42,"event_key":"lead-1 \"x\"\n","event_type":"lead.created"}` {
		t.Fatalf("nudge %s", got)
	}
}

func FuzzAppendJSONString(f *testing.F) {
	for _, s := range []string{"", "plain", "quote\"back\\slash", "\x00\x1f\u2028", "\xff\xfe invalid", "emoji 🚀"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		out := relay.AppendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatalf("%q encoded as invalid JSON %s: %v", s, out, err)
		}
		want, _ := json.Marshal(s)
		var wantBack string
		json.Unmarshal(want, &wantBack)
		if back != wantBack {
			t.Fatalf("%q round-trips to %q, encoding/json gives %q", s, back, wantBack)
		}
	})
}

func TestLSN(t *testing.T) {
	for _, s := range []string{"0/0", "16/B374D848", "FFFFFFFF/FFFFFFFF"} {
		l, err := relay.ParseLSN(s)
		if err != nil || l.String() != s {
			t.Fatalf("%s: %v %v", s, l, err)
		}
		var scanned relay.LSN
		if err := scanned.Scan(s); err != nil || scanned != l {
			t.Fatalf("scan %s: %v %v", s, scanned, err)
		}
		if v, _ := l.Value(); v != s {
			t.Fatalf("value %v", v)
		}
	}
	for _, bad := range []string{"", "16", "x/1", "1/100000000"} {
		if _, err := relay.ParseLSN(bad); err == nil {
			t.Fatalf("%q parsed", bad)
		}
	}
}

func TestQualifiedName(t *testing.T) {
	tests := []struct {
		in, quoted string
		bad        bool
	}{
		{in: "integration_outbox", quoted: `"integration_outbox"`},
		{in: "app.outbox", quoted: `"app"."outbox"`},
		{in: `we"ird; name`, quoted: `"we""ird; name"`},
		{in: "a.b.c", bad: true},
		{in: "", bad: true},
		{in: "tab\there", bad: true},
		{in: "x123456789012345678901234567890123456789012345678901234567890123", bad: true},
	}
	for _, tt := range tests {
		n, err := relay.ParseQualifiedName(tt.in)
		if tt.bad != (err != nil) || (!tt.bad && n.Quoted() != tt.quoted) {
			t.Errorf("%q: %v %v", tt.in, n.Quoted(), err)
		}
	}
	if err := relay.ValidateSlotName("Outbox"); err == nil {
		t.Error("upper-case slot name accepted")
	}
}

func BenchmarkAppendEnvelope(b *testing.B) {
	typ, agg, id := "order.created", "order", "order-123456"
	e := &relay.Event{ID: 123456, EventKey: "order-123456-created-7f3a", EventType: &typ, AggregateType: &agg, AggregateID: &id,
		Payload:   []byte(`{"amount": 1234, "currency": "EUR", "items": [` + strings.Repeat(`{"sku": "A-1", "qty": 2}, `, 9) + `{"sku": "B-2", "qty": 1}]}`),
		CreatedAt: time.Date(2026, 12, 2, 18, 0, 0, 123456789, time.UTC)}
	b.ReportAllocs()
	for b.Loop() {
		_ = e.AppendEnvelope(nil)
	}
}
