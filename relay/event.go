package relay

import (
	"slices"
	"strconv"
	"time"
	"unicode/utf8"
)

// Event is one outbox row, as the stream decodes it or the claim path reads
// it. Nullable columns are nil when NULL.
type Event struct {
	ID            int64
	EventKey      string
	EventType     *string
	AggregateType *string
	AggregateID   *string
	Payload       []byte // jsonb's text form; nil when NULL
	CreatedAt     time.Time
	AvailableAt   time.Time // zero when unknown
	Attempts      int       // attempts already made by the claim path
	// Status is the row's status when it was inserted or claimed; "" is
	// taken as pending. The stream skips rows inserted with another status.
	Status string

	// CommitLSN places a streamed event's transaction in the WAL;
	// CommitTime is when it committed (the server's clock); Xid is the
	// transaction's id, which tells a deleted row from one whose commit is
	// not visible yet (StreamStore.Gone). All are zero for a row read from
	// the table (the claim path, a new slot's hand-over): it was visible
	// when read.
	CommitLSN  LSN
	CommitTime time.Time
	Xid        uint32

	// TraceContext is the trace_context column's text (jsonb), nil when
	// NULL or when the table has no such column. Trace is what the engine
	// read from it when it took the event (ParseTraceContext); the sinks
	// forward Trace (docs/ecosystem.md).
	TraceContext []byte
	Trace        TraceHeaders

	// payload caches Payload decoded for the sinks' filters
	// (PayloadValue); nil until one asks.
	payload *decodedPayload
}

// Type returns the event type, or "" when NULL.
func (e *Event) Type() string { return deref(e.EventType) }

// Ordered reports whether the event belongs to an aggregate: events with a
// NULL aggregate_type or aggregate_id are unordered.
func (e *Event) Ordered() bool { return e.AggregateType != nil && e.AggregateID != nil }

// AggregateKey identifies the event's aggregate for ordering; it is only
// meaningful when Ordered.
func (e *Event) AggregateKey() AggregateKey {
	return AggregateKey{Type: deref(e.AggregateType), ID: deref(e.AggregateID)}
}

// AggregateKey is (aggregate_type, aggregate_id).
type AggregateKey struct{ Type, ID string }

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// Size is what the engine counts of the event against its byte budget
// (delivery.max_inflight_bytes, docs/performance.md "Memory"): the columns
// as read, and the body built from them once for every sink (the envelope,
// which copies them, payload included).
func (e *Event) Size() int64 {
	read := len(e.Payload) + len(e.TraceContext) + len(e.EventKey) + len(deref(e.EventType)) +
		len(deref(e.AggregateType)) + len(deref(e.AggregateID))
	return int64(2*read + envelopeFrame)
}

// envelopeFrame is about what an envelope adds to the columns it copies: the
// field names, quotes and timestamp.
const envelopeFrame = 160

// envelopeTime is created_at in UTC with microseconds, PostgreSQL's
// precision, so both paths render the same instant the same way.
const envelopeTime = "2006-01-02T15:04:05.000000Z07:00"

// AppendEnvelope appends the event's JSON envelope to dst:
//
//	{"id","event_key","event_type","aggregate_type","aggregate_id","payload","created_at"}
//
// The bytes depend only on the row, so every attempt on either path sends
// the same body. payload is jsonb's text form, verbatim; AppendEnvelope does
// not check it, so the envelope is valid JSON only because jsonb's text is
// (migrate refuses a payload column of another type).
func (e *Event) AppendEnvelope(dst []byte) []byte {
	// One allocation for the usual envelope (escapes may still grow it).
	dst = slices.Grow(dst, envelopeFrame+len(e.EventKey)+len(deref(e.EventType))+len(deref(e.AggregateType))+len(deref(e.AggregateID))+len(e.Payload))
	dst = append(dst, `{"id":`...)
	dst = strconv.AppendInt(dst, e.ID, 10)
	dst = append(dst, `,"event_key":`...)
	dst = AppendJSONString(dst, e.EventKey)
	dst = append(dst, `,"event_type":`...)
	dst = appendNullableString(dst, e.EventType)
	dst = append(dst, `,"aggregate_type":`...)
	dst = appendNullableString(dst, e.AggregateType)
	dst = append(dst, `,"aggregate_id":`...)
	dst = appendNullableString(dst, e.AggregateID)
	dst = append(dst, `,"payload":`...)
	if e.Payload == nil {
		dst = append(dst, "null"...)
	} else {
		dst = append(dst, e.Payload...)
	}
	dst = append(dst, `,"created_at":"`...)
	dst = e.CreatedAt.UTC().AppendFormat(dst, envelopeTime)
	return append(dst, `"}`...)
}

// AppendNudge appends the short body of `body: nudge`: {"id","event_key","event_type"}.
func (e *Event) AppendNudge(dst []byte) []byte {
	dst = append(dst, `{"id":`...)
	dst = strconv.AppendInt(dst, e.ID, 10)
	dst = append(dst, `,"event_key":`...)
	dst = AppendJSONString(dst, e.EventKey)
	dst = append(dst, `,"event_type":`...)
	dst = appendNullableString(dst, e.EventType)
	return append(dst, '}')
}

func appendNullableString(dst []byte, s *string) []byte {
	if s == nil {
		return append(dst, "null"...)
	}
	return AppendJSONString(dst, *s)
}

const hexDigits = "0123456789abcdef"

// AppendJSONString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD,
// as encoding/json does; <, > and & are not escaped (the body is not HTML).
func AppendJSONString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		b := s[i]
		if b < utf8.RuneSelf {
			if b >= 0x20 && b != '"' && b != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch b {
			case '"', '\\':
				dst = append(dst, '\\', b)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[b>>4], hexDigits[b&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i += size
			start = i
			continue
		}
		// U+2028 and U+2029 are valid JSON but break JavaScript parsers.
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
