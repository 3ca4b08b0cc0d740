package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Action is one of the operator's changes of outbox rows — retry, discard,
// replay — as the dlq and replay commands and the admin API make it: the
// statuses of the rows it takes and the change of one batch.
type Action struct {
	// Name is the verb (retry), Done its past (retried).
	Name, Done string
	// Statuses are the statuses of the rows it takes (Selection.Statuses).
	Statuses []string
	// batch changes the rows among ids (at most BatchSize) in one
	// transaction; sinks nil means every sink.
	batch func(ctx context.Context, db DB, t Tables, ids []int64, sinks []string) (Changed, error)
}

// The actions. Each changes only rows whose status it takes, so a row that
// moved on since it was selected is left alone and not counted.
var (
	// ActionRetry makes failed and held rows deliverable again (Retry);
	// given Statuses with discarded, discarded ones too.
	ActionRetry = Action{Name: "retry", Done: "retried", Statuses: DeadStatuses, batch: Retry}
	// ActionDiscard settles failed and held rows without delivering them
	// (Discard); it keeps every sink's ledger rows.
	ActionDiscard = Action{Name: "discard", Done: "discarded", Statuses: DeadStatuses,
		batch: func(ctx context.Context, db DB, t Tables, ids []int64, _ []string) (Changed, error) {
			return Discard(ctx, db, t, ids)
		}}
	// ActionReplay delivers settled rows again (Replay).
	ActionReplay = Action{Name: "replay", Done: "replayed", Statuses: ReplayStatuses, batch: Replay}
)

// Apply changes the rows among ids in batches of BatchSize, each in its own
// transaction, and returns what all of them changed; sinks nil means every
// sink. progress, when not nil, is told after each batch how many ids it
// covered. It stops at the first batch that fails: the batches before it
// are committed, and the error says how many rows they changed. Running it
// again over the same ids carries on, since the rows changed no longer have
// a status the action takes (a replay excepted: it replays them again).
func (a Action) Apply(ctx context.Context, db DB, t Tables, ids []int64, sinks []string, progress func(n int)) (Changed, error) {
	var total Changed
	for _, batch := range Batches(ids, BatchSize) {
		changed, err := a.batch(ctx, db, t, batch, sinks)
		if err != nil {
			return total, fmt.Errorf("%s: %w (%d events were %s before this, each batch in its own transaction; run it again to carry on)",
				a.Name, err, total.Rows, a.Done)
		}
		total.Rows += changed.Rows
		total.LedgerRows += changed.LedgerRows
		if progress != nil {
			progress(len(batch))
		}
	}
	return total, nil
}

// ErrNoSuchSink is wrapped by the error of an operation given a sink name
// the configuration does not have.
var ErrNoSuchSink = errors.New("no such sink")

// Sink returns the configured sink called name, or an error wrapping
// ErrNoSuchSink that names the sinks there are.
func (t Tables) Sink(name string) (Sink, error) {
	var names []string
	for _, s := range t.Sinks {
		if s.Name == name {
			return s, nil
		}
		names = append(names, s.Name)
	}
	if len(names) == 0 {
		names = []string{"none"}
	}
	return Sink{}, fmt.Errorf("%w %q (configured: %s)", ErrNoSuchSink, name, strings.Join(names, ", "))
}

// ParseSince reads the start of a selection by time: an RFC 3339 time, a
// date (UTC midnight) or a duration before now (24h).
func ParseSince(s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02 15:04:05", "2006-01-02"} {
		if t, err := time.ParseInLocation(layout, s, time.UTC); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("%q: write an RFC 3339 time (2026-01-02T15:04:05Z), a date (2026-01-02) or a duration ago (90m, 24h)", s)
}
