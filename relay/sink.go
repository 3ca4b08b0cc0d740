package relay

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Delivery is one attempt to give one event to one sink.
type Delivery struct {
	Event *Event
	// Body is the event's envelope (or nudge), computed once per event so
	// every attempt sends the same bytes.
	Body []byte
	// Attempt counts attempts of this (event, sink) across both paths,
	// starting at 1; sinks send it in a header.
	Attempt int
	// Replay is 0 for a normal delivery and n for the n-th operator replay;
	// sinks derive a distinct idempotency id from it ("<key>~r<n>").
	Replay int
}

// Sink delivers events to one destination. Implementations are safe for
// concurrent use.
type Sink interface {
	// Name is the sink's configured name, the ledger's action.
	Name() string

	// Send starts delivering d and calls done exactly once, possibly on
	// another goroutine, with nil when the destination acknowledged the event
	// or an error that Classify understands. Send blocks while the sink's
	// window of in-flight deliveries is full (back-pressure) or until ctx is
	// done. Sending the same Delivery again is safe: it carries the same
	// idempotency key and body.
	Send(ctx context.Context, d *Delivery, done func(error))

	// Close waits for in-flight deliveries to call done, up to ctx's
	// deadline, then releases the sink's resources.
	Close(ctx context.Context) error
}

// RunSink is a Sink that can carry a run — consecutive events of one
// aggregate, in commit order — in one request, to a receiver that applies a
// request's events in order and, for each aggregate, applies none after the
// first it does not apply (docs/sinks.md "Ordered batches"). With ordering
// on, a lane gives it runs only while MaxRun is above 1: the operator
// declared that the receiver keeps that contract (batch.ordered); without
// the declaration a lane sends one event of an aggregate at a time, as to
// any Sink.
type RunSink interface {
	Sink

	// MaxRun is the most events one run may hold: 1 when the receiver has
	// not been declared to keep the contract.
	MaxRun() int

	// FitRun returns how many of ds, from the first, one request should
	// carry whole: at least 1 and at most min(len(ds), MaxRun()). A run is
	// never split across two requests, so a delivery that would not fit
	// ends it. aggregates is how many aggregates the lane holds events of,
	// ds's among them: a run takes no more than its share of the requests
	// the sink keeps in flight, so that one aggregate's run does not fill
	// them while the others' events wait.
	FitRun(ds []*Delivery, aggregates int) int

	// SendRun starts delivering ds, a run FitRun accepted whole, in one
	// request and in ds's order, and calls done exactly once, possibly on
	// another goroutine, with one outcome per delivery in ds's order, each
	// as Send's done would report it. It blocks as Send does.
	SendRun(ctx context.Context, ds []*Delivery, done func([]error))
}

// ErrEmptyEventKey is the cause of the Permanent error a Sink reports for an
// event whose event_key is empty. The key is the event's idempotency key —
// its ledger pair, webhook-id and Nats-Msg-Id — so every event with an empty
// key would look like a repeat of the first one and be dropped as a
// duplicate; such an event is dead-lettered instead.
var ErrEmptyEventKey = errors.New("empty event_key: it is the event's idempotency key, so events with an empty key cannot be told apart")

// ErrorClass says what the engine does with a failed delivery.
type ErrorClass int

const (
	// Transient: the event was not processed (not sent, or refused in a way
	// that is safe to retry). Counts as an attempt.
	Transient ErrorClass = iota
	// Unknown: the request was sent and no answer came; the destination may
	// have processed it. Retried with the same id and body, or held.
	Unknown
	// Permanent: the event can never be delivered as it is (payload too
	// large, rejected as invalid). Dead-lettered at once.
	Permanent
	// SinkDown: the sink itself is unusable (credentials, workflow not
	// published, server unreachable for every event). Opens the sink's
	// circuit and does not count as an attempt of the event.
	SinkDown
)

func (c ErrorClass) String() string {
	switch c {
	case Transient:
		return "transient"
	case Unknown:
		return "unknown"
	case Permanent:
		return "permanent"
	case SinkDown:
		return "sink-down"
	default:
		return fmt.Sprintf("ErrorClass(%d)", int(c))
	}
}

// DeliveryError is a classified delivery failure.
type DeliveryError struct {
	Class ErrorClass
	// RetryAfter is the destination's requested delay (Retry-After), or 0.
	RetryAfter time.Duration
	// Status is the destination's answer (an HTTP status), 0 when none
	// came; the log names it (docs/operations.md, "Logs").
	Status int
	Err    error
}

func (e *DeliveryError) Error() string { return e.Class.String() + ": " + e.Err.Error() }
func (e *DeliveryError) Unwrap() error { return e.Err }

// TransientError wraps err as Transient.
func TransientError(err error, retryAfter time.Duration) error {
	return &DeliveryError{Class: Transient, RetryAfter: retryAfter, Err: err}
}

// UnknownError wraps err as Unknown.
func UnknownError(err error) error { return &DeliveryError{Class: Unknown, Err: err} }

// PermanentError wraps err as Permanent.
func PermanentError(err error) error { return &DeliveryError{Class: Permanent, Err: err} }

// SinkDownError wraps err as SinkDown.
func SinkDownError(err error, retryAfter time.Duration) error {
	return &DeliveryError{Class: SinkDown, RetryAfter: retryAfter, Err: err}
}

// Classify returns err's class and requested delay. An unclassified error is
// Unknown: without proof that nothing was sent, the engine must assume it
// may have been.
func Classify(err error) (ErrorClass, time.Duration) {
	var de *DeliveryError
	if errors.As(err, &de) {
		return de.Class, de.RetryAfter
	}
	return Unknown, 0
}
