package relay

import (
	"time"
)

// Hooks for the relay_test package: unexported pieces the tests drive
// directly.

// Decide is Policy.decide on p with its defaults filled in, as NewEngine
// fills them.
func (p Policy) Decide(now time.Time, attempts int, outcomes []Outcome, sinks []string) Decision {
	p.setDefaults()
	return p.decide(now, attempts, outcomes, sinks)
}

// Undiverted is Engine.undiverted: what the claim path's settlement calls
// once an aggregate has nothing left at the claim path.
func (e *Engine) Undiverted(a AggregateKey, seq uint64) { e.undiverted(a, seq) }

// SetClock sets the clock of e's circuits; call it before Run.
func (e *Engine) SetClock(now func() time.Time) { e.now = now }

// DataErrorsBeforeFallback is how many refusals of a row's data the
// settlement takes before it writes a plain dead letter instead.
const DataErrorsBeforeFallback = dataErrorsBeforeFallback
