package webhook_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

func TestHeaders(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Headers: map[string]string{"X-Tenant": "acme", "user-agent": "relay-test"}})

	const key = "order:42.created"
	d := newDelivery(key, `{"id":42}`)
	d.Attempt = 3
	before := time.Now().Unix()
	if err := send(t, s, d); err != nil {
		t.Fatal(err)
	}
	after := time.Now().Unix()
	replay := newDelivery(key, `{"id":42}`)
	replay.Replay = 2
	if err := send(t, s, replay); err != nil {
		t.Fatal(err)
	}

	reqs := rc.Requests()
	if len(reqs) != 2 {
		t.Fatalf("receiver saw %d requests, want 2", len(reqs))
	}
	h := reqs[0].Header
	for name, want := range map[string]string{
		"Content-Type":     "application/json",
		"Idempotency-Key":  key,
		"Webhook-Id":       key,
		"Webhook-Attempt":  "3",
		"Outbox-Event-Key": key,
		"X-Tenant":         "acme",
		"User-Agent":       "relay-test",
	} {
		if got := h.Get(name); got != want {
			t.Errorf("%s = %q, want %q", name, got, want)
		}
	}
	ts, err := strconv.ParseInt(h.Get("Webhook-Timestamp"), 10, 64)
	if err != nil || ts < before || ts > after {
		t.Errorf("webhook-timestamp %q, want unix seconds in [%d, %d]", h.Get("Webhook-Timestamp"), before, after)
	}
	if h.Get("Webhook-Signature") != "" || h.Get("Authorization") != "" {
		t.Errorf("auth none sent a signature or Authorization header")
	}
	if string(reqs[0].Body) != `{"id":42}` {
		t.Errorf("body %q, want the delivery's bytes", reqs[0].Body)
	}

	h = reqs[1].Header
	for name, want := range map[string]string{
		"Idempotency-Key":  key + "~r2",
		"Webhook-Id":       key + "~r2",
		"Outbox-Event-Key": key,
		"Webhook-Attempt":  "1",
	} {
		if got := h.Get(name); got != want {
			t.Errorf("replay: %s = %q, want %q", name, got, want)
		}
	}
}

func TestTimestampIsFreshPerAttempt(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL})
	d := newDelivery("k", `{}`)
	if err := send(t, s, d); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	d.Attempt = 2
	if err := send(t, s, d); err != nil {
		t.Fatal(err)
	}
	reqs := rc.Requests()
	first, _ := strconv.ParseInt(reqs[0].Header.Get("Webhook-Timestamp"), 10, 64)
	second, _ := strconv.ParseInt(reqs[1].Header.Get("Webhook-Timestamp"), 10, 64)
	if second <= first {
		t.Fatalf("timestamps %d then %d: the second attempt reused the first's", first, second)
	}
	if reqs[0].Header.Get("Webhook-Id") != reqs[1].Header.Get("Webhook-Id") {
		t.Fatalf("the id changed between attempts")
	}
}

var mappedID = regexp.MustCompile(`^evk_[A-Za-z0-9_-]{43}$`)

func TestHeaderUnsafeKeysAreMapped(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL})

	unsafe := map[string]string{
		"non-ASCII":            "commande-é-42",
		"space":                "order 42",
		"comma":                "a,b",
		"quote":                `a"b`,
		"control":              "a\x01b",
		"newline":              "a\nb",
		"tilde (replay sep.)":  "a~r1",
		"mapped prefix":        "evk_abc",
		"empty":                "",
		"256 bytes":            strings.Repeat("k", 256),
		"invalid UTF-8":        "a\xffb",
		"percent (escaping)":   "a%20b",
		"backslash":            `a\b`,
		"semicolon (params)":   "a;b",
		"unicode line sep.":    "a\u2028b",
		"trailing space":       "abc ",
		"header-like injected": "x\r\nX-Evil: 1",
	}
	for name, key := range unsafe {
		t.Run(name, func(t *testing.T) {
			sum := sha256.Sum256([]byte(key))
			want := "evk_" + base64.RawURLEncoding.EncodeToString(sum[:])
			if got := webhook.IdempotencyKey(key, 0); got != want || !mappedID.MatchString(got) {
				t.Fatalf("IdempotencyKey(%q) = %q, want %q", key, got, want)
			}
			if got := webhook.IdempotencyKey(key, 3); got != want+"~r3" {
				t.Fatalf("IdempotencyKey(%q, 3) = %q, want %q", key, got, want+"~r3")
			}
		})
	}

	// Over the wire: the same key gets the same printable id every time,
	// and no Outbox-Event-Key header.
	const key = "commande é 42"
	for range 2 {
		if err := send(t, s, newDelivery(key, `{}`)); err != nil {
			t.Fatal(err)
		}
	}
	reqs := rc.Requests()
	id := reqs[0].Header.Get("Webhook-Id")
	if !mappedID.MatchString(id) || id != webhook.IdempotencyKey(key, 0) {
		t.Fatalf("webhook-id %q is not the mapped id", id)
	}
	for _, r := range reqs {
		if r.Header.Get("Webhook-Id") != id || r.Header.Get("Idempotency-Key") != id {
			t.Fatalf("ids differ between sends: %q / %q, want %q", r.Header.Get("Webhook-Id"), r.Header.Get("Idempotency-Key"), id)
		}
		if _, ok := r.Header["Outbox-Event-Key"]; ok {
			t.Fatalf("Outbox-Event-Key sent for a header-unsafe key")
		}
	}
}

func TestHeaderSafeKeysAreSentVerbatim(t *testing.T) {
	t.Parallel()
	for _, key := range []string{
		"order-42", "order.placed.42", "tenant/order:42", "user@example.com", "b64+/=",
		"0f8fad5b-d9cb-469f-a165-70867728950e", strings.Repeat("k", 255), "evk", "EVK_upper-is-not-the-prefix",
	} {
		if got := webhook.IdempotencyKey(key, 0); got != key {
			t.Errorf("IdempotencyKey(%q) = %q, want the key", key, got)
		}
		if got := webhook.IdempotencyKey(key, 1); got != key+"~r1" {
			t.Errorf("IdempotencyKey(%q, 1) = %q, want %q", key, got, key+"~r1")
		}
	}
}

func TestSignStandardWebhooksVector(t *testing.T) {
	t.Parallel()
	// The test vector published with the Standard Webhooks specification.
	got, err := webhook.Sign("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek",
		1614265330, []byte(`{"test": 2432232314}`))
	if err != nil {
		t.Fatal(err)
	}
	if want := "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="; got != want {
		t.Fatalf("Sign = %q, want %q", got, want)
	}
}

func TestSignRawSecret(t *testing.T) {
	t.Parallel()
	got, err := webhook.Sign("plain secret", "id", 7, []byte("body"))
	if err != nil {
		t.Fatal(err)
	}
	mac := hmac.New(sha256.New, []byte("plain secret"))
	mac.Write([]byte("id.7.body"))
	if want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil)); got != want {
		t.Fatalf("Sign = %q, want %q", got, want)
	}
	for _, bad := range []string{"", "whsec_", "whsec_not*base64"} {
		if _, err := webhook.Sign(bad, "id", 7, nil); err == nil {
			t.Errorf("Sign with secret %q succeeded", bad)
		}
	}
}

func TestStandardWebhooksRequestVerifies(t *testing.T) {
	t.Parallel()
	const secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Auth: webhook.Auth{Type: webhook.AuthStandardWebhooks, Secret: secret}})
	for _, d := range []*relay.Delivery{newDelivery("k-1", `{"a":1}`), newDelivery("ünsafe", `{"b":2}`)} {
		if err := send(t, s, d); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range rc.Requests() {
		ts, err := strconv.ParseInt(r.Header.Get("Webhook-Timestamp"), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		want, err := webhook.Sign(secret, r.Header.Get("Webhook-Id"), ts, r.Body)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.Header.Get("Webhook-Signature"); got != want {
			t.Fatalf("webhook-signature %q, want %q", got, want)
		}
	}
}

func TestJWTAuth(t *testing.T) {
	t.Parallel()
	const secret = "n8n-jwt-passphrase"
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Auth: webhook.Auth{Type: webhook.AuthJWT, Secret: secret}})
	before := time.Now().Unix()
	if err := send(t, s, newDelivery("order-7", `{}`)); err != nil {
		t.Fatal(err)
	}
	auth := rc.Requests()[0].Header.Get("Authorization")
	raw, ok := strings.CutPrefix(auth, "Bearer ")
	if !ok {
		t.Fatalf("Authorization %q is not a bearer token", auth)
	}
	claims := jwt.MapClaims{}
	tok, err := jwt.ParseWithClaims(raw, claims, func(*jwt.Token) (any, error) { return []byte(secret), nil },
		jwt.WithValidMethods([]string{"HS256"}), jwt.WithIssuedAt(), jwt.WithExpirationRequired())
	if err != nil || !tok.Valid {
		t.Fatalf("token does not verify: %v", err)
	}
	if claims["event_key"] != "order-7" {
		t.Errorf("event_key claim %v, want order-7", claims["event_key"])
	}
	iat, _ := claims.GetIssuedAt()
	exp, _ := claims.GetExpirationTime()
	if iat.Unix() < before || iat.Unix() > time.Now().Unix() {
		t.Errorf("iat %v is not the send time", iat)
	}
	if d := exp.Sub(iat.Time); d != 5*time.Minute {
		t.Errorf("exp - iat = %v, want 5m", d)
	}
	if _, err := jwt.Parse(raw, func(*jwt.Token) (any, error) { return []byte("wrong"), nil }); err == nil {
		t.Errorf("token verifies with the wrong key")
	}
}

func TestHeaderAndBasicAuth(t *testing.T) {
	t.Parallel()
	rc := MustReceiver(t, nil)
	header := MustSink(t, webhook.Config{URL: rc.URL, Auth: webhook.Auth{Type: webhook.AuthHeader, Header: "x-api-key", Value: "s3cret"}})
	basic := MustSink(t, webhook.Config{URL: rc.URL, Auth: webhook.Auth{Type: webhook.AuthBasic, Username: "relay", Password: "pa:ss"}})
	if err := send(t, header, newDelivery("k", `{}`)); err != nil {
		t.Fatal(err)
	}
	if err := send(t, basic, newDelivery("k", `{}`)); err != nil {
		t.Fatal(err)
	}
	reqs := rc.Requests()
	if got := reqs[0].Header.Get("X-Api-Key"); got != "s3cret" {
		t.Errorf("X-Api-Key = %q", got)
	}
	want := "Basic " + base64.StdEncoding.EncodeToString([]byte("relay:pa:ss"))
	if got := reqs[1].Header.Get("Authorization"); got != want {
		t.Errorf("Authorization = %q, want %q", got, want)
	}
}

// verifyStandardWebhooks is a receiver's check, as the Standard Webhooks
// spec describes it: the header holds space-separated "v1,<sig>" values,
// and the request is authentic when any of them matches.
func verifyStandardWebhooks(secret, id, ts string, body []byte, header string) bool {
	n, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return false
	}
	want, err := webhook.Sign(secret, id, n, body)
	if err != nil {
		return false
	}
	for _, sig := range strings.Fields(header) {
		if hmac.Equal([]byte(sig), []byte(want)) {
			return true
		}
	}
	return false
}

// TestStandardWebhooksKeyRotation: with two secrets (old and new, space
// separated) every request carries two signatures, so receivers on either
// secret accept it during the rotation; a third secret verifies nothing.
func TestStandardWebhooksKeyRotation(t *testing.T) {
	t.Parallel()
	const oldSecret, newSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_c2Vjb25kIHNlY3JldCBmb3Igcm90YXRpb24="
	rc := MustReceiver(t, nil)
	s := MustSink(t, webhook.Config{URL: rc.URL, Auth: webhook.Auth{Type: webhook.AuthStandardWebhooks, Secret: oldSecret + " " + newSecret}})
	if err := send(t, s, newDelivery("k-rot", `{"a":1}`)); err != nil {
		t.Fatal(err)
	}
	r := rc.Requests()[0]
	header := r.Header.Get("Webhook-Signature")
	if n := len(strings.Fields(header)); n != 2 {
		t.Fatalf("webhook-signature %q: %d signatures, want 2", header, n)
	}
	id, ts := r.Header.Get("Webhook-Id"), r.Header.Get("Webhook-Timestamp")
	for _, secret := range []string{oldSecret, newSecret} {
		if !verifyStandardWebhooks(secret, id, ts, r.Body, header) {
			t.Fatalf("a receiver holding %s... rejects the request", secret[:10])
		}
	}
	if verifyStandardWebhooks("whsec_dW5yZWxhdGVk", id, ts, r.Body, header) {
		t.Fatal("an unrelated secret verified")
	}
}
