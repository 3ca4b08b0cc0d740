package relay_test

import (
	"bytes"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// envelopeKeys are the envelope's keys in the order docs/sinks.md shows them.
var envelopeKeys = []string{"id", "event_key", "event_type", "aggregate_type", "aggregate_id", "payload", "created_at"}

type decodedEnvelope struct {
	ID            int64           `json:"id"`
	EventKey      string          `json:"event_key"`
	EventType     *string         `json:"event_type"`
	AggregateType *string         `json:"aggregate_type"`
	AggregateID   *string         `json:"aggregate_id"`
	Payload       json.RawMessage `json:"payload"`
	CreatedAt     string          `json:"created_at"`
}

// FuzzAppendEnvelope checks the webhook body and NATS message data for any
// row: for a NULL payload or any JSON payload (what jsonb's text always is)
// the envelope is valid JSON with exactly the spec's keys in order, decodes
// back to the row's values (invalid UTF-8 in a text column as U+FFFD), holds
// the payload byte for byte, and renders created_at in UTC with
// microseconds; AppendEnvelope and AppendNudge append to dst without
// touching it. A payload that is not JSON cannot come from a jsonb column;
// it is copied as it is, and only the absence of a panic is checked.
func FuzzAppendEnvelope(f *testing.F) {
	f.Add(int64(42), "lead-1 \"x\"\n", "lead.created", "lead", "L1 ✓", uint8(0), []byte(`{"a": 1.0, "b": [true, null]}`), int64(1796227445000120), int8(1))
	f.Add(int64(-1), "", "", "", "", uint8(0b1111), []byte(nil), int64(0), int8(0))
	f.Add(int64(9223372036854775807), "\xff\u2028</script>", "a\x00b", "\t", "\\", uint8(0b0010), []byte(`"\u0000 \ud800"`), int64(-62135596800000000), int8(-12))
	f.Add(int64(1), "k", "t", "a", "i", uint8(0), []byte(" [1, 2]\n"), int64(253402300799999999), int8(14))
	f.Add(int64(1), "k", "t", "a", "i", uint8(0), []byte(`1,"x":2`), int64(1), int8(0))
	f.Add(int64(1), "k", "t", "a", "i", uint8(0), []byte(""), int64(1), int8(0))
	f.Fuzz(func(t *testing.T, id int64, key, eventType, aggType, aggID string, nulls uint8, payload []byte, createdMicros int64, zoneHours int8) {
		nullable := func(bit uint8, s string) *string {
			if nulls&bit != 0 {
				return nil
			}
			return &s
		}
		e := &relay.Event{
			ID: id, EventKey: key,
			EventType: nullable(1, eventType), AggregateType: nullable(2, aggType), AggregateID: nullable(4, aggID),
			Payload:   payload,
			CreatedAt: time.UnixMicro(createdMicros).In(time.FixedZone("", int(zoneHours)%15*3600)),
		}
		if nulls&8 != 0 {
			e.Payload = nil
		}

		env := e.AppendEnvelope(nil)
		if withPrefix := e.AppendEnvelope([]byte("prefix")); string(withPrefix) != "prefix"+string(env) {
			t.Fatalf("AppendEnvelope(dst) = %q, want dst followed by %q", withPrefix, env)
		}
		if e.Payload != nil && !json.Valid(e.Payload) {
			return
		}
		if !json.Valid(env) {
			t.Fatalf("envelope %q is not valid JSON", env)
		}
		if keys := objectKeys(t, env); !slices.Equal(keys, envelopeKeys) {
			t.Fatalf("envelope %s has keys %q, want %q", env, keys, envelopeKeys)
		}
		var got decodedEnvelope
		if err := json.Unmarshal(env, &got); err != nil {
			t.Fatalf("decode %s: %v", env, err)
		}
		if got.ID != id || got.EventKey != asJSON(key) {
			t.Fatalf("envelope %s: id %d, event_key %q; want %d, %q", env, got.ID, got.EventKey, id, asJSON(key))
		}
		for _, f := range []struct {
			name      string
			got, want *string
		}{
			{"event_type", got.EventType, e.EventType},
			{"aggregate_type", got.AggregateType, e.AggregateType},
			{"aggregate_id", got.AggregateID, e.AggregateID},
		} {
			if (f.got == nil) != (f.want == nil) || f.got != nil && *f.got != asJSON(*f.want) {
				t.Fatalf("envelope %s: %s is %s, want %s", env, f.name, show(f.got), show(f.want))
			}
		}
		wantPayload := e.Payload
		if wantPayload == nil {
			wantPayload = []byte("null")
		}
		if !bytes.Contains(env, []byte(`,"payload":`+string(wantPayload)+`,"created_at":`)) {
			t.Fatalf("envelope %s does not hold the payload %q verbatim", env, wantPayload)
		}
		if y := e.CreatedAt.UTC().Year(); y >= 0 && y <= 9999 {
			ts, err := time.Parse(time.RFC3339Nano, got.CreatedAt)
			if err != nil || len(got.CreatedAt) != len("2006-01-02T15:04:05.000000Z") || !ts.Equal(e.CreatedAt) {
				t.Fatalf("created_at %q for %s (%v)", got.CreatedAt, e.CreatedAt.UTC().Format(time.RFC3339Nano), err)
			}
		}

		nudge := e.AppendNudge([]byte("prefix"))
		nudgeBody, ok := bytes.CutPrefix(nudge, []byte("prefix"))
		if !ok || !json.Valid(nudgeBody) {
			t.Fatalf("nudge %q is not dst followed by valid JSON", nudge)
		}
		if keys := objectKeys(t, nudgeBody); !slices.Equal(keys, envelopeKeys[:3]) {
			t.Fatalf("nudge %s has keys %q, want %q", nudgeBody, keys, envelopeKeys[:3])
		}
		var n decodedEnvelope
		if err := json.Unmarshal(nudgeBody, &n); err != nil || n.ID != got.ID || n.EventKey != got.EventKey || show(n.EventType) != show(got.EventType) {
			t.Fatalf("nudge %s does not match envelope %s (%v)", nudgeBody, env, err)
		}
	})
}

// asJSON is s as it reads back from a JSON string: each invalid UTF-8 byte
// becomes U+FFFD, which is what converting to []rune does.
func asJSON(s string) string { return string([]rune(s)) }

func show(s *string) string {
	if s == nil {
		return "null"
	}
	b, _ := json.Marshal(*s)
	return string(b)
}

// objectKeys returns the top-level keys of the JSON object data, in order.
func objectKeys(t *testing.T, data []byte) []string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("%s is not an object: %v %v", data, tok, err)
	}
	var keys []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("%s: %v", data, err)
		}
		keys = append(keys, tok.(string))
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			t.Fatalf("%s: %v", data, err)
		}
	}
	return keys
}
