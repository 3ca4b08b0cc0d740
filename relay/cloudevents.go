package relay

import (
	"errors"
	"time"
)

// CloudEvents (docs/ecosystem.md): a sink with `format: cloudevents` sends
// each event in the binary content mode of the CloudEvents HTTP and NATS
// protocol bindings: the context attributes are ce- headers, the body is the
// event's payload.

// CloudEventsSpecVersion is the CloudEvents version the sinks speak.
const CloudEventsSpecVersion = "1.0"

// CloudEventsContentType is the datacontenttype of every event: the body is
// the payload, jsonb's text.
const CloudEventsContentType = "application/json"

// ErrNoEventType is the cause of the Permanent error a sink with format
// cloudevents reports for an event whose event_type is NULL or empty: type
// is a required CloudEvents attribute, and the relay does not invent one.
var ErrNoEventType = errors.New("event_type is NULL or empty: a CloudEvent needs a type (ce-type)")

// Header is one message header.
type Header struct{ Name, Value string }

// CloudEventsHeaders returns the context attributes of ev as the binary
// content mode's headers, in lower case, values percent-encoded as the
// bindings require (CloudEventsHeaderValue):
//
//	ce-specversion  1.0
//	ce-id           id: the sink's stable delivery id (its idempotency key)
//	ce-source       source
//	ce-type         event_type
//	ce-subject      "<aggregate_type>/<aggregate_id>"; the one that is not
//	                NULL when the other is; absent when both are
//	ce-time         the commit time (stream path), else created_at (claim
//	                path: the commit time is not known there); absent when
//	                neither is known
//
// datacontenttype is the binding's business: Content-Type in HTTP,
// ce-datacontenttype in NATS. It fails with ErrNoEventType.
func CloudEventsHeaders(ev *Event, id, source string) ([]Header, error) {
	if ev.EventType == nil || *ev.EventType == "" {
		return nil, ErrNoEventType
	}
	h := make([]Header, 0, 6)
	h = append(h,
		Header{"ce-specversion", CloudEventsSpecVersion},
		Header{"ce-id", CloudEventsHeaderValue(id)},
		Header{"ce-source", CloudEventsHeaderValue(source)},
		Header{"ce-type", CloudEventsHeaderValue(*ev.EventType)})
	switch {
	case ev.AggregateType != nil && ev.AggregateID != nil:
		h = append(h, Header{"ce-subject", CloudEventsHeaderValue(*ev.AggregateType + "/" + *ev.AggregateID)})
	case ev.AggregateType != nil:
		h = append(h, Header{"ce-subject", CloudEventsHeaderValue(*ev.AggregateType)})
	case ev.AggregateID != nil:
		h = append(h, Header{"ce-subject", CloudEventsHeaderValue(*ev.AggregateID)})
	}
	if t := CloudEventsTime(ev); !t.IsZero() {
		h = append(h, Header{"ce-time", t.UTC().Format(time.RFC3339Nano)})
	}
	return h, nil
}

// CloudEventsTime is the event's ce-time: its commit time when the stream
// decoded it, its created_at on the claim path; zero when neither is known.
func CloudEventsTime(ev *Event) time.Time {
	if !ev.CommitTime.IsZero() {
		return ev.CommitTime
	}
	return ev.CreatedAt
}

// CloudEventsData returns the body of ev in the binary content mode: its
// payload, or JSON null when the payload is NULL.
func CloudEventsData(ev *Event) []byte {
	if ev.Payload == nil {
		return []byte("null")
	}
	return ev.Payload
}

// CloudEventsHeaderValue percent-encodes s as the CloudEvents HTTP and NATS
// bindings require of a header value (HTTP Protocol Binding 3.1.3.2): space,
// double quote, percent and every byte outside printable ASCII become %XY,
// upper-case hex of each UTF-8 byte; everything else is kept. A value that
// needs no encoding is returned as is.
func CloudEventsHeaderValue(s string) string {
	n := 0
	for i := 0; i < len(s); i++ {
		if mustPercentEncode(s[i]) {
			n++
		}
	}
	if n == 0 {
		return s
	}
	const upperHex = "0123456789ABCDEF"
	out := make([]byte, 0, len(s)+2*n)
	for i := 0; i < len(s); i++ {
		b := s[i]
		if mustPercentEncode(b) {
			out = append(out, '%', upperHex[b>>4], upperHex[b&0xF])
			continue
		}
		out = append(out, b)
	}
	return string(out)
}

func mustPercentEncode(b byte) bool { return b <= ' ' || b >= 0x7f || b == '"' || b == '%' }
