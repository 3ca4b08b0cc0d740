package nats_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

func ptr(s string) *string { return &s }

func TestSanitizeSubjectToken(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"plain", "order", "order"},
		{"empty", "", "_"},
		{"dots", "order.placed", "order_placed"},
		{"only a dot", ".", "_"},
		{"spaces and tabs", "a b\tc", "a_b_c"},
		{"CR LF", "a\r\nb", "a__b"},
		{"star", "*", "_"},
		{"greater than", ">", "_"},
		{"wildcards inside", "a*b>c", "a_b_c"},
		{"NUL and DEL", "a\x00b\x7f", "a_b_"},
		{"invalid UTF-8", "a\xffb", "a_b"},
		{"replacement character", "a\uFFFDb", "a_b"},
		{"unicode kept", "commande-été-✓-注文", "commande-été-✓-注文"},
		{"dash underscore colon kept", "a-b_c:d", "a-b_c:d"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := natssink.SanitizeSubjectToken(tt.in)
			if got != tt.want {
				t.Fatalf("SanitizeSubjectToken(%q) = %q, want %q", tt.in, got, tt.want)
			}
			if again := natssink.SanitizeSubjectToken(tt.in); again != got {
				t.Fatalf("not deterministic: %q then %q", got, again)
			}
		})
	}
}

// FuzzSanitizeSubjectToken checks the sanitiser's contract: the token is
// never empty, holds none of the characters NATS forbids or treats specially
// in a token, is valid UTF-8 without U+FFFD, keeps every other character in
// place (one '_' per replaced character or invalid byte), is deterministic
// and idempotent, and a subject rendered from such tokens is one nats-server
// accepts. Distinct inputs may share a token ("a.b", "a_b"): the sanitiser
// does not promise otherwise, and the subject is only for routing.
func FuzzSanitizeSubjectToken(f *testing.F) {
	for _, seed := range []string{"", "order.placed", "a b\tc\r\n", "*>", "\xff\xfe", "été ✓", "\uFFFD.", "\u0085\u00a0\u2028", "\x7f\x1b[31m", "\f\v"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, in string) {
		out := natssink.SanitizeSubjectToken(in)
		if out == "" {
			t.Fatalf("SanitizeSubjectToken(%q) is empty", in)
		}
		if again := natssink.SanitizeSubjectToken(in); again != out {
			t.Fatalf("SanitizeSubjectToken(%q) = %q, then %q", in, out, again)
		}
		if strings.ContainsAny(out, ".*> \t\r\n\f\v\x00") || strings.ContainsFunc(out, unicode.IsControl) {
			t.Fatalf("SanitizeSubjectToken(%q) = %q contains a forbidden character", in, out)
		}
		if !utf8.ValidString(out) || strings.ContainsRune(out, utf8.RuneError) {
			t.Fatalf("SanitizeSubjectToken(%q) = %q is not valid UTF-8 or holds U+FFFD", in, out)
		}
		// Converting to []rune turns each invalid byte into one U+FFFD, which
		// is what the sanitiser replaces by one '_'.
		inRunes, outRunes := []rune(in), []rune(out)
		if in == "" {
			inRunes = []rune{'.'}
		}
		if len(outRunes) != len(inRunes) {
			t.Fatalf("SanitizeSubjectToken(%q) = %q: %d characters, want %d", in, out, len(outRunes), len(inRunes))
		}
		for i, r := range inRunes {
			replaced := r == '.' || r == '*' || r == '>' || r == ' ' || r == utf8.RuneError || unicode.IsControl(r)
			if replaced && outRunes[i] != '_' || !replaced && outRunes[i] != r {
				t.Fatalf("SanitizeSubjectToken(%q) = %q: character %d is %q, from %q", in, out, i, outRunes[i], r)
			}
		}
		if again := natssink.SanitizeSubjectToken(out); again != out {
			t.Fatalf("not idempotent: %q -> %q -> %q", in, out, again)
		}
		// The server's own check, with a literal token around it.
		if subject := "outbox." + out + ".x"; !server.IsValidPublishSubject(subject) {
			t.Fatalf("nats-server rejects %q", subject)
		}
		if subject := "outbox." + out; len(subject) <= natssink.MaxSubjectLen {
			if err := natssink.ValidatePublishSubject(subject); err != nil {
				t.Fatalf("ValidatePublishSubject(%s): %v", subject, err)
			}
		}

		// Every field of the event goes through the sanitiser.
		e := relay.Event{EventKey: in, EventType: &in, AggregateType: &in, AggregateID: &in}
		subject, err := natssink.RenderSubject("x.{{.AggregateType}}.{{.AggregateID}}.{{.EventType}}.{{.EventKey}}", &e)
		want := "x." + out + "." + out + "." + out + "." + out
		switch {
		case len(want) > natssink.MaxSubjectLen:
			if err == nil {
				t.Fatalf("a %d-byte subject rendered without an error", len(want))
			}
		case err != nil:
			t.Fatalf("render with %q: %v", in, err)
		case subject != want:
			t.Fatalf("render with %q: %q, want %q", in, subject, want)
		case !server.IsValidPublishSubject(subject):
			t.Fatalf("nats-server rejects the rendered %q", subject)
		}
	})
}

func TestRenderSubject(t *testing.T) {
	tests := []struct {
		name     string
		template string
		event    relay.Event
		want     string
	}{
		{
			name:     "default template",
			template: natssink.DefaultSubject,
			event:    relay.Event{EventKey: "k", EventType: ptr("order.placed"), AggregateType: ptr("order")},
			want:     "outbox.order.order_placed",
		},
		{
			name:     "NULL fields",
			template: natssink.DefaultSubject,
			event:    relay.Event{EventKey: "k"},
			want:     "outbox._._",
		},
		{
			name:     "empty strings",
			template: "events.{{.AggregateType}}.{{.AggregateID}}",
			event:    relay.Event{EventKey: "k", AggregateType: ptr(""), AggregateID: ptr("")},
			want:     "events._._",
		},
		{
			name:     "all fields, forbidden characters",
			template: "x.{{.EventType}}.{{.AggregateType}}.{{.AggregateID}}.{{.EventKey}}",
			event:    relay.Event{EventKey: "k 1>", EventType: ptr("a*b"), AggregateType: ptr("t\tt"), AggregateID: ptr("id.1")},
			want:     "x.a_b.t_t.id_1.k_1_",
		},
		{
			name:     "field inside a literal token",
			template: "orders-{{.AggregateType}}.v1",
			event:    relay.Event{EventKey: "k", AggregateType: ptr("é.x")},
			want:     "orders-é_x.v1",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := natssink.RenderSubject(tt.template, &tt.event)
			if err != nil {
				t.Fatalf("render: %v", err)
			}
			if got != tt.want {
				t.Fatalf("subject %q, want %q", got, tt.want)
			}
		})
	}
}

// TestRenderSubjectByConcatenation: templates of literal text and bare
// fields render by concatenation, exactly as text/template renders them;
// any other template still goes through text/template.
func TestRenderSubjectByConcatenation(t *testing.T) {
	event := relay.Event{EventKey: "k 1>", EventType: ptr("order.placed"), AggregateType: ptr("ordér"), AggregateID: ptr("42")}
	for _, tc := range []struct {
		template string
		fast     bool
	}{
		{natssink.DefaultSubject, true},
		{"x.{{.EventType}}.{{.AggregateType}}.{{.AggregateID}}.{{.EventKey}}", true},
		{"orders-{{.AggregateType}}.v1", true},
		{"fixed.subject", true},
		{"{{.EventKey}}", true},
		{"x.{{printf \"%s-%s\" .AggregateType .AggregateID}}", false},
		{"x.{{if .AggregateID}}{{.AggregateID}}{{else}}none{{end}}", false},
		{"x.{{.EventType | printf \"%s\"}}", false},
		{"x.{{$t := .EventType}}{{$t}}", false},
	} {
		concat, executed, fast, err := natssink.RenderSubjectBothWays(tc.template, &event)
		if err != nil {
			t.Fatalf("%s: %v", tc.template, err)
		}
		if fast != tc.fast || concat != executed {
			t.Errorf("%s: fast path %v (want %v), rendered %q, text/template %q", tc.template, fast, tc.fast, concat, executed)
		}
	}
}

func TestSubjectTemplateErrors(t *testing.T) {
	tests := []struct {
		name, template, wantErr string
	}{
		{"payload is not a field", "outbox.{{.Payload}}", "Payload"},
		{"unknown field", "outbox.{{.Nope}}", "Nope"},
		{"parse error", "outbox.{{.EventType", "subject template"},
		{"empty token", "outbox..{{.EventType}}", "empty token"},
		{"trailing dot", "outbox.{{.EventType}}.", "empty token"},
		{"wildcard", "outbox.>", "wildcard"},
		{"space", "out box.{{.EventType}}", "whitespace"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := natssink.RenderSubject(tt.template, &relay.Event{EventKey: "k"})
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestSubjectCoverage(t *testing.T) {
	tests := []struct {
		template, filter string
		covered          bool
	}{
		{natssink.DefaultSubject, "outbox.>", true},
		{natssink.DefaultSubject, "outbox.*.*", true},
		{natssink.DefaultSubject, ">", true},
		{natssink.DefaultSubject, "outbox.*", false},
		{natssink.DefaultSubject, "outbox.order.*", false},
		{natssink.DefaultSubject, "other.>", false},
		{natssink.DefaultSubject, "outbox.*.*.*", false},
		{"outbox.fixed", "outbox.fixed", true},
		{"outbox.fixed", "outbox.*", true},
		{"outbox.fixed", "outbox.fixed.>", false},
		{"a-{{.EventType}}.b", "*.b", true},
		{"a-{{.EventType}}.b", "a-x.b", false},
	}
	for _, tt := range tests {
		t.Run(tt.template+" in "+tt.filter, func(t *testing.T) {
			pattern, err := natssink.SubjectPattern(tt.template)
			if err != nil {
				t.Fatal(err)
			}
			if got := natssink.SubjectCovers(tt.filter, pattern); got != tt.covered {
				t.Fatalf("SubjectCovers(%q, %q) = %v, want %v", tt.filter, pattern, got, tt.covered)
			}
		})
	}
}

func TestHeaderValue(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"ordinary key kept", "order-42-placed", "order-42-placed"},
		{"unicode kept", "commande-été", "commande-été"},
		{"inner space kept", "a b", "a b"},
		{"newline encoded", "a\nb", "b64:YQpi"},
		{"leading space encoded", " a", "b64:IGE"},
		{"empty encoded", "", "b64:"},
		{"prefix encoded", "b64:x", "b64:YjY0Ong"},
		{"invalid UTF-8 encoded", "\xff", "b64:_w"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := natssink.HeaderValue(tt.in); got != tt.want {
				t.Fatalf("HeaderValue(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
	// Keys nats.go would otherwise send alike stay distinct.
	if natssink.HeaderValue("a\nb") == natssink.HeaderValue("a b") {
		t.Fatal(`"a\nb" and "a b" map to the same header value`)
	}
}

func TestMsgID(t *testing.T) {
	dep := natssink.Deployment{ID: "d1", ScopedFrom: 10}
	tests := []struct {
		name   string
		id     int64 // the outbox id
		key    string
		replay int
		want   string
	}{
		{"scoped", 10, "evt-1", 0, "d1:evt-1"},
		{"scoped replay", 11, "evt-1", 3, "d1:evt-1~r3"},
		{"scoped encoded key", 12, "a\nb", 0, "d1:" + natssink.HeaderValue("a\nb")},
		{"before the scoping: the bare key", 9, "evt-1", 0, "evt-1"},
		{"before the scoping: its replay", 9, "evt-1", 2, "evt-1~r2"},
		// Sent bare it would be event "a"'s scoped id.
		{"before the scoping, a key that looks scoped", 9, "d1:a", 0, "b64:ZDE6YQ"},
		{"a key that looks scoped, scoped", 10, "d1:a", 0, "d1:d1:a"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := &relay.Delivery{Event: &relay.Event{ID: tt.id, EventKey: tt.key}, Replay: tt.replay}
			if got := dep.MsgID(d); got != tt.want {
				t.Fatalf("MsgID(id %d, %q, replay %d) = %q, want %q", tt.id, tt.key, tt.replay, got, tt.want)
			}
		})
	}
	if got := (natssink.Deployment{ID: "d1"}).MsgID(&relay.Delivery{Event: &relay.Event{EventKey: "k"}}); got != "d1:k" {
		t.Fatalf("ScopedFrom 0: MsgID = %q, want every event scoped", got)
	}
}

// TestDeploymentID: the default deployment id is stable for one outbox and
// differs when any part of its identity does.
func TestDeploymentID(t *testing.T) {
	id := natssink.DeploymentID("7316184585338822400", "shop", "public.integration_outbox")
	if err := (natssink.Deployment{ID: id}).Validate(); err != nil || len(id) != 16 {
		t.Fatalf("DeploymentID = %q (%v), want 16 valid characters", id, err)
	}
	if again := natssink.DeploymentID("7316184585338822400", "shop", "public.integration_outbox"); again != id {
		t.Fatalf("DeploymentID changed: %q, then %q", id, again)
	}
	for _, other := range [][3]string{
		{"7316184585338822401", "shop", "public.integration_outbox"},
		{"7316184585338822400", "billing", "public.integration_outbox"},
		{"7316184585338822400", "shop", "sales.integration_outbox"},
		{"7316184585338822400", "shop\x00public", "integration_outbox"},
	} {
		if got := natssink.DeploymentID(other[0], other[1], other[2]); got == id {
			t.Fatalf("DeploymentID%q = %q, the same as another outbox's", other, got)
		}
	}
}

// TestMsgIDReplayNeverEqualsAnotherKey: event "a"'s first replay and an
// event whose key is "a~r1" once shared the Nats-Msg-Id "a~r1", so within the
// duplicate window JetStream dropped whichever came second and acknowledged
// it as a duplicate: that event never reached the stream (found by FuzzMsgID).
func TestMsgIDReplayNeverEqualsAnotherKey(t *testing.T) {
	tests := []struct {
		name, key         string
		replay            int
		otherKey          string
		otherReplay       int
		wantID, wantOther string
	}{
		{"key with a replay suffix", "a~r1", 0, "a", 1, "b64:YX5yMQ", "a~r1"},
		{"replay of such a key", "a~r1", 2, "a~r1~r2", 0, "b64:YX5yMQ~r2", "b64:YX5yMX5yMg"},
		{"tilde alone kept", "a~b", 0, "a~r", 0, "a~b", "a~r"},
	}
	for _, tt := range tests {
		for _, dep := range []natssink.Deployment{{ID: "d"}, {ID: "d", ScopedFrom: 1}} {
			prefix := "d:"
			if dep.ScopedFrom > 0 {
				prefix = "" // an event before the scoping: the bare key
			}
			t.Run(fmt.Sprintf("%s/%s", tt.name, map[bool]string{true: "scoped", false: "bare"}[prefix != ""]), func(t *testing.T) {
				id := dep.MsgID(&relay.Delivery{Event: &relay.Event{EventKey: tt.key}, Replay: tt.replay})
				other := dep.MsgID(&relay.Delivery{Event: &relay.Event{EventKey: tt.otherKey}, Replay: tt.otherReplay})
				if id != prefix+tt.wantID || other != prefix+tt.wantOther {
					t.Fatalf("MsgID(%q, %d) = %q, MsgID(%q, %d) = %q; want %q and %q",
						tt.key, tt.replay, id, tt.otherKey, tt.otherReplay, other, prefix+tt.wantID, prefix+tt.wantOther)
				}
			})
		}
	}
}

func TestClassifyAckError(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want relay.ErrorClass
	}{
		{"no stream response", jetstream.ErrNoStreamResponse, relay.SinkDown},
		{"no responders", nats.ErrNoResponders, relay.SinkDown},
		{"stream not found", &jetstream.APIError{Code: 404, ErrorCode: jetstream.JSErrCodeStreamNotFound}, relay.SinkDown},
		{"message too large", &jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamMessageExceedsMaximum}, relay.Permanent},
		{"header too large", &jetstream.APIError{Code: 400, ErrorCode: 10097}, relay.Permanent},
		{"stream full", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages exceeded"}, relay.Transient},
		{"ack timeout", jetstream.ErrAsyncPublishTimeout, relay.Unknown},
		{"disconnected", nats.ErrDisconnected, relay.Unknown},
		{"publisher closed", jetstream.ErrJetStreamPublisherClosed, relay.Unknown},
		{"garbled ack", jetstream.ErrInvalidJSAck, relay.Unknown},
		{"anything else", errors.New("boom"), relay.Unknown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := natssink.ClassifyAckError("evt-1", tt.err)
			if got, _ := relay.Classify(err); got != tt.want {
				t.Fatalf("class %s, want %s (%v)", got, tt.want, err)
			}
			if !errors.Is(err, tt.err) || !strings.Contains(err.Error(), "evt-1") {
				t.Fatalf("%v does not wrap %v or name the key", err, tt.err)
			}
		})
	}
}

func TestClassifyPublishError(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want relay.ErrorClass
	}{
		{"max payload", nats.ErrMaxPayload, relay.Permanent},
		{"closed", nats.ErrConnectionClosed, relay.SinkDown},
		{"reconnecting", nats.ErrConnectionReconnecting, relay.SinkDown},
		{"reconnect buffer", nats.ErrReconnectBufExceeded, relay.SinkDown},
		{"stalled", jetstream.ErrTooManyStalledMsgs, relay.Transient},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got, _ := relay.Classify(natssink.ClassifyPublishError("evt-1", tt.err)); got != tt.want {
				t.Fatalf("class %s, want %s", got, tt.want)
			}
		})
	}
}

// BenchmarkRenderSubject: the default template, by concatenation and
// through text/template.
func BenchmarkRenderSubject(b *testing.B) {
	event := relay.Event{EventKey: "order-42-1", EventType: ptr("order.placed"), AggregateType: ptr("order"), AggregateID: ptr("42")}
	for _, way := range []struct {
		name string
		slow bool
	}{{"concatenation", false}, {"text-template", true}} {
		b.Run(way.name, func(b *testing.B) {
			render, err := natssink.SubjectRenderer(natssink.DefaultSubject, way.slow)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := render(&event); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
