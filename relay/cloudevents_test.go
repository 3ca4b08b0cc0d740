package relay_test

import (
	"net/url"
	"testing"
	"testing/quick"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestCloudEventsHeaderValue: the HTTP binding's example, and values that
// need no encoding kept as they are.
func TestCloudEventsHeaderValue(t *testing.T) {
	for in, want := range map[string]string{
		"Euro € 😀":                    "Euro%20%E2%82%AC%20%F0%9F%98%80", // HTTP Protocol Binding 3.1.3.2
		"order.placed":                "order.placed",
		"/shop/public/outbox":         "/shop/public/outbox",
		`a"b%c`:                       "a%22b%25c",
		"tab\there\x7f":               "tab%09here%7F",
		"evk_abc-_.:@/+=~r1":          "evk_abc-_.:@/+=~r1",
		"":                            "",
		"2026-12-02T16:17:36.123456Z": "2026-12-02T16:17:36.123456Z",
	} {
		if got := relay.CloudEventsHeaderValue(in); got != want {
			t.Errorf("CloudEventsHeaderValue(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestCloudEventsHeaderValueRoundTrip: every encoded value is printable
// ASCII without space, '"' or a lone '%', and one round of percent-decoding
// gives the value back.
func TestCloudEventsHeaderValueRoundTrip(t *testing.T) {
	err := quick.Check(func(s string) bool {
		if !utf8.ValidString(s) {
			return true
		}
		enc := relay.CloudEventsHeaderValue(s)
		for i := 0; i < len(enc); i++ {
			if c := enc[i]; c <= ' ' || c >= 0x7f || c == '"' {
				return false
			}
		}
		dec, err := url.PathUnescape(enc)
		return err == nil && dec == s
	}, &quick.Config{MaxCount: 2000})
	if err != nil {
		t.Fatal(err)
	}
}
