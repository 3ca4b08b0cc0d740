package relay

import (
	"errors"
	"strconv"
	"time"
)

// What a lane logs (docs/operations.md, "Logs"): a delivery failure once
// per event and change — its first failure at the sink, then another
// status or another next step (the claim path, the dead letter, a hold) —
// and one line when an event that failed is delivered; a circuit's opening,
// at most one summary a minute while it stays open, and its closing. Never
// a line per attempt or per probe, never a payload.

// The next steps a failure line names.
const (
	nextInlineRetry = "inline_retry"
	nextClaimPath   = "claim_path"
	nextDeadLetter  = "dead_letter"
	nextHeld        = "held"
)

// failNote is what a lane knows of one event's failures at its sink.
type failNote struct {
	status  string // the last failure's: an HTTP status or the error's class
	attempt int    // the last failure's attempt number
	logged  string // status and next step of the last line logged; "" none
}

// failNotesMax bounds a lane's failure notes; an event whose note was
// dropped logs its next failure again.
const failNotesMax = 10_000

// failureStatus names a failure in the log: the destination's answer when
// it gave one, else the error's class.
func failureStatus(err error, class ErrorClass) string {
	var de *DeliveryError
	if errors.As(err, &de) && de.Status != 0 {
		return strconv.Itoa(de.Status)
	}
	return class.String()
}

// noteFailure records a failed attempt of t's event that counts.
func (l *lane) noteFailure(t *task, status string) {
	id := t.w.Event.ID
	l.mu.Lock()
	defer l.mu.Unlock()
	n := l.failures[id]
	n.status, n.attempt = status, t.w.Event.Attempts+t.tries
	l.putNote(id, n)
}

// putNote stores the note of event id, dropping another one when the lane
// holds failNotesMax; l.mu is held.
func (l *lane) putNote(id int64, n failNote) {
	if _, ok := l.failures[id]; !ok && len(l.failures) >= failNotesMax {
		for other := range l.failures {
			delete(l.failures, other)
			break
		}
	}
	l.failures[id] = n
}

// logFailure logs w's last failure here and its next step, unless the last
// line about it said the same. A dead letter or a hold ends what the lane
// keeps of the event.
func (l *lane) logFailure(w *Work, next string, at time.Time, reason string) {
	id := w.Event.ID
	l.mu.Lock()
	n, ok := l.failures[id]
	if !ok {
		// Never sent in this process: an unknown outcome found in the
		// ledger, or a note dropped.
		n = failNote{status: Unknown.String(), attempt: w.Event.Attempts}
	}
	said := n.status + " " + next
	repeat := n.logged == said
	n.logged = said
	if next == nextDeadLetter || next == nextHeld {
		delete(l.failures, id)
	} else {
		l.putNote(id, n)
	}
	l.mu.Unlock()
	if repeat {
		return
	}
	ev := l.e.log.Warn().Str("sink", l.name).Str("path", string(w.path)).Int64("id", id).Str("event_key", w.Event.EventKey).
		Str("status", n.status).Int("attempt", n.attempt).Str("next", next)
	if !at.IsZero() {
		ev = ev.Time("next_at", at.UTC())
	}
	ev = ev.Str("error", reason)
	switch next {
	case nextInlineRetry:
		ev.Msg("delivery failed: retrying inline")
	case nextClaimPath:
		ev.Msg("delivery failed: diverted to the claim path")
	case nextDeadLetter:
		ev.Msg("delivery failed: dead-lettered; see outbox-relay dlq list")
	case nextHeld:
		ev.Msg("delivery outcome unknown: held for a person, never sent again; see outbox-relay dlq list")
	}
}

// logDecided logs what w's decision d makes of the failure o of its pair
// here: diverted to the claim path, dead-lettered or held. A pair that did
// not fail logs nothing; once the event is settled for good the lane
// forgets it (delivered forgets a delivered pair's note).
func (l *lane) logDecided(w *Work, o Outcome, d Decision) {
	var next string
	switch d.Kind {
	case Later:
		next = nextClaimPath
	case DeadLetter:
		next = nextDeadLetter
	case Hold:
		next = nextHeld
	}
	failed := o.Kind == Retry || o.Kind == Failed || o.Kind == Held
	switch {
	case failed && next == nextClaimPath:
		l.logFailure(w, next, d.At, o.Reason)
	case failed && next != "":
		l.logFailure(w, next, time.Time{}, o.Reason)
	case next == nextDeadLetter || next == nextHeld:
		l.mu.Lock()
		delete(l.failures, w.Event.ID)
		l.mu.Unlock()
	}
}

// delivered closes the circuit, and logs its closing and the delivery of
// an event whose failure was logged.
func (l *lane) delivered(t *task) {
	w := t.w
	l.mu.Lock()
	closed, downFor, waited := l.circuit.close(l.e.now())
	n, failed := l.failures[w.Event.ID]
	delete(l.failures, w.Event.ID)
	l.mu.Unlock()
	if closed {
		count := strconv.Itoa(waited)
		if waited >= circuitWaitedMax {
			count = "at least " + count
		}
		l.e.log.Info().Str("sink", l.name).Dur("down_for", downFor).Int("events_waited", waited).
			Msgf("sink is back: circuit closed after %s: %s events waited", roundDuration(downFor), count)
	}
	if failed && n.logged != "" {
		l.e.log.Info().Str("sink", l.name).Str("path", string(w.path)).Int64("id", w.Event.ID).Str("event_key", w.Event.EventKey).
			Int("attempt", w.Event.Attempts+t.tries).Str("after", n.status).Msg("delivered after failing")
	}
}

// sinkDown records that t's event found the sink down, and logs the
// circuit's opening or a summary of its failed probes when one is due. It
// returns when the circuit closes.
func (l *lane) sinkDown(t *task, retryAfter time.Duration, reason string) time.Time {
	now := l.e.now()
	l.mu.Lock()
	until, line := l.circuit.fail(now, retryAfter, t.w.Event.ID)
	since, probes := l.circuit.since, l.circuit.probes
	l.mu.Unlock()
	switch line {
	case circuitOpened:
		l.e.log.Warn().Str("sink", l.name).Str("path", string(t.w.path)).Str("error", reason).Dur("retry_in", until.Sub(now).Round(time.Millisecond)).
			Msg("sink is down: circuit open, its events wait without counting attempts")
	case circuitStillOpen:
		l.e.log.Warn().Str("sink", l.name).Int("probes_failed", probes).Time("open_since", since.UTC()).
			Msgf("sink is down: circuit still open: %d probes failed since %s, last: %s",
				probes, since.UTC().Format(time.RFC3339), reason)
	}
	return until
}

// roundDuration renders d to the second, or to the millisecond below one.
func roundDuration(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(time.Second)
}
