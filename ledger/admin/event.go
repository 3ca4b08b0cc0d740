package admin

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// ErrEventNotFound is returned by LookupEvent for an event the outbox does
// not hold.
var ErrEventNotFound = errors.New("no such event")

// EventRef names one event: by its key, or, when Key is empty, by its id.
type EventRef struct {
	Key string
	ID  int64
}

// EventState is what the relay makes of an event (docs/operations.md,
// "What happened to one event").
type EventState string

// The states of an event: its status column (docs/schema.md, "A row's
// states") and, for a pending one, its diversion.
const (
	// EventWithStream: pending, and the stream's (not diverted) — on its
	// way, or waiting for the slot to send it.
	EventWithStream EventState = "stream"
	// EventAtClaimPath: pending and diverted; the claim path takes it once
	// available_at has passed.
	EventAtClaimPath EventState = "claim_path"
	// EventProcessing: claimed by the claim path (locked_by), being sent.
	EventProcessing EventState = "processing"
	// EventHeld: an unknown outcome at a sink that holds such events; it
	// waits for a person (outbox-relay dlq).
	EventHeld EventState = "held"
	// EventFailed: dead-lettered; last_error says why.
	EventFailed EventState = "failed"
	// EventDone: delivered to every sink it is routed to.
	EventDone EventState = "done"
	// EventDiscarded: settled by dlq discard without delivery.
	EventDiscarded EventState = "discarded"
	// EventOther: a status the relay does not write (a legacy poller's).
	EventOther EventState = "other"
)

// EventReport is what the database holds about one event: its outbox row,
// what the relay makes of it, the earlier event of its aggregate it waits
// behind, and each sink's ledger row. It is the answer of `outbox-relay
// event` and of the admin API alike, so its JSON names are its contract.
type EventReport struct {
	ID            int64      `json:"id"`
	EventKey      string     `json:"event_key"`
	EventType     *string    `json:"event_type"`
	AggregateType *string    `json:"aggregate_type"`
	AggregateID   *string    `json:"aggregate_id"`
	State         EventState `json:"state"`
	// Status is the status column as stored ("" when NULL).
	Status   string `json:"status"`
	Attempts int32  `json:"attempts"`
	// Replays counts operator replays; the sinks' idempotency ids of a
	// replayed event end in "~r<replays>".
	Replays     int32      `json:"replays"`
	LastError   *string    `json:"last_error"`
	CreatedAt   *time.Time `json:"created_at"`
	AvailableAt *time.Time `json:"available_at"`
	DivertedAt  *time.Time `json:"handoff_at"`
	LockedAt    *time.Time `json:"locked_at"`
	LockedBy    *string    `json:"locked_by"`
	ProcessedAt *time.Time `json:"processed_at"`
	// PayloadBytes is the size of the payload as sent (jsonb's text); nil
	// when the payload is NULL.
	PayloadBytes *int64 `json:"payload_bytes"`
	// WaitsBehind is the oldest earlier event of the same aggregate that is
	// not settled (pending, processing or held): this event is sent only
	// after it. Nil when there is none or this event is settled.
	WaitsBehind *EventBrief `json:"waits_behind,omitempty"`
	// Sinks are the configured sinks, in their order, then any other sink
	// the ledger names.
	Sinks []EventSink `json:"sinks"`

	// payload is the payload's text, read when a sink has a filter.
	payload []byte
}

// EventBrief names another event.
type EventBrief struct {
	ID       int64  `json:"id"`
	EventKey string `json:"event_key"`
	Status   string `json:"status"`
}

// EventSink is one sink's side of an event.
type EventSink struct {
	Name string `json:"name"`
	// Configured is false for a sink only the ledger names (one removed
	// from the configuration).
	Configured bool `json:"configured"`
	// Routed: the sink takes the event (relay.Route.Takes).
	Routed bool `json:"routed"`
	// Delivered: the ledger shows the event delivered to the sink.
	Delivered bool `json:"delivered"`
	// Ledger is the sink's ledger row, nil when there is none.
	Ledger *EventLedgerRow `json:"ledger"`
}

// EventLedgerRow is one ledger row (docs/schema.md).
type EventLedgerRow struct {
	State         string     `json:"state"`
	Attempts      int32      `json:"attempts"`
	Owner         *string    `json:"owner"`
	ClaimedAt     *time.Time `json:"claimed_at"`
	DeliveredAt   *time.Time `json:"delivered_at"`
	NextAttemptAt *time.Time `json:"next_attempt_at"`
	Detail        *string    `json:"detail"`
}

// LookupEvent reads one event: its outbox row, the earlier event of its
// aggregate it waits behind and its ledger rows, and routes it through
// t.Sinks. An event the outbox does not hold — a key that could not be
// stored (not UTF-8, a NUL) included — is an error wrapping
// ErrEventNotFound, which quotes a bounded excerpt of the key and says
// when the ledger still has rows for it. It only reads.
func LookupEvent(ctx context.Context, db DB, t Tables, ref EventRef) (EventReport, error) {
	var r EventReport
	query, arg := t.sql("EventByID"), any(ref.ID)
	if ref.Key != "" {
		if !utf8.ValidString(ref.Key) || strings.ContainsRune(ref.Key, 0) {
			return r, notFound(ref, 0)
		}
		query, arg = t.sql("EventByKey"), ref.Key
	}
	var status *string
	err := db.QueryRow(ctx, query, arg, t.filtered()).Scan(
		&r.ID, &r.EventKey, &r.EventType, &r.AggregateType, &r.AggregateID, &status,
		&r.Attempts, &r.Replays, &r.LastError,
		&r.CreatedAt, &r.AvailableAt, &r.DivertedAt, &r.LockedAt, &r.LockedBy, &r.ProcessedAt,
		&r.PayloadBytes, &r.payload)
	if errors.Is(err, pgx.ErrNoRows) {
		var left int64
		if ref.Key != "" {
			if err := db.QueryRow(ctx, t.sql("EventLedgerRowsLeft"), ref.Key).Scan(&left); err != nil {
				return r, fmt.Errorf("look up event %s: %w", describeRef(ref), err)
			}
		}
		return r, notFound(ref, left)
	}
	if err != nil {
		return r, fmt.Errorf("look up event %s: %w", describeRef(ref), err)
	}
	r.Status = deref(status)

	r.Sinks, err = eventSinks(ctx, db, t, r)
	if err != nil {
		return r, err
	}
	r.State = eventState(r)
	switch r.State {
	case EventWithStream, EventAtClaimPath, EventProcessing, EventHeld:
		if r.WaitsBehind, err = waitsBehind(ctx, db, t, r); err != nil {
			return r, err
		}
	}
	return r, nil
}

// eventSinks returns the configured sinks, routed by Sink.Takes, with
// their ledger rows, then the ledger rows of sinks not configured.
func eventSinks(ctx context.Context, db DB, t Tables, r EventReport) ([]EventSink, error) {
	rows, err := db.Query(ctx, t.sql("EventLedgerRows"), r.EventKey)
	if err != nil {
		return nil, fmt.Errorf("read the ledger rows of event %d: %w", r.ID, err)
	}
	ledgerRows := map[string]*EventLedgerRow{}
	var names []string
	var (
		action string
		l      EventLedgerRow
	)
	_, err = pgx.ForEachRow(rows, []any{&action, &l.State, &l.Attempts, &l.Owner, &l.ClaimedAt, &l.DeliveredAt, &l.NextAttemptAt, &l.Detail}, func() error {
		row := l
		ledgerRows[action] = &row
		names = append(names, action)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the ledger rows of event %d: %w", r.ID, err)
	}
	out := make([]EventSink, 0, len(t.Sinks)+len(names))
	ev := &relay.Event{ID: r.ID, EventKey: r.EventKey, EventType: r.EventType, AggregateType: r.AggregateType, AggregateID: r.AggregateID, Payload: r.payload}
	for _, s := range t.Sinks {
		l := ledgerRows[s.Name]
		delete(ledgerRows, s.Name)
		out = append(out, EventSink{Name: s.Name, Configured: true, Routed: s.Takes(ev),
			Delivered: l != nil && l.State == "delivered", Ledger: l})
	}
	for _, name := range names {
		if l, ok := ledgerRows[name]; ok {
			out = append(out, EventSink{Name: name, Delivered: l.State == "delivered", Ledger: l})
		}
	}
	return out, nil
}

// eventState is what the relay makes of r: its status and, when pending,
// its diversion. A row an earlier version discarded is done with last_error
// prefixed legacyDiscardPrefix.
func eventState(r EventReport) EventState {
	switch r.Status {
	case "", "pending":
		if r.DivertedAt != nil {
			return EventAtClaimPath
		}
		return EventWithStream
	case "processing":
		return EventProcessing
	case "held":
		return EventHeld
	case "failed":
		return EventFailed
	case Discarded:
		return EventDiscarded
	case "done":
		if r.LastError != nil && strings.HasPrefix(*r.LastError, legacyDiscardPrefix) {
			return EventDiscarded
		}
		return EventDone
	}
	return EventOther
}

// waitsBehind returns the oldest earlier event of r's aggregate that is not
// settled: the head of the line r waits in (docs/guarantees.md, "per-aggregate
// order"). Nil for an unordered event (a NULL aggregate).
func waitsBehind(ctx context.Context, db DB, t Tables, r EventReport) (*EventBrief, error) {
	if r.AggregateType == nil || r.AggregateID == nil {
		return nil, nil
	}
	var b EventBrief
	err := db.QueryRow(ctx, t.sql("EventWaitsBehind"), *r.AggregateType, *r.AggregateID, r.ID).Scan(&b.ID, &b.EventKey, &b.Status)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("read the events event %d waits behind: %w", r.ID, err)
	}
	return &b, nil
}

func notFound(ref EventRef, ledgerRows int64) error {
	err := fmt.Errorf("no event with %s in the outbox: %w", describeRef(ref), ErrEventNotFound)
	if ledgerRows > 0 {
		err = fmt.Errorf("%w; the ledger still has %d row(s) for that key: retention pruned the row, or it was deleted", err, ledgerRows)
	}
	return err
}

// keyExcerptBytes bounds how much of a key an error quotes.
const keyExcerptBytes = 120

// describeRef names ref in one bounded, printable line: a key is quoted
// (control characters escaped) and cut with its length when long.
func describeRef(ref EventRef) string {
	if ref.Key == "" {
		return "id " + strconv.FormatInt(ref.ID, 10)
	}
	k := ref.Key
	if len(k) <= keyExcerptBytes {
		return "key " + strconv.Quote(k)
	}
	cut := keyExcerptBytes
	for cut > 0 && !utf8.RuneStart(k[cut]) {
		cut--
	}
	return fmt.Sprintf("key %s… (%d bytes)", strconv.Quote(k[:cut]), len(k))
}
