package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// MarkForClaim is the slot-creation hand-over (docs/architecture.md, "slot creation"). In
// the snapshot that CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT exported, it
// marks for the claim path (handoff_at = now()) every row still pending and
// not handed off: exactly the rows committed before the slot's consistent
// point, which the new slot will never stream. Rows committed later are not
// visible in the snapshot and stay the stream's. It returns how many rows it
// marked.
//
// The replication connection that created the slot must stay open and run
// nothing else until MarkForClaim returns: the snapshot exists only until
// then. An error means the snapshot may be gone; rows already marked stay
// marked, which is harmless for any later slot, so the caller drops the slot
// and starts over. Safe to repeat with a fresh slot and snapshot.
//
// The marking is one UPDATE at REPEATABLE READ in the imported snapshot.
// When a row changed after the snapshot (a claim by a poller still running)
// that UPDATE fails with a serialization error; MarkForClaim then reads the
// ids in the snapshot instead and marks those still pending and not handed
// off, at READ COMMITTED.
//
// In the transaction that marks the rows it records the hand-over as done
// for slot at consistent, the slot's consistent point (see BeginSlot and
// HandedOver): a slot whose hand-over was cut short by a crash is then
// recognised and made again.
func (s *Store) MarkForClaim(ctx context.Context, slot, snapshot string, consistent relay.LSN) (int64, error) {
	if snapshot == "" {
		return 0, errors.New("mark rows for the claim path: empty snapshot name")
	}
	// SET TRANSACTION SNAPSHOT takes no parameters. The simple protocol keeps
	// this one-off text out of the connection's statement cache and makes it
	// the transaction's first statement.
	setSnapshot := "SET TRANSACTION SNAPSHOT " + relay.QuoteLiteral(snapshot)
	repeatableRead := pgx.TxOptions{IsoLevel: pgx.RepeatableRead}

	var marked int64
	err := pgx.BeginTxFunc(ctx, s.pool, repeatableRead, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, setSnapshot, pgx.QueryExecModeSimpleProtocol); err != nil {
			return fmt.Errorf("import snapshot %s: %w", snapshot, err)
		}
		tag, err := tx.Exec(ctx, s.sql.markForClaim)
		if err != nil {
			return err
		}
		marked = tag.RowsAffected()
		_, err = tx.Exec(ctx, s.sql.handedOver, slot, consistent)
		return err
	})
	if err == nil {
		return marked, nil
	}
	if !hasSQLState(err, "40001") { // serialization_failure
		return 0, fmt.Errorf("mark rows for the claim path in snapshot %s: %w", snapshot, err)
	}

	return s.markSnapshotIDs(ctx, s.pool, slot, snapshot, consistent)
}

// markSnapshotIDs reads on db, in the exported snapshot, the ids of the
// rows pending there and not handed off (and not delivered everywhere), then
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
		rows, err := tx.Query(ctx, s.sql.pendingUnmarked)
		if err != nil {
			return err
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("read pending rows in snapshot %s: %w", snapshot, err)
	}
	var marked int64
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		for chunk := range chunks(ids) {
			tag, err := tx.Exec(ctx, s.sql.markForClaimByID, chunk)
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

// deliveredDoneChunk is the id range one MarkDeliveredDone statement covers.
const deliveredDoneChunk = 10_000

// MarkDeliveredDone sets status 'done' on the rows still pending and not
// handed off that the ledger shows delivered to every sink they are routed
// to (DeliveredEverywhere), and returns how many. It repairs what the
// engine's own marking (mark_done: async) leaves behind: ids it held in
// memory when the relay crashed, rows it could not see yet. The relay runs
// it at the start of each phase beside the sources, and poll mode whatever
// mark_done says, so that the claim path and a legacy poller read the status
// they expect (docs/operations.md, "what the relay writes back"). It walks
// the pending ids in ranges of deliveredDoneChunk, one short transaction
// each, skipping rows another transaction has locked (they are being
// settled), so a backlog of a million rows neither delays streaming nor
// holds locks for long. With no sinks configured it marks nothing. Safe to
// repeat and to cancel between chunks.
func (s *Store) MarkDeliveredDone(ctx context.Context) (int64, error) {
	if len(s.routes) == 0 {
		return 0, nil
	}
	var lo, hi pgtype.Int8
	if err := s.pool.QueryRow(ctx, s.sql.pendingRange).Scan(&lo, &hi); err != nil {
		return 0, fmt.Errorf("mark delivered rows done: find the pending rows: %w", err)
	}
	var marked int64
	for from := lo.Int64 - 1; lo.Valid && from < hi.Int64; from += deliveredDoneChunk {
		to := min(from+deliveredDoneChunk, hi.Int64)
		tag, err := s.pool.Exec(ctx, s.sql.markDeliveredDone, from, to)
		if err != nil {
			return marked, fmt.Errorf("mark delivered rows done (ids %d to %d): %w", from+1, to, err)
		}
		marked += tag.RowsAffected()
	}
	return marked, nil
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
