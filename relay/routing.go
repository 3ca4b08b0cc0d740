package relay

import (
	"fmt"

	"golang.org/x/time/rate"
)

// Route connects a sink to the engine.
type Route struct {
	Sink Sink
	// Events lists the event_type globs (path.Match syntax) the sink takes;
	// empty means all. A NULL event_type matches only "*".
	Events []string
	// Nudge sends {"id","event_key","event_type"} instead of the envelope.
	Nudge bool
	// RateLimit, when set, bounds the events sent to the sink per second
	// (NewRateLimit; docs/sinks.md, "Rate limits"); share one per sink
	// across the process's engines.
	RateLimit *rate.Limiter
	// Hold (on_unknown: hold) claims each event in the ledger before sending
	// and holds it for a person when the outcome is unknown, instead of
	// sending it again.
	Hold bool
	// Filter, when set, is the sink's sinks[].filter: the sink takes only
	// the events it accepts (Takes).
	Filter Filter
}

// Takes reports whether r's sink takes ev: the one routing rule
// (docs/configuration.md, "sinks"; docs/sinks.md, "Filters"). The engine
// routes every event by it, and verify, status, dlq and event (ledger/admin,
// cmd/outbox-relay) judge by it which sinks an outbox row should have
// reached, so a rule added here changes them all at once. A reader that
// gives it less than the row (no payload, no aggregate) judges a sink with
// a filter wrongly: every caller reads the columns Filter reads.
//
// A sink takes an event whose type matches its globs and, when it has a
// filter, that the filter accepts. When the filter fails on ev (a missing
// field, a type error), Takes returns true with the error: the pair is
// routed and dead-lettered with that error, never sent (docs/sinks.md,
// "Filters").
func (r *Route) Takes(ev *Event) (bool, error) {
	if !Matches(r.Events, ev.EventType) {
		return false, nil
	}
	if r.Filter == nil {
		return true, nil
	}
	ok, err := r.Filter.Match(ev)
	if err != nil {
		return true, fmt.Errorf("filter: %w", err)
	}
	return ok, nil
}

// Filter is a sink's compiled sinks[].filter (docs/sinks.md, "Filters").
// Its implementation (relay/celfilter) lives beside relay so that relay
// depends on no expression language.
type Filter interface {
	// Match reports whether the sink takes ev. An error says the filter
	// could not be evaluated on ev; it is the event's, never transient,
	// and the same on every call. Match must be cheap and bounded: it runs
	// once per event and sink on the routing step.
	Match(ev *Event) (bool, error)
}

// PayloadValue returns ev's payload decoded (DecodePayload). It decodes
// once per Event however many sinks' filters ask, while the event is
// routed; it is not safe for concurrent use, as an event is routed on one
// goroutine. The engine forgets the decoded value once the event is routed
// (route): the byte budget counts the payload's text only. A sink, which
// may run beside another on the same event, calls DecodePayload.
func (ev *Event) PayloadValue() (any, error) {
	if ev.payload == nil {
		p := &decodedPayload{}
		p.v, p.err = DecodePayload(ev.Payload)
		ev.payload = p
	}
	return ev.payload.v, ev.payload.err
}

// decodedPayload is an Event's payload once decoded (PayloadValue).
type decodedPayload struct {
	v   any
	err error
}
