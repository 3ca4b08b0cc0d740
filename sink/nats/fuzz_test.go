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

// FuzzMsgID checks the Nats-Msg-Id of a delivery, JetStream's deduplication
// id: deterministic, sent unchanged by nats.go (which trims surrounding
// spaces and tabs and turns CR and LF into spaces), the event key itself or
// HeaderValue's encoding of it, and different for two different (event key,
// replay) pairs: a shared id would make JetStream drop the second message as
// a duplicate and ack it, and the event would be lost for this sink.
func FuzzMsgID(f *testing.F) {
	f.Add("order-42", 0, "order-42", 1)
	f.Add("a~r1", 0, "a", 1)
	f.Add("b64:YQ", 0, "a", 0)
	f.Add("", 0, " ", 0)
	f.Add("a\nb", 2, "a b", 2)
	f.Add("commande-été", 0, "commande-\xe9t\xe9", 0)
	f.Add(" k\t", 10, "k", 10)
	f.Fuzz(func(t *testing.T, key string, replay int, otherKey string, otherReplay int) {
		replay, otherReplay = max(replay, 0), max(otherReplay, 0) // Delivery.Replay is never negative
		id := msgID(key, replay)
		if again := msgID(key, replay); again != id {
			t.Fatalf("MsgID(%q, %d) = %q, then %q", key, replay, id, again)
		}
		if sent := strings.NewReplacer("\r", " ", "\n", " ").Replace(textproto.TrimString(id)); sent != id {
			t.Fatalf("MsgID(%q, %d) = %q is sent as %q", key, replay, id, sent)
		}
		if !utf8.ValidString(id) || strings.ContainsFunc(id, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			t.Fatalf("MsgID(%q, %d) = %q has invalid UTF-8 or a control character", key, replay, id)
		}

		base := id
		if replay > 0 {
			var ok bool
			if base, ok = strings.CutSuffix(id, "~r"+strconv.Itoa(replay)); !ok {
				t.Fatalf("MsgID(%q, %d) = %q lacks the replay suffix", key, replay, id)
			}
		}
		if base != key {
			enc, ok := strings.CutPrefix(base, natssink.EncodedPrefix)
			decoded, err := base64.RawURLEncoding.DecodeString(enc)
			if !ok || err != nil || string(decoded) != key {
				t.Fatalf("MsgID(%q, %d) = %q is neither the key nor its encoding", key, replay, id)
			}
		}

		// The other input, and the pairs a replay suffix could be confused
		// with, which random inputs hardly ever hit.
		others := [][2]any{{otherKey, otherReplay}}
		if replay > 0 {
			others = append(others, [2]any{key + "~r" + strconv.Itoa(replay), 0})
		}
		if i := strings.LastIndex(key, "~r"); i >= 0 {
			if n, err := strconv.Atoi(key[i+2:]); err == nil && n > 0 {
				others = append(others, [2]any{key[:i], n})
			}
		}
		for _, o := range others {
			otherKey, otherReplay := o[0].(string), o[1].(int)
			if key == otherKey && replay == otherReplay {
				continue
			}
			if other := msgID(otherKey, otherReplay); other == id {
				t.Fatalf("MsgID(%q, %d) and MsgID(%q, %d) are both %q", key, replay, otherKey, otherReplay, id)
			}
		}
	})
}

func msgID(key string, replay int) string {
	return natssink.MsgID(&relay.Delivery{Event: &relay.Event{EventKey: key}, Replay: replay})
}
