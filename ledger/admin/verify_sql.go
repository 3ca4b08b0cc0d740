package admin

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// reportSQL renders, for each kind of gap a check can list in SQL, the query
// that lists every gap of that kind (a report shows only the first few).
// Verify decides in Go; these queries say the same for a person, with the
// routing rendered by the ledger's rule (ledger.DeliveredEverywhere,
// ledger.RoutedTo) and the status read by doneSQL and onItsWaySQL.
type reportSQL struct {
	t          Tables
	window     string // the condition on o that keeps the window's rows
	all        []VerifySink
	checked    []VerifySink
	stuckAfter time.Duration
	// orphansSince is the orphan walk's cut-off, once it is known.
	orphansSince time.Time
}

func newReportSQL(t Tables, r *VerifyReport, all, checked []VerifySink) reportSQL {
	ids := make([]string, len(r.IDs))
	for i, rg := range r.IDs {
		ids[i] = fmt.Sprintf("o.id BETWEEN %d AND %d", rg.From, rg.To)
	}
	window := "false"
	if len(ids) > 0 {
		window = "(" + strings.Join(ids, " OR ") + ")"
	}
	if r.Since != nil {
		window += " AND o.created_at >= " + timestampLiteral(*r.Since)
	}
	return reportSQL{t: t, window: window, all: all, checked: checked, stuckAfter: r.StuckAfter}
}

func timestampLiteral(at time.Time) string {
	return relay.QuoteLiteral(at.UTC().Format("2006-01-02 15:04:05.999999Z07:00")) + "::timestamptz"
}

func ledgerSinks(sinks []VerifySink) []ledger.Sink {
	out := make([]ledger.Sink, len(sinks))
	for i, s := range sinks {
		out[i] = ledger.Sink{Name: s.Name, Events: s.Route.Events}
	}
	return out
}

// forKind returns the query listing every gap of kind at sink, or "" when
// no query can (the deep checks read the sink, not the database).
func (q reportSQL) forKind(kind GapKind, sink string) string {
	outbox, led := q.t.Outbox.Quoted(), q.t.Ledger.Quoted()
	switch kind {
	case GapMissing:
		i := slices.IndexFunc(q.all, func(s VerifySink) bool { return s.Name == sink })
		if i < 0 {
			return ""
		}
		delivered, err := ledger.DeliveredEverywhere(led, ledgerSinks(q.all[i:i+1]), "o")
		if err != nil {
			return ""
		}
		return fmt.Sprintf(`SELECT o.id, o.event_key, o.event_type, o.processed_at
  FROM %s AS o
 WHERE %s
   AND %s
   AND NOT (%s)
 ORDER BY o.id;`, outbox, q.window, doneSQL("o"), delivered)
	case GapStuck:
		delivered, err := ledger.DeliveredEverywhere(led, ledgerSinks(q.checked), "o")
		if err != nil {
			return ""
		}
		return fmt.Sprintf(`SELECT o.id, o.event_key, o.status, o.created_at, o.available_at, o.handoff_at
  FROM %s AS o
 WHERE %s
   AND %s
   AND GREATEST(o.created_at, coalesce(o.available_at, o.created_at)) < now() - interval '%g seconds'
   AND NOT (%s)
 ORDER BY o.id;`, outbox, q.window, onItsWaySQL("o"), q.stuckAfter.Seconds(), delivered)
	case GapUnrouted:
		notRouted := ""
		if i := slices.IndexFunc(q.all, func(s VerifySink) bool { return s.Name == sink }); i >= 0 {
			routed, err := ledger.RoutedTo(ledgerSinks(q.all[i : i+1])[0], "o")
			if err != nil {
				return ""
			}
			// A NULL event_type matches no glob but "*".
			notRouted = fmt.Sprintf("\n   AND NOT coalesce(%s, false)", routed)
		}
		return fmt.Sprintf(`SELECT o.id, o.event_key, o.event_type, l.state
  FROM %s AS o
  JOIN %s AS l ON l.event_key = o.event_key
 WHERE %s
   AND l.action = %s%s
 ORDER BY o.id;`, outbox, led, q.window, relay.QuoteLiteral(sink), notRouted)
	case GapOrphaned:
		return fmt.Sprintf(`SELECT l.event_key, l.action, l.state, l.delivered_at, l.claimed_at
  FROM %s AS l
 WHERE coalesce(l.delivered_at, l.claimed_at) >= %s
   AND l.action = %s
   AND NOT EXISTS (SELECT FROM %s AS o WHERE o.event_key = l.event_key)
 ORDER BY l.event_key;`, led, timestampLiteral(q.orphansSince), relay.QuoteLiteral(sink), outbox)
	}
	return ""
}
