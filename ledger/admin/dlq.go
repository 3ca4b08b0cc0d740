package admin

import (
	"context"
	"fmt"
	"path"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// DeadStatuses are the statuses the dlq commands work on unless told
// otherwise: dead letters and rows held for a person.
var DeadStatuses = []string{"failed", "held"}

// Discarded is the status dlq discard writes: settled without delivery
// (docs/schema.md, "A row's states").
const Discarded = "discarded"

// legacyDiscardPrefix starts the last_error of a row an earlier version
// discarded: it wrote status done. Verify and event read such a row as
// discarded, not as a done row lacking its deliveries; the relay itself
// writes and reads only the status.
const legacyDiscardPrefix = "discarded: "

// DLQStatuses are the statuses dlq list and retry may be asked for: the
// dead letters, the held rows and the discarded ones.
var DLQStatuses = []string{"failed", "held", Discarded}

// Selection chooses outbox rows for the dlq and replay commands. The zero
// value of each filter means "any".
type Selection struct {
	// Statuses the rows must have (required).
	Statuses []string
	// IDs restricts the selection to these ids.
	IDs []int64
	// Since keeps rows created at or after it.
	Since time.Time
	// EventType is a glob over event_type, matched as a sink's events
	// are (relay.Route.Takes): a NULL event_type matches only "*".
	EventType string
	// Routes keeps rows whose event_type a sink with these events takes
	// (relay.Route.Takes); empty: every row.
	Routes []string
	// Filter, with Routes, is that sink's filter (sinks[].filter): the
	// rows are read with their payloads, BatchSize at a time.
	Filter relay.Filter
	// NotDeliveredTo keeps rows the ledger does not show delivered to this
	// sink: the dead letters that concern it.
	NotDeliveredTo string
	// Limit stops after this many rows, in id order.
	Limit int
	// After keeps rows with a greater id: the page after the one that
	// ended there.
	After int64
}

// matches applies the glob and the sink's filter by the routing rule
// (relay.Route.Takes), which no SQL renders.
func (s Selection) matches(ev *relay.Event) bool {
	if s.EventType != "" && !relay.Matches([]string{s.EventType}, ev.EventType) {
		return false
	}
	return Sink{Events: s.Routes, Filter: s.Filter}.Takes(ev)
}

// SelectIDs returns the ids of the rows sel chooses, in id order. It pages
// through the outbox by id, BatchSize rows per query, so its memory is the
// result's ids. It returns an error for an invalid glob.
func SelectIDs(ctx context.Context, db DB, t Tables, sel Selection) ([]int64, error) {
	for _, g := range append([]string{sel.EventType}, sel.Routes...) {
		if _, err := path.Match(g, ""); err != nil {
			return nil, fmt.Errorf("event type pattern %q: %w", g, err)
		}
	}
	if len(sel.Statuses) == 0 {
		return nil, fmt.Errorf("select rows: no statuses given")
	}
	// Only pending is read otherwise than the status column says (a NULL
	// status is pending); a selection without it reads the column, through
	// the status index: a page of dead letters reads the dead letters, not
	// the table.
	q := t.sql("DlqSelectIDs")
	if slices.Contains(sel.Statuses, "pending") {
		q = t.sql("DlqSelectIDsWithPending")
	}

	var ids, since, sink any
	if sel.IDs != nil {
		ids = sel.IDs
	}
	if !sel.Since.IsZero() {
		since = sel.Since
	}
	if sel.NotDeliveredTo != "" {
		sink = sel.NotDeliveredTo
	}
	var out []int64
	after := max(sel.After, -1<<63)
	for {
		rows, err := db.Query(ctx, q, after, sel.Statuses, ids, since, sink, BatchSize, sel.Filter != nil)
		if err != nil {
			return nil, fmt.Errorf("select rows: %w", err)
		}
		var (
			ev relay.Event
			n  int
		)
		_, err = pgx.ForEachRow(rows, []any{&ev.ID, &ev.EventKey, &ev.EventType, &ev.AggregateType, &ev.AggregateID, &ev.Payload}, func() error {
			n++
			after = ev.ID
			row := relay.Event{ID: ev.ID, EventKey: ev.EventKey, EventType: ev.EventType, AggregateType: ev.AggregateType, AggregateID: ev.AggregateID, Payload: ev.Payload}
			if sel.matches(&row) && (sel.Limit <= 0 || len(out) < sel.Limit) {
				out = append(out, ev.ID)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("select rows: %w", err)
		}
		if n < BatchSize || (sel.Limit > 0 && len(out) >= sel.Limit) {
			return out, nil
		}
	}
}

// Entry is one outbox row with its ledger rows, as dlq list shows it.
type Entry struct {
	ID            int64       `json:"id"`
	EventKey      string      `json:"event_key"`
	EventType     *string     `json:"event_type"`
	AggregateType *string     `json:"aggregate_type"`
	AggregateID   *string     `json:"aggregate_id"`
	Status        string      `json:"status"`
	Attempts      int32       `json:"attempts"`
	Replays       int32       `json:"replays"`
	LastError     *string     `json:"last_error"`
	CreatedAt     *time.Time  `json:"created_at"`
	AvailableAt   *time.Time  `json:"available_at"`
	ProcessedAt   *time.Time  `json:"processed_at"`
	Ledger        []LedgerRow `json:"ledger"`

	// payload is the payload's text, read when a sink of Tables has a
	// filter (Event).
	payload []byte
}

// Event returns what the routing rule reads of e (Sink.Takes).
func (e Entry) Event() *relay.Event {
	return &relay.Event{ID: e.ID, EventKey: e.EventKey, EventType: e.EventType, AggregateType: e.AggregateType, AggregateID: e.AggregateID, Payload: e.payload}
}

// LedgerRow is one sink's ledger row for an event.
type LedgerRow struct {
	Action      string     `json:"sink"`
	State       string     `json:"state"`
	Attempts    int32      `json:"attempts"`
	DeliveredAt *time.Time `json:"delivered_at,omitempty"`
	Detail      *string    `json:"detail,omitempty"`
}

// List returns the rows with these ids, in id order, each with its ledger
// rows (ordered by sink). Ids that no longer exist are left out.
func List(ctx context.Context, db DB, t Tables, ids []int64) ([]Entry, error) {
	var out []Entry
	for _, batch := range Batches(ids, BatchSize) {
		rows, err := db.Query(ctx, t.sql("DlqListRows"), batch, t.filtered())
		if err != nil {
			return nil, fmt.Errorf("list rows: %w", err)
		}
		entries, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Entry, error) {
			var e Entry
			err := r.Scan(&e.ID, &e.EventKey, &e.EventType, &e.AggregateType, &e.AggregateID, &e.Status,
				&e.Attempts, &e.Replays, &e.LastError, &e.CreatedAt, &e.AvailableAt, &e.ProcessedAt, &e.payload)
			e.Ledger = []LedgerRow{}
			return e, err
		})
		if err != nil {
			return nil, fmt.Errorf("list rows: %w", err)
		}
		byKey := make(map[string]*Entry, len(entries))
		keys := make([]string, len(entries))
		for i := range entries {
			byKey[entries[i].EventKey] = &entries[i]
			keys[i] = entries[i].EventKey
		}
		rows, err = db.Query(ctx, t.sql("DlqListLedgerRows"), keys)
		if err != nil {
			return nil, fmt.Errorf("list ledger rows: %w", err)
		}
		var (
			key string
			lr  LedgerRow
		)
		_, err = pgx.ForEachRow(rows, []any{&key, &lr.Action, &lr.State, &lr.Attempts, &lr.DeliveredAt, &lr.Detail}, func() error {
			if e := byKey[key]; e != nil {
				e.Ledger = append(e.Ledger, lr)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("list ledger rows: %w", err)
		}
		out = append(out, entries...)
	}
	return out, nil
}

// Changed counts what one retry, discard or replay batch changed.
type Changed struct {
	// Rows is the number of outbox rows changed; rows whose status moved on
	// since they were selected are skipped.
	Rows int64
	// LedgerRows is the number of ledger rows deleted.
	LedgerRows int64
}

// Retry makes the dead letters, held and discarded rows among ids
// deliverable again,
// in one statement (one transaction): status pending, attempts 0,
// available_at and handoff_at now (the claim path takes diverted rows in
// replication mode as in poll mode), last_error, processed_at and the claim
// cleared. The ledger rows of the chosen sinks (nil: every sink) that are
// not 'delivered' — 'sending' claims and 'unknown' outcomes — are deleted,
// so the claim path claims afresh; delivered pairs stay, so a sink that has
// the event does not get it again. Only rows still failed, held or
// discarded change: Retry is safe to repeat. Pass at most a few thousand
// ids (BatchSize).
func Retry(ctx context.Context, db DB, t Tables, ids []int64, sinks []string) (Changed, error) {
	var c Changed
	err := db.QueryRow(ctx, t.sql("DlqRetry"), ids, nilIfEmpty(sinks)).Scan(&c.Rows, &c.LedgerRows)
	if err != nil {
		return Changed{}, fmt.Errorf("retry %d rows: %w", len(ids), err)
	}
	return c, nil
}

// Discard settles the dead letters and held rows among ids without
// delivering them: status discarded, processed_at now, last_error kept. A
// discarded row is settled — it blocks no later event of its aggregate,
// retention prunes it like a done row, replay and retry take it — and is
// told from a delivered one by its status alone (docs/schema.md, "A row's
// states"). The ledger is left as it is (the record of what happened).
// Only rows still failed or held change: Discard is safe to repeat.
func Discard(ctx context.Context, db DB, t Tables, ids []int64) (Changed, error) {
	tag, err := db.Exec(ctx, t.sql("DlqDiscard"), ids)
	if err != nil {
		return Changed{}, fmt.Errorf("discard %d rows: %w", len(ids), err)
	}
	return Changed{Rows: tag.RowsAffected()}, nil
}

// nilIfEmpty sends an empty list as SQL NULL ("every sink").
func nilIfEmpty(s []string) any {
	if len(s) == 0 {
		return nil
	}
	return s
}

// Page is one page of rows a Selection chooses, each with its ledger rows.
type Page struct {
	Entries []Entry `json:"events"`
	// More is set when more rows match after the last entry: the next page
	// is the same Selection with After set to that entry's id.
	More bool `json:"more"`
}

// ListPage returns the first sel.Limit rows sel chooses after sel.After,
// in id order, with their ledger rows (List), and whether more match. It is
// what dlq list shows and what the admin API pages through.
func ListPage(ctx context.Context, db DB, t Tables, sel Selection) (Page, error) {
	limit := sel.Limit
	if limit > 0 {
		sel.Limit++ // one more tells whether there are more
	}
	ids, err := SelectIDs(ctx, db, t, sel)
	if err != nil {
		return Page{}, err
	}
	page := Page{More: limit > 0 && len(ids) > limit}
	if page.More {
		ids = ids[:limit]
	}
	if page.Entries, err = List(ctx, db, t, ids); err != nil {
		return Page{}, err
	}
	if page.Entries == nil {
		page.Entries = []Entry{}
	}
	return page, nil
}
