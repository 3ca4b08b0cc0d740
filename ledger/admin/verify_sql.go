package admin

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// reportSQL renders, for each kind of gap a check can list in SQL, the query
// that lists every gap of that kind (a report shows only the first few).
// Verify decides in Go; these queries say the same for a person. No glob is
// rendered into SQL: routing is decided once, in Go (relay.Route.Takes), and
// a query names the event types of the window that the sink took (or did
// not), as Verify routed them; the status is read by doneSQL and
// onItsWaySQL.
type reportSQL struct {
	t      Tables
	window string // the condition on o that keeps the window's rows
	all    []VerifySink
	// types is, per sink of all (by index), the window's event types and
	// whether the sink takes each (verifier.types), filled as Verify walks.
	types      []map[pgtype.Text]bool
	stuckAfter time.Duration
	// orphansSince is the orphan walk's cut-off, once it is known.
	orphansSince time.Time
}

// maxReportTypes bounds the event types a report's query names per sink:
// past it, the query is left out.
const maxReportTypes = 1000

func newReportSQL(t Tables, r *VerifyReport, all []VerifySink, types []map[pgtype.Text]bool) reportSQL {
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
	return reportSQL{t: t, window: window, all: all, types: types, stuckAfter: r.StuckAfter}
}

func timestampLiteral(at time.Time) string {
	return relay.QuoteLiteral(at.UTC().Format("2006-01-02 15:04:05.999999Z07:00")) + "::timestamptz"
}

// takenBy returns the SQL condition "the row aliased o has one of the
// window's event types that sink takes" (taken true) or does not take
// (false), from Verify's own routing; ok is false when sink is not
// configured, has a filter or its types are too many to name.
func (q reportSQL) takenBy(sink, o string, taken bool) (cond string, ok bool) {
	i := slices.IndexFunc(q.all, func(s VerifySink) bool { return s.Name == sink })
	if i < 0 || i >= len(q.types) || len(q.types[i]) > maxReportTypes || q.all[i].Route.Filter != nil {
		return "", false // a filter reads the payload, which no SQL renders
	}
	var names []string
	null := false
	for typ, takes := range q.types[i] {
		switch {
		case takes != taken:
		case !typ.Valid:
			null = true
		default:
			names = append(names, relay.QuoteLiteral(typ.String))
		}
	}
	slices.Sort(names)
	var parts []string
	if len(names) > 0 {
		parts = append(parts, fmt.Sprintf("%s.event_type IN (%s)", o, strings.Join(names, ", ")))
	}
	if null {
		parts = append(parts, o+".event_type IS NULL")
	}
	if len(parts) == 0 {
		return "false", true
	}
	return "(" + strings.Join(parts, " OR ") + ")", true
}

// forKind returns the query listing every gap of kind at sink, or "" when
// no query can (the deep checks read the sink, not the database).
func (q reportSQL) forKind(kind GapKind, sink string) string {
	outbox, led := q.t.Outbox.Quoted(), q.t.Ledger.Quoted()
	switch kind {
	case GapMissing:
		taken, ok := q.takenBy(sink, "o", true)
		if !ok {
			return ""
		}
		return fmt.Sprintf(`SELECT o.id, o.event_key, o.event_type, o.processed_at
  FROM %s AS o
 WHERE %s
   AND %s
   AND %s
   AND NOT EXISTS (SELECT FROM %s AS l WHERE l.event_key = o.event_key AND l.action = %s AND l.state = 'delivered')
 ORDER BY o.id;`, outbox, q.window, doneSQL("o"), taken, led, relay.QuoteLiteral(sink))
	case GapStuck:
		return fmt.Sprintf(`SELECT o.id, o.event_key, o.status, o.created_at, o.available_at, o.handoff_at
  FROM %s AS o
 WHERE %s
   AND %s
   AND GREATEST(o.created_at, coalesce(o.available_at, o.created_at)) < now() - interval '%g seconds'
 ORDER BY o.id;`, outbox, q.window, onItsWaySQL("o"), q.stuckAfter.Seconds())
	case GapUnrouted:
		notRouted := ""
		if slices.ContainsFunc(q.all, func(s VerifySink) bool { return s.Name == sink }) {
			cond, ok := q.takenBy(sink, "o", false)
			if !ok {
				return ""
			}
			notRouted = "\n   AND " + cond
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
