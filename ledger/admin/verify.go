package admin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Verify proves, over a window of the outbox, that nothing was lost or
// repeated (docs/operations.md, "verify"): for every row of the window it
// asks which sinks the row is routed to (relay.Route.Takes, the engine's own
// rule) and what the record says of each — a delivered ledger row, or the
// row's status — and reports the gaps:
//
//   - missing: a done row that a routed sink has no delivered ledger row for;
//   - stuck: a row pending or processing (its status alone:
//     docs/schema.md, "A row's states"), due longer ago than StuckAfter;
//   - unrouted: a ledger row for a sink the row is not routed to, or that is
//     not configured;
//   - orphaned: a ledger row whose outbox row is gone, though retention could
//     not have removed it yet (only with an OrphanWalk);
//
// and, with a sink's deep check, what the sink itself holds
// (missing_at_sink, duplicate, unrecorded: StreamAudit, ReceiverQuery).
//
// It reads the outbox by id, Slice rows per statement, each row with its
// ledger rows in the same statement (one snapshot, so a replay between two
// reads cannot look like a gap); it never reads the outbox outside the
// window. It only reads, and is safe to run beside relays.

// VerifySink is one configured sink, as verify routes and checks it.
type VerifySink struct {
	Name string
	// Route carries the sink's routing (its event globs); its Sink is not
	// used.
	Route relay.Route
	// ReceiverQuery, when set, is the deep check of a webhook sink: SQL
	// run on the relay's database with $1 the text[] of event keys the
	// ledger shows delivered to the sink, returning in its first column
	// those the receiver applied.
	ReceiverQuery string
	// Stream, when set, is the deep check of a sink that stores copies (a
	// JetStream stream), filled by the caller.
	Stream *StreamAudit
}

// VerifyOptions says what Verify checks. Since or IDs is required.
type VerifyOptions struct {
	// Since keeps rows created at or after it (zero: any time). Without
	// IDs the window starts at the first id created at or after it.
	Since time.Time
	// IDs restricts the window to these ids.
	IDs []IDRange
	// Sinks are the configured sinks.
	Sinks []VerifySink
	// Sink, when set, checks only the sink of that name: the other sinks'
	// pairs and ledger rows are left alone.
	Sink string
	// StuckAfter is how long a row may stay pending after it is due
	// (source.sweep_after).
	StuckAfter time.Duration
	// RetentionDoneAfter is retention.done_after when retention is on, 0
	// when it is off: retention may have removed rows settled longer ago.
	RetentionDoneAfter time.Duration
	// Orphans walks the ledger for orphaned rows; nil skips them (a window
	// of ids only: a ledger row has no id).
	Orphans *OrphanWalk
	// Slice is the rows one statement reads [10000].
	Slice int
	// Pause, when set, says how long to wait after a statement that took
	// took: the continuous verify's bound on its cost.
	Pause func(took time.Duration) time.Duration
	// Listed is the gaps listed per kind and sink [10]; a negative value
	// lists all.
	Listed int
}

// rowFate is what an outbox row's status says became of its event.
type rowFate int

const (
	fateOnItsWay     rowFate = iota // pending (or NULL) or processing
	fateDone                        // settled: delivered everywhere
	fateDeadLettered                // failed
	fateHeld                        // held for a person
	fateDiscarded                   // settled by dlq discard, undelivered
	fateOther                       // a status the relay never writes
)

// classify reads an outbox row's status: the one place verify interprets
// it, beside doneSQL, which says the same in SQL. A discarded row has
// status 'discarded', or, discarded by an earlier version, is done with
// last_error prefixed legacyDiscardPrefix.
func classify(status, lastError pgtype.Text) rowFate {
	if !status.Valid {
		return fateOnItsWay
	}
	switch status.String {
	case "pending", "processing":
		return fateOnItsWay
	case "failed":
		return fateDeadLettered
	case "held":
		return fateHeld
	case "discarded":
		return fateDiscarded
	case "done":
		if lastError.Valid && strings.HasPrefix(lastError.String, legacyDiscardPrefix) {
			return fateDiscarded
		}
		return fateDone
	}
	return fateOther
}

// doneSQL is classify's fateDone in SQL, for the queries a report prints.
func doneSQL(o string) string {
	return fmt.Sprintf("%[1]s.status = 'done' AND coalesce(%[1]s.last_error, '') NOT LIKE %[2]s", o, relay.QuoteLiteral(legacyDiscardPrefix+"%"))
}

// onItsWaySQL is classify's fateOnItsWay in SQL.
func onItsWaySQL(o string) string {
	return fmt.Sprintf("coalesce(%s.status, 'pending') IN ('pending', 'processing')", o)
}

// verifyRow is one outbox row of the window with its ledger rows. Value
// types keep the decoding of a million rows cheap.
type verifyRow struct {
	id        int64
	key       string
	eventType pgtype.Text
	// aggType, aggID and payload are what a sink's filter reads; payload
	// is read only when a checked sink has one (verifier.filtered).
	aggType, aggID, payload pgtype.Text
	status, lastError       pgtype.Text
	created, due            pgtype.Timestamptz
	// delivered and pending have bit i set when the ledger has a row for
	// the i-th configured sink (VerifyOptions.Sinks), delivered or not;
	// unknown names the sinks of its rows that are not configured.
	delivered, pending int64
	unknown            []string
}

// maxVerifySinks bounds the sinks a row's ledger bitmasks can hold.
const maxVerifySinks = 62

// verifySQL holds Verify's statements, rendered once for the tables.
type verifySQL struct {
	slice, firstAfter, bounds string
	orphansFirst, orphansNext string
	unrecorded                string
}

func newVerifySQL(t Tables) verifySQL {
	return verifySQL{
		slice:        t.sql("VerifySlice"),
		firstAfter:   t.sql("VerifyFirstAfter"),
		bounds:       t.sql("VerifyBounds"),
		orphansFirst: t.sql("VerifyOrphansFirst"),
		orphansNext:  t.sql("VerifyOrphansNext"),
		unrecorded:   t.sql("VerifyUnrecorded"),
	}
}

// Verify checks the window o describes and returns what it found; an error
// only when it could not check (the database, a receiver query). See the
// comment at the top of this file.
func Verify(ctx context.Context, db DB, t Tables, o VerifyOptions) (*VerifyReport, error) {
	start := time.Now()
	switch {
	case o.Since.IsZero() && len(o.IDs) == 0:
		return nil, errors.New("verify: no window: give a time or ids")
	case len(o.Sinks) > maxVerifySinks:
		return nil, fmt.Errorf("verify: %d sinks; verify checks at most %d", len(o.Sinks), maxVerifySinks)
	}
	if o.Slice <= 0 {
		o.Slice = 10_000
	}
	if o.Listed == 0 {
		o.Listed = 10
	}
	v := &verifier{db: db, o: o, q: newVerifySQL(t)}
	for i, s := range o.Sinks {
		v.names = append(v.names, s.Name)
		if o.Sink == "" || s.Name == o.Sink {
			v.checked = append(v.checked, i)
			v.filtered = v.filtered || s.Route.Filter != nil
		}
	}
	if len(v.checked) == 0 {
		return nil, fmt.Errorf("verify: no sink named %q", o.Sink)
	}
	r := &VerifyReport{StuckAfter: o.StuckAfter, listed: o.Listed, Notes: []string{}, Gaps: []*GapGroup{}}
	v.r = r
	if !o.Since.IsZero() {
		since := o.Since.UTC()
		r.Since = &since
	}
	var checked []VerifySink
	for _, i := range v.checked {
		s := o.Sinks[i]
		checked = append(checked, s)
		tally := &SinkTally{Sink: s.Name}
		if s.ReceiverQuery != "" {
			tally.Receiver = new(int64)
		}
		if s.Stream != nil {
			tally.Stream = &s.Stream.Tally
		}
		r.Sinks = append(r.Sinks, tally)
	}

	var minID, maxID *int64
	if err := db.QueryRow(ctx, v.q.bounds).Scan(&minID, &maxID, &r.AsOf); err != nil {
		return nil, fmt.Errorf("verify: read the outbox's ids: %w", err)
	}
	ranges, err := windowRanges(ctx, db, v.q, o, minID, maxID)
	if err != nil {
		return nil, err
	}
	r.IDs = ranges
	r.IDsText = rangesText(ranges)
	v.types = make([]map[pgtype.Text]bool, len(o.Sinks))
	r.sql = newReportSQL(t, r, o.Sinks, v.types)

	for _, rg := range ranges {
		if err := v.walk(ctx, rg); err != nil {
			return nil, err
		}
	}
	if o.Orphans != nil {
		if err := o.Orphans.walk(ctx, v); err != nil {
			return nil, err
		}
	} else {
		r.Notes = append(r.Notes, "orphaned ledger rows are looked for only in a window of time (--since): a ledger row has no id")
	}
	for _, s := range checked {
		if s.Stream != nil {
			if err := s.Stream.finish(ctx, v, s.Name); err != nil {
				return nil, err
			}
		}
	}
	// The queries are rendered once every row has been routed: they name
	// the event types each sink took (reportSQL).
	for _, g := range r.Gaps {
		g.SQL = r.sql.forKind(g.Kind, g.Sink)
	}
	r.Took = time.Since(start)
	return r, nil
}

// windowRanges returns the window's id ranges: IDs (sorted, merged), or
// from the first id created at or after Since to the newest id.
func windowRanges(ctx context.Context, db DB, q verifySQL, o VerifyOptions, minID, maxID *int64) ([]IDRange, error) {
	if len(o.IDs) > 0 {
		return MergeRanges(o.IDs), nil
	}
	if minID == nil {
		return nil, nil
	}
	first, err := firstIDSince(ctx, db, q, o.Since, *minID, *maxID)
	if err != nil {
		return nil, err
	}
	if first > *maxID {
		return nil, nil
	}
	return []IDRange{{first, *maxID}}, nil
}

// firstIDSince finds by bisection on the primary key the lowest id from
// which rows are created at or after since: created_at defaults to the
// inserting transaction's start, so it grows with the id (give or take a
// transaction's length), and no index on created_at is needed. Each probe
// reads one row; there are at most 64.
func firstIDSince(ctx context.Context, db DB, q verifySQL, since time.Time, lo, maxID int64) (int64, error) {
	hi := maxID + 1 // the answer lies in [lo, hi]; hi: no row
	for probes := 0; lo < hi; probes++ {
		if probes > 64 {
			return 0, fmt.Errorf("verify: the bisection for --since did not converge between ids %d and %d", lo, hi)
		}
		mid := lo + (hi-lo)/2
		var id int64
		var created *time.Time
		err := db.QueryRow(ctx, q.firstAfter, mid).Scan(&id, &created)
		switch {
		case errors.Is(err, pgx.ErrNoRows) || err == nil && id >= hi:
			hi = mid // no row in [mid, hi)
		case err != nil:
			return 0, fmt.Errorf("verify: find the first id created since %s: %w", since.Format(time.RFC3339), err)
		case created != nil && !created.Before(since):
			hi = id
		default:
			lo = id + 1
		}
	}
	return lo, nil
}

// MergeRanges sorts ranges and merges those that overlap or touch.
func MergeRanges(ranges []IDRange) []IDRange {
	rs := slices.Clone(ranges)
	slices.SortFunc(rs, func(a, b IDRange) int { return cmp.Compare(a.From, b.From) })
	var out []IDRange
	for _, r := range rs {
		if n := len(out); n > 0 && (out[n-1].To == math.MaxInt64 || r.From <= out[n-1].To+1) {
			out[n-1].To = max(out[n-1].To, r.To)
			continue
		}
		out = append(out, r)
	}
	return out
}

func rangesText(rs []IDRange) string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = r.String()
	}
	return strings.Join(parts, ",")
}

// verifier is one Verify call's state.
type verifier struct {
	db DB
	o  VerifyOptions
	q  verifySQL
	r  *VerifyReport
	// filtered: a checked sink has a filter, so the walk reads payloads
	// (a slice's at a time).
	filtered bool
	// names are the configured sinks' names, bit i of a row's ledger
	// masks being names[i]; checked are the indexes of the sinks checked
	// (every one, or VerifyOptions.Sink), in the order of r.Sinks.
	names   []string
	checked []int
	// types records, per configured sink (by index), each event type of
	// the window's rows and whether the sink takes it: the routing the
	// report's queries name (reportSQL), decided here, never in SQL.
	types []map[pgtype.Text]bool
}

// pause waits after a statement that took took, when the caller bounds
// Verify's cost.
func (v *verifier) pause(ctx context.Context, took time.Duration) error {
	if v.o.Pause == nil {
		return nil
	}
	d := v.o.Pause(took)
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// walk checks the rows of one id range, a slice per statement.
func (v *verifier) walk(ctx context.Context, rg IDRange) error {
	slice := make([]verifyRow, 0, v.o.Slice)
	for from := rg.From; from <= rg.To; {
		began := time.Now()
		rows, err := v.db.Query(ctx, v.q.slice, from, rg.To, v.o.Slice, v.names, v.filtered)
		if err != nil {
			return fmt.Errorf("verify: read ids %d-%d: %w", from, rg.To, err)
		}
		slice = slice[:0]
		var x verifyRow
		_, err = pgx.ForEachRow(rows, []any{&x.id, &x.key, &x.eventType, &x.aggType, &x.aggID, &x.payload, &x.status, &x.lastError, &x.created, &x.due, &x.delivered, &x.pending, &x.unknown},
			func() error {
				slice = append(slice, x)
				return nil
			})
		if err != nil {
			return fmt.Errorf("verify: read ids %d-%d: %w", from, rg.To, err)
		}
		if err := v.check(ctx, slice); err != nil {
			return err
		}
		if len(slice) < v.o.Slice || slice[len(slice)-1].id >= rg.To {
			return nil
		}
		from = slice[len(slice)-1].id + 1
		if err := v.pause(ctx, time.Since(began)); err != nil {
			return err
		}
	}
	return nil
}

// check judges one slice of rows.
func (v *verifier) check(ctx context.Context, slice []verifyRow) error {
	r := v.r
	since := v.o.Since
	var receiverKeys map[int][]receiverKey
	for i := range slice {
		x := &slice[i]
		if !since.IsZero() && (!x.created.Valid || x.created.Time.Before(since)) {
			continue
		}
		r.Rows++
		if r.Rows == 1 {
			r.FirstID = x.id
		}
		r.LastID = x.id
		fate := classify(x.status, x.lastError)
		ev := relay.Event{ID: x.id, EventKey: x.key, CreatedAt: x.created.Time,
			EventType: textPtr(x.eventType), AggregateType: textPtr(x.aggType), AggregateID: textPtr(x.aggID)}
		if x.payload.Valid {
			ev.Payload = []byte(x.payload.String)
		}
		for ti, si := range v.checked {
			s := &v.o.Sinks[si]
			delivered := x.delivered&(1<<si) != 0
			if s.Stream != nil {
				s.Stream.row(r, s.Name, x, delivered, fate)
			}
			takes, _ := s.Route.Takes(&ev) // a filter's error: routed, dead-lettered
			v.routed(si, x.eventType, takes)
			if !takes {
				if (x.delivered|x.pending)&(1<<si) != 0 {
					detail := "ledger row for a sink that does not take event_type " + orText(x.eventType, "NULL")
					if s.Route.Filter != nil {
						detail += " or whose filter refuses it"
					}
					r.add(GapUnrouted, s.Name, Gap{ID: x.id, EventKey: x.key, Detail: detail})
				}
				continue
			}
			tally := r.Sinks[ti]
			tally.Routed++
			if delivered {
				tally.Delivered++
				if s.ReceiverQuery != "" {
					if receiverKeys == nil {
						receiverKeys = map[int][]receiverKey{}
					}
					receiverKeys[si] = append(receiverKeys[si], receiverKey{x.id, x.key})
				}
				continue
			}
			switch fate {
			case fateDone:
				tally.Missing++
				detail := "row done, no delivered ledger row"
				if x.pending&(1<<si) != 0 {
					detail += " (its ledger row is not delivered)"
				}
				r.add(GapMissing, s.Name, Gap{ID: x.id, EventKey: x.key, Detail: detail})
			case fateDeadLettered:
				tally.DeadLettered++
			case fateHeld:
				tally.Held++
			case fateDiscarded:
				tally.Discarded++
			case fateOnItsWay:
				tally.OnItsWay++
			default:
				tally.Other++
			}
		}
		for _, action := range x.unknown {
			if v.o.Sink == "" {
				r.add(GapUnrouted, action, Gap{ID: x.id, EventKey: x.key, Detail: "ledger row for a sink that is not configured"})
			}
		}
		if fate == fateOnItsWay && x.due.Valid && r.AsOf.Sub(x.due.Time) > v.o.StuckAfter {
			r.add(GapStuck, "", Gap{ID: x.id, EventKey: x.key,
				Detail: fmt.Sprintf("%s, due %s ago", orText(x.status, "pending"), r.AsOf.Sub(x.due.Time).Round(time.Second))})
		}
	}
	for _, si := range v.checked {
		if keys := receiverKeys[si]; len(keys) > 0 {
			if err := v.checkReceiver(ctx, v.o.Sinks[si], keys); err != nil {
				return err
			}
		}
	}
	return nil
}

// routed records that sink si takes (or not) events of type eventType.
// Without a filter, Route.Takes routes by the type alone: one decision per
// type serves the report's queries. At most maxReportTypes types are kept
// per sink; a sink with a filter keeps none (reportSQL.takenBy).
func (v *verifier) routed(si int, eventType pgtype.Text, takes bool) {
	if v.o.Sinks[si].Route.Filter != nil {
		return
	}
	m := v.types[si]
	if m == nil {
		m = map[pgtype.Text]bool{}
		v.types[si] = m
	}
	if _, ok := m[eventType]; ok || len(m) > maxReportTypes {
		return
	}
	m[eventType] = takes
}

// textPtr is s as a *string, nil for NULL.
func textPtr(s pgtype.Text) *string {
	if !s.Valid {
		return nil
	}
	return &s.String
}

func orText(s pgtype.Text, null string) string {
	if !s.Valid {
		return null
	}
	return s.String
}

// WindowStart returns the earliest created_at of the rows in ranges, zero
// when there is none: where a sink's copies of the window's events can
// begin, for a window of ids.
func WindowStart(ctx context.Context, db DB, t Tables, ranges []IDRange) (time.Time, error) {
	var start time.Time
	q := t.sql("VerifyWindowStart")
	for _, rg := range MergeRanges(ranges) {
		var at *time.Time
		if err := db.QueryRow(ctx, q, rg.From, rg.To).Scan(&at); err != nil {
			return time.Time{}, fmt.Errorf("verify: the window's first creation time: %w", err)
		}
		if at != nil && (start.IsZero() || at.Before(start)) {
			start = *at
		}
	}
	return start, nil
}
