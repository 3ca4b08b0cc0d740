package relay_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestReasonSinks: the sinks a last_error names are read back as the policy
// writes them; text that names no configured sink names none.
func TestReasonSinks(t *testing.T) {
	names := []string{"n8n", "nats", "a", "a: b", "erp; x"}
	for _, c := range []struct {
		name, reason string
		want         []string
	}{
		{"one sink", "sink n8n: webhook n8n: event \"k\": receiver answered 400 Bad Request: nope", []string{"n8n"}},
		{"two sinks", "sink nats: message too large; sink n8n: receiver answered 422", []string{"nats", "n8n"}},
		{"max attempts", "max_attempts reached: sink n8n: 503; sink nats: timeout", []string{"n8n", "nats"}},
		{"named twice", "sink n8n: 400; sink n8n: 400", []string{"n8n"}},
		{"the longest name that fits", "sink a: b: 400 Bad Request", []string{"a: b"}},
		{"a name with the separator", "sink erp; x: 400", []string{"erp; x"}},
		{"an unknown sink", "sink old: 400", nil},
		{"no sink: a key too long", "event_key is 9000 bytes; the ledger holds at most 2048 (docs/schema.md, \"Key lengths\")", nil},
		{"no sink: not storable", "outcome not storable (ERROR: …); it was: dead letter", nil},
		{"another program's text", "poller: failed after 3 tries", nil},
		{"a sink named inside a reason only", "webhook n8n: sink nats: x", nil},
		{"empty", "", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := relay.ReasonSinks(c.reason, names); !slices.Equal(got, c.want) {
				t.Errorf("ReasonSinks(%q) = %q, want %q", c.reason, got, c.want)
			}
		})
	}
}

// TestReasonSinks_ReadsWhatDecideWrites: every dead letter and hold the
// policy decides names exactly its failing sinks, also cut to the stored
// length.
func TestReasonSinks_ReadsWhatDecideWrites(t *testing.T) {
	now := time.Now()
	sinks := []string{"n8n", "nats", "erp"}
	failed := relay.Outcome{Kind: relay.Failed, Reason: "receiver answered 400", Counted: 1}
	held := relay.Outcome{Kind: relay.Held, Reason: "outcome unknown: timeout", Unknown: true, Counted: 1}
	retry := relay.Outcome{Kind: relay.Retry, Reason: strings.Repeat("503; ", 30), Counted: 1}
	delivered := relay.Outcome{Kind: relay.Delivered}
	for _, c := range []struct {
		name     string
		attempts int
		outcomes []relay.Outcome
		kind     relay.DecisionKind
		want     []string
	}{
		{"one failed", 0, []relay.Outcome{delivered, failed, delivered}, relay.DeadLetter, []string{"nats"}},
		{"two failed", 0, []relay.Outcome{failed, delivered, failed}, relay.DeadLetter, []string{"n8n", "erp"}},
		{"held", 0, []relay.Outcome{delivered, delivered, held}, relay.Hold, []string{"erp"}},
		{"attempts used up", 9, []relay.Outcome{retry, delivered, delivered}, relay.DeadLetter, []string{"n8n"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := relay.Policy{MaxAttempts: 10}.Decide(now, c.attempts, c.outcomes, sinks)
			if d.Kind != c.kind {
				t.Fatalf("decision %v, want %v", d.Kind, c.kind)
			}
			if got := relay.ReasonSinks(d.Reason, sinks); !slices.Equal(got, c.want) {
				t.Errorf("ReasonSinks(%q) = %q, want %q", d.Reason, got, c.want)
			}
		})
	}
}
