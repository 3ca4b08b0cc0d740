package nats_test

import (
	"encoding/base64"
	"net/textproto"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// fuzzScopedFrom is the cut-over of the fuzzed deployments: an outbox id
// below it is an event from before the scoping, sent under its bare key.
const fuzzScopedFrom = 100

// FuzzMsgID checks the Nats-Msg-Id of a delivery, JetStream's deduplication
// id: deterministic, sent unchanged by nats.go (which trims surrounding
// spaces and tabs and turns CR and LF into spaces), the deployment's id, ":"
// and the event key itself or HeaderValue's encoding of it (without the
// deployment's id for an event before the scoping), and different for two
// different (deployment, event key, replay) triples: a shared id would make
// JetStream drop the second message as a duplicate and ack it, and the event
// would be lost for this sink. Within one deployment that holds across the
// cut-over too (an event sent bare, a later one scoped); across two it holds
// for the scoped ids, the bare ones being what the version before the
// scoping sent.
func FuzzMsgID(f *testing.F) {
	f.Add("d1", "order-42", 0, int64(100), "d1", "order-42", 1, int64(100))
	f.Add("d1", "a~r1", 0, int64(100), "d1", "a", 1, int64(100))
	f.Add("d1", "b64:YQ", 0, int64(100), "d1", "a", 0, int64(100))
	f.Add("d1", "", 0, int64(100), "d1", " ", 0, int64(100))
	f.Add("d1", "a\nb", 2, int64(100), "d1", "a b", 2, int64(100))
	f.Add("d1", "commande-été", 0, int64(100), "d1", "commande-\xe9t\xe9", 0, int64(100))
	f.Add("d1", " k\t", 10, int64(100), "d1", "k", 10, int64(100))
	f.Add("orders", "collide-1", 0, int64(100), "billing", "collide-1", 0, int64(100))
	f.Add("d1", "d1:k", 0, int64(5), "d1", "k", 0, int64(100))
	f.Add("d1", "k", 0, int64(5), "d2", "k", 0, int64(5))
	f.Add("d1", "k", 0, int64(5), "d1", "k", 0, int64(100))
	f.Fuzz(func(t *testing.T, dep, key string, replay int, id int64, otherDep, otherKey string, otherReplay int, otherID int64) {
		if (natssink.Deployment{ID: dep}).Validate() != nil || (natssink.Deployment{ID: otherDep}).Validate() != nil {
			return // New refuses such a deployment
		}
		replay, otherReplay = max(replay, 0), max(otherReplay, 0) // Delivery.Replay is never negative
		got := msgID(dep, key, replay, id)
		if again := msgID(dep, key, replay, id); again != got {
			t.Fatalf("MsgID(%q, %q, %d, %d) = %q, then %q", dep, key, replay, id, got, again)
		}
		if sent := strings.NewReplacer("\r", " ", "\n", " ").Replace(textproto.TrimString(got)); sent != got {
			t.Fatalf("MsgID(%q, %q, %d) = %q is sent as %q", dep, key, replay, got, sent)
		}
		if !utf8.ValidString(got) || strings.ContainsFunc(got, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			t.Fatalf("MsgID(%q, %q, %d) = %q has invalid UTF-8 or a control character", dep, key, replay, got)
		}

		base := got
		if replay > 0 {
			var ok bool
			if base, ok = strings.CutSuffix(got, "~r"+strconv.Itoa(replay)); !ok {
				t.Fatalf("MsgID(%q, %q, %d) = %q lacks the replay suffix", dep, key, replay, got)
			}
		}
		if id >= fuzzScopedFrom {
			var ok bool
			if base, ok = strings.CutPrefix(base, dep+":"); !ok {
				t.Fatalf("MsgID(%q, %q, %d) = %q is not scoped by the deployment", dep, key, replay, got)
			}
		}
		if base != key {
			enc, ok := strings.CutPrefix(base, natssink.EncodedPrefix)
			decoded, err := base64.RawURLEncoding.DecodeString(enc)
			if !ok || err != nil || string(decoded) != key {
				t.Fatalf("MsgID(%q, %q, %d) = %q is neither the key nor its encoding", dep, key, replay, got)
			}
		}

		// The other input, and the triples a replay suffix or a scope could
		// be confused with, which random inputs hardly ever hit. Two events
		// of one deployment have different keys; an event's replays share
		// its outbox id.
		type triple struct {
			dep, key string
			replay   int
			id       int64
		}
		others := []triple{{otherDep, otherKey, otherReplay, otherID}}
		if replay > 0 {
			others = append(others, triple{dep, key + "~r" + strconv.Itoa(replay), 0, id})
		}
		if i := strings.LastIndex(key, "~r"); i >= 0 {
			if n, err := strconv.Atoi(key[i+2:]); err == nil && n > 0 {
				others = append(others, triple{dep, key[:i], n, id})
			}
		}
		if scope, rest, ok := strings.Cut(key, ":"); ok {
			others = append(others, triple{scope, rest, replay, fuzzScopedFrom}, triple{dep, rest, replay, fuzzScopedFrom})
		}
		others = append(others, triple{dep, dep + ":" + key, replay, 0})
		for _, o := range others {
			if (natssink.Deployment{ID: o.dep}).Validate() != nil {
				continue
			}
			if o.dep == dep && o.key == key && (o.replay == replay || o.id >= fuzzScopedFrom != (id >= fuzzScopedFrom)) {
				continue // the same delivery, or the same event under two outbox ids
			}
			if o.dep != dep && (id < fuzzScopedFrom || o.id < fuzzScopedFrom) {
				continue // ids sent bare are what the version before the scoping sent
			}
			if other := msgID(o.dep, o.key, o.replay, o.id); other == got {
				t.Fatalf("MsgID(%q, %q, %d, id %d) and MsgID(%q, %q, %d, id %d) are both %q", dep, key, replay, id, o.dep, o.key, o.replay, o.id, got)
			}
		}
	})
}

func msgID(dep, key string, replay int, id int64) string {
	d := natssink.Deployment{ID: dep, ScopedFrom: fuzzScopedFrom}
	return d.MsgID(&relay.Delivery{Event: &relay.Event{ID: id, EventKey: key}, Replay: replay})
}
