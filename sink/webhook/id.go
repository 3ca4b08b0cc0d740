package webhook

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// maxRawIDLen is the longest event key sent verbatim as an id; longer keys
// are mapped (see IdempotencyKey).
const maxRawIDLen = 255

// mappedIDPrefix starts every mapped id. Keys that themselves start with it
// are mapped too, so a mapped id never equals another event's raw key.
const mappedIDPrefix = "evk_"

// replaySeparator joins an id and its replay number ("<key>~r<n>"). Keys
// containing "~" are mapped, so a replay id never equals another event's
// raw key.
const replaySeparator = "~r"

// IdempotencyKey returns the id sent as Idempotency-Key and webhook-id for
// the event key eventKey: the key itself when it is header-safe, otherwise
// "evk_" followed by the unpadded base64url SHA-256 of the key's bytes. A
// key is header-safe when it is 1 to 255 bytes of ASCII letters, digits and
// "-_.:@/+=", and does not start with "evk_". For replay n > 0 the result
// gets the suffix "~r<n>". The result depends only on its arguments: every
// attempt of an event carries the same id.
func IdempotencyKey(eventKey string, replay int) string {
	id := eventKey
	if !headerSafe(eventKey) {
		sum := sha256.Sum256([]byte(eventKey))
		id = mappedIDPrefix + base64.RawURLEncoding.EncodeToString(sum[:])
	}
	if replay > 0 {
		id += replaySeparator + strconv.Itoa(replay)
	}
	return id
}

// headerSafe reports whether key can be sent verbatim as an id. The
// character set is deliberately narrower than what a header value allows:
// no spaces (receivers trim them, which breaks signatures), no "," or ";"
// (list and parameter separators), no quotes, "\" or "%" (escaping), and
// no "~" (the replay separator).
func headerSafe(key string) bool {
	if key == "" || len(key) > maxRawIDLen || strings.HasPrefix(key, mappedIDPrefix) {
		return false
	}
	for i := 0; i < len(key); i++ {
		c := key[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("-_.:@/+=", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// signingKey returns the HMAC key of a Standard Webhooks secret: a secret
// with the "whsec_" prefix is base64-decoded (standard alphabet), any other
// secret is used as raw bytes.
func signingKey(secret string) ([]byte, error) {
	rest, ok := strings.CutPrefix(secret, "whsec_")
	if !ok {
		if secret == "" {
			return nil, errors.New("empty secret")
		}
		return []byte(secret), nil
	}
	key, err := base64.StdEncoding.DecodeString(rest)
	if err != nil {
		// Not err's text: it would quote part of the secret.
		return nil, errors.New(`a "whsec_" secret must be standard base64 after the prefix`)
	}
	if len(key) == 0 {
		return nil, errors.New(`empty "whsec_" secret`)
	}
	return key, nil
}

// Sign returns the Standard Webhooks signature header value for a message:
// "v1," followed by the standard base64 HMAC-SHA256, keyed by the secret,
// of id + "." + ts + "." + body. A secret with the "whsec_" prefix is
// base64-decoded to the key; any other secret is used as raw bytes. It
// fails only for an empty or undecodable secret.
func Sign(secret, id string, ts int64, body []byte) (string, error) {
	key, err := signingKey(secret)
	if err != nil {
		return "", fmt.Errorf("standard-webhooks secret: %w", err)
	}
	return sign(key, id, strconv.FormatInt(ts, 10), body), nil
}

func sign(key []byte, id, ts string, body []byte) string {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(id))
	mac.Write([]byte{'.'})
	mac.Write([]byte(ts))
	mac.Write([]byte{'.'})
	mac.Write(body)
	return "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
}
