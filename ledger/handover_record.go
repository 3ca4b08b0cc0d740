package ledger

// The hand-over's record: the rows the snapshot left marked for the claim
// path, and the checkpoint row that says the hand-over of a slot finished
// (docs/architecture.md, "Slot creation").

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// markSnapshotIDs reads on db, in the exported snapshot, the ids of the
// rows pending there and not diverted, then
// marks those still so on the primary, by id at READ COMMITTED, in one
// transaction that also records the hand-over of slot as done at
// consistent. db is the primary (the fallback of MarkForClaim) or the
// standby the slot was made on (MarkForClaimFromStandby).
func (s *Store) markSnapshotIDs(ctx context.Context, db beginner, slot, snapshot string, consistent relay.LSN) (int64, error) {
	setSnapshot := "SET TRANSACTION SNAPSHOT " + relay.QuoteLiteral(snapshot)
	var ids []int64
	readOnly := pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}
	err := pgx.BeginTxFunc(ctx, db, readOnly, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, setSnapshot, pgx.QueryExecModeSimpleProtocol); err != nil {
			return fmt.Errorf("import snapshot %s: %w", snapshot, err)
		}
		rows, err := tx.Query(ctx, s.sql.snapshotPending)
		if err != nil {
			return err
		}
		ids, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (int64, error) {
			var id int64
			var aggType, aggID *string // the primary's own hand-over orders by them
			err := row.Scan(&id, &aggType, &aggID)
			return id, err
		})
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("read pending rows in snapshot %s: %w", snapshot, err)
	}
	var marked int64
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		for chunk := range chunks(ids) {
			tag, err := tx.Exec(ctx, s.sql.divertByID, chunk)
			if err != nil {
				return err
			}
			marked += tag.RowsAffected()
		}
		_, err := tx.Exec(ctx, s.sql.handedOver, slot, consistent)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("mark %d rows of snapshot %s for the claim path: %w", len(ids), snapshot, err)
	}
	return marked, nil
}

// beginner is what opens a transaction: a pool or a connection.
type beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// BeginSlot records, before a slot named slot is created, that its
// hand-over has not happened yet: until MarkForClaim records it, HandedOver
// reports false for whatever slot of that name exists. Safe to repeat.
func (s *Store) BeginSlot(ctx context.Context, slot string) error {
	_, err := s.runSteps(ctx, s.sql.setSynchronousCommit, []step{exec("record the slot's creation", s.sql.beginSlot, slot)})
	if err != nil {
		return fmt.Errorf("record the creation of slot %s: %w", slot, err)
	}
	return nil
}

// HandedOver reports whether the slot-creation hand-over of slot finished:
// its checkpoint row exists with the hand-over recorded. A slot created by
// a relay that crashed before its hand-over committed, or one this relay
// did not create, reports false. It only reads.
func (s *Store) HandedOver(ctx context.Context, slot string) (bool, error) {
	var done bool
	err := s.pool.QueryRow(ctx, s.sql.handoverDone, slot).Scan(&done)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read the hand-over record of slot %s: %w", slot, err)
	}
	return done, nil
}
