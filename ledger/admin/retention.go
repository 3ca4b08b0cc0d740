package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"
)

// RetentionConfig says what Prune deletes.
type RetentionConfig struct {
	// DoneAfter: done outbox rows processed longer ago than this are
	// deleted. A done row without processed_at (written so by a legacy
	// poller) ages from its created_at.
	DoneAfter time.Duration
	// LedgerAfter: ledger rows delivered (or claimed) longer ago than this
	// are deleted once their outbox row is done or gone. A ledger row with
	// neither time is deleted once its outbox row is gone.
	LedgerAfter time.Duration
	// Batch is the number of rows per DELETE [1000].
	Batch int
}

// Prune deletes old done outbox rows with their ledger rows, and old
// ledger rows whose outbox row is done or gone, Batch rows per statement
// (each its own short transaction), until none is left, and returns how
// many of each it deleted.
//
// It never deletes a pending, processing, held or failed row, nor any ledger
// row of an event whose outbox row is in one of those statuses: the ledger
// is what keeps such a row from being delivered twice. Rows locked by
// someone else (a replay in progress) are skipped until the next call. Each
// batch re-checks the status it deletes by, so a row replayed meanwhile is
// kept. Prune is safe to run concurrently with the relay and with itself.
//
// Finding old rows scans the outbox's done rows and the ledger: neither has
// an index on the time columns, and retention keeps both small. When ctx
// ends, Prune returns what it deleted so far with ctx's error.
func Prune(ctx context.Context, db DB, t Tables, cfg RetentionConfig) (doneRows, ledgerRows int64, err error) {
	if cfg.DoneAfter <= 0 || cfg.LedgerAfter <= 0 {
		return 0, 0, errors.New("prune: the retention ages must be greater than zero")
	}
	if cfg.Batch <= 0 {
		cfg.Batch = 1000
	}
	// Ages go to the server in microseconds: the cut-off is computed from
	// the server's clock, like processed_at and delivered_at.
	// An event's ledger rows go with its row (docs/guarantees.md, "a key
	// published again"): a key published again after its row was pruned is
	// a new event on either path, never skipped as delivered.
	pruneDone := fmt.Sprintf(`
WITH gone AS (
DELETE FROM %[1]s AS o
 WHERE o.id IN (
       SELECT id FROM %[1]s
        WHERE status = 'done' AND coalesce(processed_at, created_at) < now() - $1 * interval '1 microsecond'
        LIMIT $2
          FOR UPDATE SKIP LOCKED)
   AND o.status = 'done'
RETURNING o.event_key),
ledger AS (
DELETE FROM %[2]s AS l USING gone WHERE l.event_key = gone.event_key RETURNING 1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM ledger)`, t.Outbox.Quoted(), t.Ledger.Quoted())

	// Rows the stream delivered are done by the delivered record and keep
	// status pending (docs/operations.md, "what the relay writes back"):
	// they age from created_at and go with their record entries and ledger
	// rows. The record is read in id order, oldest first.
	pruneRecorded := fmt.Sprintf(`
WITH gone AS (
DELETE FROM %[1]s AS o
 WHERE o.id IN (
       SELECT x.id FROM %[3]s AS d JOIN %[1]s AS x ON x.id = d.id
        WHERE x.status = 'pending' AND x.handoff_at IS NULL
          AND x.created_at < now() - $1 * interval '1 microsecond'
        ORDER BY d.id
        LIMIT $2
          FOR UPDATE OF x SKIP LOCKED)
   AND o.status = 'pending' AND o.handoff_at IS NULL
RETURNING o.id, o.event_key),
record AS (
DELETE FROM %[3]s AS d USING gone WHERE d.id = gone.id),
ledger AS (
DELETE FROM %[2]s AS l USING gone WHERE l.event_key = gone.event_key RETURNING 1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM ledger)`, t.Outbox.Quoted(), t.Ledger.Quoted(), t.Delivered().Quoted())

	// Record entries below the outbox's oldest row: their rows are gone
	// (deleted by hand, or pruned by an older relay). An index range, not a
	// scan; replay removes the entries of the rows it takes.
	pruneRecord := fmt.Sprintf(`
DELETE FROM %[1]s AS d
 WHERE d.id IN (
       SELECT r.id FROM %[1]s AS r
        WHERE r.id < coalesce((SELECT min(o.id) FROM %[2]s AS o), 9223372036854775807)
        ORDER BY r.id
        LIMIT $1)`, t.Delivered().Quoted(), t.Outbox.Quoted())

	// A ledger row goes when its outbox row is done or gone and it is old;
	// one with no time at all only when its outbox row is gone. The NOT
	// EXISTS probes the outbox's unique index on event_key.
	pruneLedger := fmt.Sprintf(`
DELETE FROM %[1]s
 WHERE ctid = ANY (ARRAY(
       SELECT l.ctid FROM %[1]s AS l
        WHERE (coalesce(l.delivered_at, l.claimed_at) < now() - $1 * interval '1 microsecond'
               OR (l.delivered_at IS NULL AND l.claimed_at IS NULL
                   AND NOT EXISTS (SELECT 1 FROM %[2]s AS o WHERE o.event_key = l.event_key)))
          AND NOT EXISTS (SELECT 1 FROM %[2]s AS o
                           WHERE o.event_key = l.event_key AND o.status IS DISTINCT FROM 'done')
        LIMIT $2
          FOR UPDATE SKIP LOCKED))`, t.Ledger.Quoted(), t.Outbox.Quoted())

	var anyRecorded bool
	if err := db.QueryRow(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT FROM %s)`, t.Delivered().Quoted())).Scan(&anyRecorded); err != nil {
		return 0, 0, fmt.Errorf("look at the delivered record %s: %w", t.Delivered(), err)
	}
	for _, sql := range []string{pruneDone, pruneRecorded} {
		if sql == pruneRecorded && !anyRecorded {
			continue
		}
		for {
			var rows, ledgerWith int64
			if err := db.QueryRow(ctx, sql, cfg.DoneAfter.Microseconds(), cfg.Batch).Scan(&rows, &ledgerWith); err != nil {
				return doneRows, ledgerRows, fmt.Errorf("prune done rows of %s: %w", t.Outbox, err)
			}
			doneRows += rows
			ledgerRows += ledgerWith
			if rows < int64(cfg.Batch) {
				break
			}
			if err := ctx.Err(); err != nil {
				return doneRows, ledgerRows, err
			}
		}
	}
	for {
		tag, err := db.Exec(ctx, pruneRecord, cfg.Batch)
		if err != nil {
			return doneRows, ledgerRows, fmt.Errorf("prune the delivered record %s: %w", t.Delivered(), err)
		}
		if tag.RowsAffected() < int64(cfg.Batch) {
			break
		}
	}
	for {
		tag, err := db.Exec(ctx, pruneLedger, cfg.LedgerAfter.Microseconds(), cfg.Batch)
		if err != nil {
			return doneRows, ledgerRows, fmt.Errorf("prune ledger rows of %s: %w", t.Ledger, err)
		}
		ledgerRows += tag.RowsAffected()
		if tag.RowsAffected() < int64(cfg.Batch) {
			return doneRows, ledgerRows, nil
		}
		if err := ctx.Err(); err != nil {
			return doneRows, ledgerRows, err
		}
	}
}

// RunRetention calls Prune now and then every interval until ctx ends, and
// returns nil then. A failed pass is logged and the next one retries: a
// missed pass only leaves old rows a little longer. Each pass that deletes
// something logs how much.
func RunRetention(ctx context.Context, db DB, t Tables, cfg RetentionConfig, interval time.Duration, log zerolog.Logger) error {
	if interval <= 0 {
		return errors.New("retention: interval must be greater than zero")
	}
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
		start := time.Now()
		done, ledger, err := Prune(ctx, db, t, cfg)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			log.Warn().Err(err).Int64("done_rows", done).Int64("ledger_rows", ledger).Dur("retry_in", interval).
				Msg("retention: pruning failed; retrying at the next interval")
		case done > 0 || ledger > 0:
			log.Info().Int64("done_rows", done).Int64("ledger_rows", ledger).Dur("took", time.Since(start)).
				Msg("retention: pruned old rows")
		}
		timer.Reset(interval)
	}
}
