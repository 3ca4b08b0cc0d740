package admin

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// RetentionConfig says what Prune deletes.
type RetentionConfig struct {
	// DoneAfter: done and discarded outbox rows processed longer ago than
	// this are deleted. Such a row without processed_at (written so by a
	// legacy poller) ages from its created_at.
	DoneAfter time.Duration
	// LedgerAfter: ledger rows delivered (or claimed) longer ago than this
	// are deleted once their outbox row is gone (a done or discarded row's
	// go with it). A ledger row with neither time is deleted once its
	// outbox row is gone.
	LedgerAfter time.Duration
	// Batch is the number of rows per DELETE [1000].
	Batch int
	// Scan is the number of rows one statement looks at [10 × Batch]:
	// Prune walks the outbox by id and the ledger by key in slices of this
	// many rows, so that no statement holds a snapshot over a whole table.
	Scan int
	// Horizon, when set, keeps every row the relay's slot could still send
	// again (see Horizon); RunRetention makes one for Slot.
	Horizon *Horizon
	// Slot names the relay's replication slot, for RunRetention.
	Slot string
}

// Horizon tells Prune which rows a replication slot can no longer send
// again. The slot sends again, after a reconnect, every transaction that
// ends past its confirmed position; a row pruned before the slot passed it
// would then be found missing and delivered again (docs/guarantees.md,
// "retention"). A row has no LSN, but its inserting transaction has an xid:
// each pass samples, in one statement, the WAL insert position W and the
// oldest transaction still running, X (its snapshot's xmin). Every
// transaction older than X had ended before W was read, so its commit lies
// before W; once the slot's confirmed position reaches W, every row whose
// xmin is older than X is behind the slot. Prune uses the newest sample the
// slot has passed; with no slot at all (poll mode) nothing holds rows back.
// A Horizon is used by one goroutine at a time.
type Horizon struct {
	slot string
	// slotDB is where the slot lives when not on the database Prune
	// prunes: the standby the relay decodes on (NewHorizonOn).
	slotDB  DB
	samples []horizonSample // oldest first
}

type horizonSample struct {
	wal  relay.LSN
	xmin uint32 // the 32-bit xid of the snapshot's xmin
}

// NewHorizon returns the horizon of slot.
func NewHorizon(slot string) *Horizon { return &Horizon{slot: slot} }

// NewHorizonOn returns the horizon of slot living on slotDB, a physical
// standby of the database Prune prunes (source.standby_url,
// docs/standby.md): the standby replays the primary's WAL, so its slot's
// confirmed position and the primary's WAL positions are comparable.
func NewHorizonOn(slot string, slotDB DB) *Horizon { return &Horizon{slot: slot, slotDB: slotDB} }

// horizonBounds is what a Horizon allows: every row (no slot), none yet
// (the slot has passed no sample), or rows older than an xid.
type horizonBounds struct {
	all, none bool
	xmin      uint32
}

// advance takes a sample and returns what the slot has passed.
func (h *Horizon) advance(ctx context.Context, db DB) (horizonBounds, error) {
	var s horizonSample
	var xmin int64
	if err := db.QueryRow(ctx, catalogSQL("RetentionSample")).
		Scan(&s.wal, &xmin); err != nil {
		return horizonBounds{}, fmt.Errorf("sample the WAL position and the oldest transaction: %w", err)
	}
	s.xmin = uint32(xmin)
	var confirmed *string
	slotDB := db
	if h.slotDB != nil {
		slotDB = h.slotDB
	}
	err := slotDB.QueryRow(ctx, catalogSQL("RetentionSlotConfirmed"), h.slot).Scan(&confirmed)
	if errors.Is(err, pgx.ErrNoRows) {
		h.samples = nil
		return horizonBounds{all: true}, nil
	}
	if err != nil {
		return horizonBounds{}, fmt.Errorf("read slot %s: %w", h.slot, err)
	}
	h.samples = append(h.samples, s)
	var passed relay.LSN
	if confirmed != nil {
		if err := passed.Scan(*confirmed); err != nil {
			return horizonBounds{}, fmt.Errorf("read slot %s: %w", h.slot, err)
		}
	}
	use := -1
	for i, smp := range h.samples {
		if smp.wal <= passed {
			use = i
		}
	}
	if use < 0 {
		return horizonBounds{none: true}, nil
	}
	b := horizonBounds{xmin: h.samples[use].xmin}
	h.samples = h.samples[use:]
	if len(h.samples) > 1000 { // a slot that never moves: keep the oldest and the newest
		h.samples = append(h.samples[:1], h.samples[len(h.samples)-999:]...)
	}
	return b, nil
}

// Prune deletes old done and discarded outbox rows with their ledger rows,
// and old ledger rows whose outbox row is gone, Batch rows per statement
// (each its own short transaction), until none is left, and returns how
// many of each it deleted.
//
// It never deletes a row the relay's slot could still send again
// (cfg.Horizon), a pending, processing, held or failed row, nor any ledger
// row of an event whose outbox row is in one of those statuses: the ledger
// is what keeps such a row from being delivered twice. Rows locked by
// someone else (a replay in progress) are skipped until the next call.
// Each batch re-checks the status it deletes by, so a row replayed
// meanwhile is kept. Prune is safe to run concurrently with the relay and
// with itself.
//
// Finding old rows reads the whole outbox and the whole ledger (neither has
// an index on the time columns), in slices of Scan rows by primary key:
// each slice's statements are short, however large the tables and however
// few of their rows are old. One statement that scanned a whole table
// found nothing to delete on a young outbox, took minutes on a large one,
// and held back the oldest snapshot all the while, so that no dead row
// version could be removed and every index scan of the relay slowed
// (docs/operations.md, "Retention"). When ctx ends, Prune returns what it
// deleted so far with ctx's error.
func Prune(ctx context.Context, db DB, t Tables, cfg RetentionConfig) (doneRows, ledgerRows int64, err error) {
	if cfg.DoneAfter <= 0 || cfg.LedgerAfter <= 0 {
		return 0, 0, errors.New("prune: the retention ages must be greater than zero")
	}
	if cfg.Batch <= 0 {
		cfg.Batch = 1000
	}
	if cfg.Scan <= 0 {
		cfg.Scan = 10 * cfg.Batch
	}
	bounds := horizonBounds{all: true}
	if cfg.Horizon != nil {
		if bounds, err = cfg.Horizon.advance(ctx, db); err != nil {
			return 0, 0, fmt.Errorf("prune: %w", err)
		}
	}
	// xmin bounds the rows RetentionPruneDone deletes: their inserting
	// transactions must be older than it (nil: no bound).
	var xmin any
	switch {
	case bounds.none:
		// The slot has passed no sample yet: only ledger rows of rows
		// long gone may go.
	case !bounds.all:
		xmin = int64(bounds.xmin)
	}

	pruneDone := t.sql("RetentionPruneDone")
	pruneLedgerFirst, pruneLedgerNext := t.sql("RetentionPruneLedgerFirst"), t.sql("RetentionPruneLedgerNext")
	outboxSlice := t.sql("RetentionOutboxSlice")
	ledgerSliceFirst, ledgerSliceNext := t.sql("RetentionLedgerSliceFirst"), t.sql("RetentionLedgerSliceNext")

	prunes := []string{pruneDone}
	if bounds.none {
		prunes = nil
	}
	// The outbox, a slice of ids at a time; in each slice, DELETEs of at
	// most Batch rows until one deletes fewer.
	for lo := int64(math.MinInt64); len(prunes) > 0; {
		var hi *int64
		var last bool
		if err := db.QueryRow(ctx, outboxSlice, lo, cfg.Scan).Scan(&hi, &last); err != nil {
			return doneRows, ledgerRows, fmt.Errorf("prune done rows of %s: %w", t.Outbox, err)
		}
		if hi == nil {
			break
		}
		for _, sql := range prunes {
			for {
				var rows, ledgerWith int64
				if err := db.QueryRow(ctx, sql, cfg.DoneAfter.Microseconds(), cfg.Batch, xmin, lo, *hi).Scan(&rows, &ledgerWith); err != nil {
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
		if last {
			break
		}
		if err := ctx.Err(); err != nil {
			return doneRows, ledgerRows, err
		}
		lo = *hi
	}
	// The ledger, a slice of keys at a time.
	loKey, loAction, first := "", "", true
	for {
		slice, prune := ledgerSliceNext, pruneLedgerNext
		if first {
			slice, prune = ledgerSliceFirst, pruneLedgerFirst
		}
		var hiKey, hiAction *string
		var last bool
		if err := db.QueryRow(ctx, slice, loKey, loAction, cfg.Scan).Scan(&hiKey, &hiAction, &last); err != nil {
			return doneRows, ledgerRows, fmt.Errorf("prune ledger rows of %s: %w", t.Ledger, err)
		}
		if hiKey == nil {
			return doneRows, ledgerRows, nil
		}
		for {
			tag, err := db.Exec(ctx, prune, cfg.LedgerAfter.Microseconds(), cfg.Batch, loKey, loAction, *hiKey, *hiAction)
			if err != nil {
				return doneRows, ledgerRows, fmt.Errorf("prune ledger rows of %s: %w", t.Ledger, err)
			}
			ledgerRows += tag.RowsAffected()
			if tag.RowsAffected() < int64(cfg.Batch) {
				break
			}
			if err := ctx.Err(); err != nil {
				return doneRows, ledgerRows, err
			}
		}
		if last {
			return doneRows, ledgerRows, nil
		}
		if err := ctx.Err(); err != nil {
			return doneRows, ledgerRows, err
		}
		loKey, loAction, first = *hiKey, *hiAction, false
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
	if cfg.Horizon == nil && cfg.Slot != "" {
		cfg.Horizon = NewHorizon(cfg.Slot)
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
