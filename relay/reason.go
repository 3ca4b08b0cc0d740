package relay

import (
	"slices"
	"strings"
)

// An event's last_error names the sinks its reasons are about: Policy.decide
// writes each sink's reason as "sink <name>: <reason>", joins several with
// "; ", and starts a dead letter whose attempts ran out with
// maxAttemptsReached. ReasonSinks reads the names back; it is the only
// reader of that shape (the dead-letter notifier groups by it,
// docs/operations.md "Dead-letter notifications").

// maxAttemptsReached starts the last_error of an event dead-lettered after
// max_attempts counted attempts.
const maxAttemptsReached = "max_attempts reached: "

// sinkReason is reason as last_error says it of sink.
func sinkReason(sink, reason string) string { return "sink " + sink + ": " + reason }

// ReasonSinks returns the sinks among names that reason, an event's
// last_error, names, each once, in the order reason names them. A reason the
// relay wrote without a sink (a key the ledger cannot hold, an outcome
// PostgreSQL refused to store) or another program's text names none. A
// sink's reason starts either last_error, after an optional
// "max_attempts reached: ", or a part after "; "; when names overlap
// ("a" and "a: b"), the longest that fits is the one named.
func ReasonSinks(reason string, names []string) []string {
	var out []string
	rest := strings.TrimPrefix(reason, maxAttemptsReached)
	for {
		if name, ok := namedAt(rest, names); ok && !slices.Contains(out, name) {
			out = append(out, name)
		}
		i := strings.Index(rest, "; ")
		if i < 0 {
			return out
		}
		rest = rest[i+2:]
	}
}

// namedAt returns the longest of names that s starts naming as
// "sink <name>: ".
func namedAt(s string, names []string) (string, bool) {
	s, ok := strings.CutPrefix(s, "sink ")
	if !ok {
		return "", false
	}
	best, found := "", false
	for _, n := range names {
		if len(n) >= len(best) && strings.HasPrefix(s, n) && strings.HasPrefix(s[len(n):], ": ") {
			best, found = n, true
		}
	}
	return best, found
}
