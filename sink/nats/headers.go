package nats

import (
	"encoding/base64"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Header names set on every message. Nats-Msg-Id is JetStream's
// deduplication id (jetstream.MsgIDHeader).
const (
	HeaderEventKey         = "Outbox-Event-Key"
	HeaderOriginalEventKey = "Outbox-Original-Event-Key" // replays only
	HeaderEventType        = "Outbox-Event-Type"         // absent when NULL
	HeaderAggregateType    = "Outbox-Aggregate-Type"     // absent when NULL
	HeaderAggregateID      = "Outbox-Aggregate-Id"       // absent when NULL
	HeaderEventID          = "Outbox-Event-Id"
	HeaderAttempt          = "Outbox-Attempt"
	// HeaderDeployment is the Deployment.ID the message was published
	// under: with HeaderEventKey, what identifies the event among every
	// deployment publishing into the stream.
	HeaderDeployment = "Outbox-Deployment"
	// The producer's W3C trace context, when the event has a valid one
	// (relay.TraceHeaders): the same on every attempt and replay.
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
	// HeaderCloudEventsContentType is datacontenttype in the binary
	// content mode of the CloudEvents NATS binding (format cloudevents).
	HeaderCloudEventsContentType = "ce-datacontenttype"
)

// EncodedPrefix marks a header value that could not travel verbatim and is
// sent as EncodedPrefix + base64url(value) (RFC 4648 §5, no padding).
const EncodedPrefix = "b64:"

// maxHeaderSize is JetStream's limit on a stored message's headers.
const maxHeaderSize = 1<<16 - 1

// HeaderValue returns v as it is sent in a header. nats.go trims surrounding
// whitespace and replaces CR and LF in header values, so two distinct event
// keys could arrive as one Nats-Msg-Id and the second would be dropped as a
// duplicate. A value that is empty, has surrounding whitespace, control
// characters or invalid UTF-8, or itself starts with EncodedPrefix is
// therefore sent as EncodedPrefix + base64url(v): the mapping is injective and
// deterministic, and every ordinary key is sent unchanged.
func HeaderValue(v string) string {
	if headerSafe(v) {
		return v
	}
	return EncodedPrefix + base64.RawURLEncoding.EncodeToString([]byte(v))
}

func headerSafe(v string) bool {
	if v == "" || strings.HasPrefix(v, EncodedPrefix) || !utf8.ValidString(v) {
		return false
	}
	if isSpace(v[0]) || isSpace(v[len(v)-1]) {
		return false
	}
	for i := 0; i < len(v); i++ {
		if b := v[i]; b < 0x20 || b == 0x7f {
			return false
		}
	}
	return true
}

func isSpace(b byte) bool { return b == ' ' || b == '\t' }

// buildHeader returns the message headers of d as dep publishes it.
func buildHeader(dep Deployment, d *relay.Delivery) nats.Header {
	e := d.Event
	key := HeaderValue(e.EventKey)
	h := make(nats.Header, 9)
	h.Set(jetstream.MsgIDHeader, dep.MsgID(d))
	h.Set(HeaderDeployment, dep.ID)
	h.Set(HeaderEventKey, key)
	if d.Replay > 0 {
		h.Set(HeaderOriginalEventKey, key)
	}
	setNullable(h, HeaderEventType, e.EventType)
	setNullable(h, HeaderAggregateType, e.AggregateType)
	setNullable(h, HeaderAggregateID, e.AggregateID)
	h.Set(HeaderEventID, strconv.FormatInt(e.ID, 10))
	h.Set(HeaderAttempt, strconv.Itoa(d.Attempt))
	if e.Trace.Traceparent != "" {
		h.Set(HeaderTraceparent, e.Trace.Traceparent)
		if e.Trace.Tracestate != "" {
			h.Set(HeaderTracestate, e.Trace.Tracestate)
		}
	}
	return h
}

func setNullable(h nats.Header, name string, v *string) {
	if v != nil {
		h.Set(name, HeaderValue(*v))
	}
}

// headerSize is the encoded size of h as nats.go writes it ("NATS/1.0\r\n",
// "Key: value\r\n" per value, "\r\n"); values from buildHeader need no
// trimming, so the size is exact.
func headerSize(h nats.Header) int {
	if len(h) == 0 {
		return 0
	}
	n := len("NATS/1.0\r\n") + len("\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": ") + len(v) + len("\r\n")
		}
	}
	return n
}
