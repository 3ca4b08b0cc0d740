package ledger

import (
	"fmt"
	"strings"

	"github.com/outbox-relay/outbox-relay/relay"
)

// DeliveredEverywhere returns the SQL condition "the ledger shows the outbox
// row aliased o delivered to every sink it is routed to" for the ledger
// table ledgerTable (quoted) and the configured sinks: one delivered ledger
// row per (event_key, sink) is the record of delivery on both paths
// (docs/operations.md, "what the relay writes back"). Routing mirrors the
// engine's (relay.Matches): a sink without globs, or with "*", takes every
// type, NULL included; otherwise the event_type must match one of its
// globs. A row routed to no sink is delivered everywhere, as the engine
// settles it done without sending.
//
// It is how the relay's readers tell a row that is still pending only
// because its status was not marked yet (mark_done: off, or the marking
// trails) from one that waits for delivery: status, the metrics, the
// stuck-rows alarm, retention, replay, reconcile and the slot hand-over.
// With no sinks (an operator command run without the configuration) the
// routes are unknown and nothing counts as delivered: "false". The sink
// names and globs are rendered as literals, quoted. It returns an error for
// a glob the engine would refuse.
func DeliveredEverywhere(ledgerTable string, sinks []Sink, o string) (string, error) {
	if len(sinks) == 0 {
		return "false", nil
	}
	rows := make([]string, 0, len(sinks))
	for _, s := range sinks {
		f, err := newSinkFilter(s.Events)
		if err != nil {
			return "", fmt.Errorf("sink %s: %w", s.Name, err)
		}
		re := "NULL::text"
		if f.regex != nil {
			re = relay.QuoteLiteral(*f.regex)
		}
		rows = append(rows, fmt.Sprintf("(%s, %t, %s)", relay.QuoteLiteral(s.Name), f.everyType, re))
	}
	return fmt.Sprintf(`NOT EXISTS (
           SELECT FROM (VALUES %[1]s) AS s(sink, every_type, re)
            WHERE (s.every_type OR %[2]s.event_type ~ s.re)
              AND NOT EXISTS (SELECT FROM %[3]s AS l
                               WHERE l.event_key = %[2]s.event_key AND l.action = s.sink AND l.state = 'delivered'))`,
		strings.Join(rows, ", "), o, ledgerTable), nil
}

// RoutedTo returns the SQL condition "the outbox row aliased o is routed to
// sink s", by the rule DeliveredEverywhere renders. verify prints it in the
// queries that list what it found (docs/operations.md, "verify"); verify
// itself routes in Go (relay.Route.Takes). It returns an error for a glob
// the engine would refuse.
func RoutedTo(s Sink, o string) (string, error) {
	f, err := newSinkFilter(s.Events)
	switch {
	case err != nil:
		return "", fmt.Errorf("sink %s: %w", s.Name, err)
	case f.everyType:
		return "true", nil
	case f.regex == nil:
		return "false", nil
	}
	return fmt.Sprintf("%s.event_type ~ %s", o, relay.QuoteLiteral(*f.regex)), nil
}
