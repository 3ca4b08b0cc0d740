package relay

import (
	"math/rand/v2"
	"path"
	"strings"
	"time"
	"unicode/utf8"
)

// The delivery policy: what happens to an event after each attempt, on
// either path. It is the only place that decides retries, diversions, holds
// and dead letters (docs/guarantees.md), and the only place with their
// defaults.

// Defaults of the delivery policy (docs/configuration.md, delivery section).
const (
	DefaultInlineAttempts = 3
	DefaultMaxAttempts    = 10
	DefaultLaneBlockMax   = 2 * time.Second
	DefaultLaneCapacity   = 4096
)

// HandOverWindow is how many rows of a new slot's hand-over the engine holds
// unsettled at most (Consumer.HandOver): enough to keep the sinks' windows
// full, few enough that a streamed event queued behind them in a lane
// waits a fraction of a second (docs/architecture.md, "Slot creation").
const HandOverWindow = 2_000

// DefaultBackoff is the claim path's schedule: the delay after n counted
// attempts is DefaultBackoff[n-1] (the last entry repeats), plus 0–10%.
func DefaultBackoff() []time.Duration {
	return []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 2 * time.Minute,
		5 * time.Minute, 15 * time.Minute, 30 * time.Minute, time.Hour}
}

// Policy is the retry, hold and dead-letter rule both paths share. The zero
// value takes the defaults.
type Policy struct {
	// InlineAttempts is how many times the stream tries an event in memory
	// before handing it to the claim path [3]; 0 diverts on the first
	// failure. The claim path makes one attempt per claim.
	InlineAttempts int
	// MaxAttempts dead-letters an event after this many counted attempts [10].
	MaxAttempts int
	// Backoff is the delay before the next claim of a failed event, indexed
	// by counted attempts [DefaultBackoff]; 0–10% jitter is added.
	Backoff []time.Duration
	// LaneBlockMax is how long a full lane may block decoding before the
	// event is diverted instead [2s].
	LaneBlockMax time.Duration
}

func (p *Policy) setDefaults() {
	if p.InlineAttempts < 0 {
		p.InlineAttempts = 0
	}
	if p.MaxAttempts <= 0 {
		p.MaxAttempts = DefaultMaxAttempts
	}
	if len(p.Backoff) == 0 {
		p.Backoff = DefaultBackoff()
	}
	if p.LaneBlockMax <= 0 {
		p.LaneBlockMax = DefaultLaneBlockMax
	}
}

// BackoffAfter returns the delay after attempts counted attempts, with
// 0–10% jitter.
func (p *Policy) BackoffAfter(attempts int) time.Duration {
	b := p.Backoff
	if len(b) == 0 {
		b = DefaultBackoff()
	}
	d := b[min(max(attempts-1, 0), len(b)-1)]
	return d + rand.N(d/10+1)
}

// inlineDelay is the wait before the stream's n-th inline retry (n ≥ 1):
// 100 ms doubling, at most 3.2 s.
func inlineDelay(n int) time.Duration {
	return 100 * time.Millisecond << min(max(n-1, 0), 5)
}

// RetryDelay is the backoff of the relay's own retries of database work
// (attempt ≥ 1): 100 ms doubling to 6.4 s, plus up to 25%.
func RetryDelay(attempt int) time.Duration {
	d := 100 * time.Millisecond << min(max(attempt-1, 0), 6)
	return d + rand.N(d/4+1)
}

// maxReasonBytes bounds an error text written to the database
// (last_error, the ledger's detail).
const maxReasonBytes = 500

// ShortError makes s safe and short for the database: its first line, at
// most 500 bytes cut at a character boundary, invalid UTF-8 replaced and NUL
// bytes dropped (PostgreSQL's text refuses both). Every error text the relay
// stores goes through it.
func ShortError(s string) string {
	if i := strings.IndexAny(s, "\r\n"); i >= 0 {
		s = s[:i]
	}
	s = strings.ToValidUTF8(s, "\uFFFD")
	if strings.IndexByte(s, 0) >= 0 {
		s = strings.ReplaceAll(s, "\x00", "")
	}
	if len(s) > maxReasonBytes {
		n := maxReasonBytes
		for n > 0 && !utf8.RuneStart(s[n]) {
			n--
		}
		s = s[:n]
	}
	return s
}

// joinReasons joins a and b with "; ", keeping the result storable.
func joinReasons(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return ShortError(a + "; " + b)
}

// Matches reports whether a sink with these event_type globs (path.Match
// syntax) takes an event of type eventType: no globs or a "*" take every
// event, including one with a NULL event_type; other globs never match NULL.
func Matches(globs []string, eventType *string) bool {
	if len(globs) == 0 {
		return true
	}
	for _, g := range globs {
		if g == "*" {
			return true
		}
		if eventType != nil {
			if ok, _ := path.Match(g, *eventType); ok {
				return true
			}
		}
	}
	return false
}

// OutcomeKind is what became of one (event, sink) pair.
type OutcomeKind int

const (
	// Delivered: the sink acknowledged the event (now, or before: the
	// ledger showed the pair delivered).
	Delivered OutcomeKind = iota + 1
	// Failed: the event can never be delivered to this sink as it is.
	Failed
	// Held: the outcome is unknown and the sink holds such events.
	Held
	// Retry: a counted attempt failed; try again after the backoff.
	Retry
	// Deferred: not attempted, or failed for a reason that is not the
	// event's (sink down, ordering, shutdown); try again at Until without
	// counting an attempt.
	Deferred
)

// Outcome is the result of one (event, sink) pair.
type Outcome struct {
	Kind   OutcomeKind
	Reason string // ShortError text, "" when delivered
	// Until is when a Deferred pair may be tried again; for Retry, the
	// destination's requested delay as an instant (Retry-After), or zero.
	Until time.Time
	// Unknown is set when a send's outcome is unknown: the sink may have
	// the event. Whoever sends it next sends the same id and body.
	Unknown bool
	// Why is the handed_off_total reason label of a Deferred pair.
	Why string
	// Counted is how many attempts of this pass count against
	// max_attempts.
	Counted int
}

// DecisionKind is what becomes of an event once every routed sink has an
// outcome.
type DecisionKind int

const (
	// Done: delivered to every routed sink.
	Done DecisionKind = iota + 1
	// DeadLetter: status failed, with the reasons.
	DeadLetter
	// Hold: status held, for a person (dlq list).
	Hold
	// Later: the claim path tries again at At (the stream diverts the
	// event). Attempts counts the attempts so far.
	Later
	// Skip: the event is no longer this path's (the stream met a row it
	// does not own, or one inserted settled): nothing is written.
	Skip
)

// Decision is the settlement of one event.
type Decision struct {
	Kind     DecisionKind
	At       time.Time // Later: when the claim path may take it
	Attempts int       // the row's attempts after this pass
	Reason   string    // last_error: which sinks failed and why
	Why      string    // Later without a counted attempt: the metric reason
}

// decide turns the pairs' outcomes into the event's decision: any failure
// dead-letters it; else an unknown outcome at a hold sink holds it; else a
// counted failure retries it after the backoff, or dead-letters it at
// MaxAttempts; else a deferred pair puts it back without counting; else it
// is done. attempts is the row's count before this pass; each pair's
// Counted says how many attempts of this pass count (the most of them is
// added).
func (p *Policy) decide(now time.Time, attempts int, outcomes []Outcome, sinks []string) Decision {
	var failed, held, retry, deferred string
	var retryAt, deferAt time.Time
	why := ""
	counted := 0
	for i, o := range outcomes {
		prefix := sinkReason(sinks[i], "")
		counted = max(counted, o.Counted)
		switch o.Kind {
		case Failed:
			failed = joinReasons(failed, prefix+o.Reason)
		case Held:
			held = joinReasons(held, prefix+o.Reason)
		case Retry:
			retry = joinReasons(retry, prefix+o.Reason)
			if o.Until.After(retryAt) {
				retryAt = o.Until
			}
		case Deferred:
			deferred = joinReasons(deferred, prefix+o.Reason)
			if o.Until.After(deferAt) {
				deferAt = o.Until
			}
			if why == "" {
				why = o.Why
			}
		}
	}
	attempts += counted
	switch {
	case failed != "":
		return Decision{Kind: DeadLetter, Attempts: attempts, Reason: failed}
	case held != "":
		return Decision{Kind: Hold, Attempts: attempts, Reason: held}
	case retry != "" && attempts >= p.MaxAttempts:
		return Decision{Kind: DeadLetter, Attempts: attempts, Reason: ShortError(maxAttemptsReached + retry)}
	case retry != "":
		at := now.Add(p.BackoffAfter(attempts))
		at = laterOf(at, retryAt, deferAt)
		return Decision{Kind: Later, At: at, Attempts: attempts, Reason: joinReasons(retry, deferred), Why: "retries"}
	case deferred != "":
		return Decision{Kind: Later, At: laterOf(now, deferAt), Attempts: attempts, Reason: deferred, Why: why}
	default:
		return Decision{Kind: Done, Attempts: attempts}
	}
}

func laterOf(ts ...time.Time) time.Time {
	var out time.Time
	for _, t := range ts {
		if t.After(out) {
			out = t
		}
	}
	return out
}
