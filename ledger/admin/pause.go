package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Pause is a sink an operator paused (docs/sinks.md, "Pause and resume"):
// one row of the pauses table (migration 016).
type Pause struct {
	Sink     string    `json:"sink"`
	PausedAt time.Time `json:"paused_at"`
	Reason   string    `json:"reason,omitempty"`
	PausedBy string    `json:"paused_by,omitempty"`
}

// PauseSink pauses the configured sink name: from now on no relay on the
// outbox sends to it (each notices within relay.PausePoll), its events wait
// with the claim path without an attempt, and the pause holds across
// restarts until ResumeSink. by says who paused it. Pausing a paused sink
// changes nothing and reports already; the returned Pause is the one in
// force. A name the configuration does not have is an error wrapping
// ErrNoSuchSink.
func PauseSink(ctx context.Context, db DB, t Tables, name, reason, by string) (p Pause, already bool, err error) {
	if _, err := t.Sink(name); err != nil {
		return Pause{}, false, err
	}
	p.Sink = name
	err = db.QueryRow(ctx, outboxSQL(t.Outbox, "PauseSink"), name, reason, by).Scan(&p.PausedAt, &p.Reason, &p.PausedBy, &already)
	if err != nil {
		return Pause{}, false, fmt.Errorf("pause sink %s: %w", name, pauseTableError(t.Outbox, err))
	}
	return p, already, nil
}

// ResumeSink lifts the pause of the configured sink name: each relay sends
// to it again within relay.PausePoll, and the events it held are delivered
// by the claim path in per-aggregate order. It reports since when the sink
// had been paused; resuming a sink that is not paused changes nothing and
// reports was false. A name the configuration does not have is an error
// wrapping ErrNoSuchSink.
func ResumeSink(ctx context.Context, db DB, t Tables, name string) (since time.Time, was bool, err error) {
	if _, err := t.Sink(name); err != nil {
		return time.Time{}, false, err
	}
	err = db.QueryRow(ctx, outboxSQL(t.Outbox, "ResumeSink"), name).Scan(&since)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return time.Time{}, false, nil
	case err != nil:
		return time.Time{}, false, fmt.Errorf("resume sink %s: %w", name, pauseTableError(t.Outbox, err))
	}
	return since, true, nil
}

// Pauses lists the paused sinks by name. A row of a sink the configuration
// no longer has is listed too: it pauses nothing until a sink of that name
// comes back.
func Pauses(ctx context.Context, db DB, outbox relay.QualifiedName) ([]Pause, error) {
	rows, err := db.Query(ctx, outboxSQL(outbox, "ListPauses"))
	if err != nil {
		return nil, pauseTableError(outbox, err)
	}
	var out []Pause
	var p Pause
	_, err = pgx.ForEachRow(rows, []any{&p.Sink, &p.PausedAt, &p.Reason, &p.PausedBy}, func() error {
		out = append(out, p)
		return nil
	})
	if err != nil {
		return nil, pauseTableError(outbox, err)
	}
	return out, nil
}

// pauseTableError names the fix when the pauses table is missing.
func pauseTableError(outbox relay.QualifiedName, err error) error {
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "42P01" { // undefined_table
		return fmt.Errorf("table %s does not exist: run outbox-relay migrate: %w", migrations.SinkPausesTable(outbox), err)
	}
	return err
}

// PauseReader is the engine's relay.PauseStore: the paused sinks, read from
// the pauses table.
type PauseReader struct {
	db   DB
	list string
}

var _ relay.PauseStore = (*PauseReader)(nil)

// NewPauseReader returns the engine's reader of the paused sinks of outbox
// (schema-qualified, as Resolve returns it).
func NewPauseReader(db DB, outbox relay.QualifiedName) *PauseReader {
	return &PauseReader{db: db, list: outboxSQL(outbox, "PausedSinks")}
}

// PausedSinks returns the paused sinks' names (relay.PauseStore).
func (r *PauseReader) PausedSinks(ctx context.Context) ([]string, error) {
	rows, err := r.db.Query(ctx, r.list)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
