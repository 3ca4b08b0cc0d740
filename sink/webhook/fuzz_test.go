package webhook_test

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
	"net/textproto"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// rawIDKey is a key IdempotencyKey documents as sent verbatim (it must also
// not start with "evk_").
var rawIDKey = regexp.MustCompile(`^[A-Za-z0-9\-_.:@/+=]{1,255}$`)

// anyID is every id IdempotencyKey may return: a raw key or a mapped one,
// then an optional replay suffix.
var anyID = regexp.MustCompile(`^(?:[A-Za-z0-9\-_.:@/+=]{1,255}|evk_[A-Za-z0-9_-]{43})(?:~r[1-9][0-9]*)?$`)

// FuzzIdempotencyKey checks the Idempotency-Key / webhook-id mapping: the id
// is the documented one (the key itself when header-safe, else "evk_" and the
// base64url SHA-256), is deterministic, crosses the wire unchanged as a header
// value, and two different (key, replay) pairs never share an id, which
// would make a receiver drop the second event as a repeat.
func FuzzIdempotencyKey(f *testing.F) {
	f.Add("order:42.created", 0, "order:42.created", 1)
	f.Add("a~r1", 0, "a", 1)
	f.Add("evk_abc", 0, "abc", 0)
	f.Add("", 0, " ", 0)
	f.Add(strings.Repeat("k", 255), 2, strings.Repeat("k", 256), 2)
	f.Add("commande é 42", 0, "commande-é-42", 0)
	f.Add("x\r\nX-Evil: 1", 7, "x", 7)
	f.Add("user@example.com/+=:", 1, "user@example.com/+=:", 10)
	f.Fuzz(func(t *testing.T, key string, replay int, otherKey string, otherReplay int) {
		replay, otherReplay = max(replay, 0), max(otherReplay, 0) // Delivery.Replay is never negative
		id := webhook.IdempotencyKey(key, replay)
		if again := webhook.IdempotencyKey(key, replay); again != id {
			t.Fatalf("IdempotencyKey(%q, %d) = %q, then %q", key, replay, id, again)
		}
		if !anyID.MatchString(id) {
			t.Fatalf("IdempotencyKey(%q, %d) = %q is not a header-safe id", key, replay, id)
		}

		want := key
		if !rawIDKey.MatchString(key) || strings.HasPrefix(key, "evk_") {
			sum := sha256.Sum256([]byte(key))
			want = "evk_" + base64.RawURLEncoding.EncodeToString(sum[:])
		}
		if replay > 0 {
			want += "~r" + strconv.Itoa(replay)
		}
		if id != want {
			t.Fatalf("IdempotencyKey(%q, %d) = %q, want %q", key, replay, id, want)
		}

		if got := overTheWire(t, id); got != id {
			t.Fatalf("IdempotencyKey(%q, %d) = %q arrives as %q", key, replay, id, got)
		}

		if key == otherKey && replay == otherReplay {
			return
		}
		if other := webhook.IdempotencyKey(otherKey, otherReplay); other == id {
			t.Fatalf("IdempotencyKey(%q, %d) and IdempotencyKey(%q, %d) are both %q", key, replay, otherKey, otherReplay, id)
		}
	})
}

// overTheWire writes id as an Idempotency-Key header the way net/http sends
// it and reads it back the way a Go server does.
func overTheWire(t *testing.T, id string) string {
	t.Helper()
	var buf bytes.Buffer
	if err := (http.Header{"Idempotency-Key": {id}}).Write(&buf); err != nil {
		t.Fatal(err)
	}
	buf.WriteString("\r\n")
	h, err := textproto.NewReader(bufio.NewReader(&buf)).ReadMIMEHeader()
	if err != nil {
		t.Fatalf("read back %q: %v", buf.String(), err)
	}
	return h.Get("Idempotency-Key")
}
