package ledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/relay"
)

// handOverSlice is how many rows one transaction of a hand-over marks: each
// slice is a transaction the slot's walsender decodes before the events
// committed after it, so slices keep it from holding fresh events back for
// the whole backlog (docs/architecture.md, "slot creation").
const handOverSlice = 5_000

// OpenHandOver begins the slot-creation hand-over of a new slot
// (docs/architecture.md, "slot creation"). In a REPEATABLE READ, read-only
// transaction on a connection of its own it imports the snapshot that
// CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT exported, and keeps it open: the
// rows pending in it and not handed off (and not delivered everywhere) are
// exactly the rows committed before the slot's consistent point, which the
// new slot will never stream. Once it returns, the replication connection
// that created the slot is free to stream; the transaction holds the
// snapshot until Mark or Close.
//
// The replication connection must run nothing else until OpenHandOver
// returns: the snapshot exists only until then.
func (s *Store) OpenHandOver(ctx context.Context, snapshot string) (relay.HandOverRows, error) {
	if snapshot == "" {
		return nil, errors.New("hand rows to the claim path: empty snapshot name")
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("hand rows to the claim path: %w", err)
	}
	h := &handOverRows{s: s, conn: conn, snapshot: snapshot}
	h.tx, err = conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err == nil {
		// SET TRANSACTION SNAPSHOT takes no parameters and must be the
		// transaction's first statement; the simple protocol keeps this
		// one-off text out of the connection's statement cache.
		_, err = h.tx.Exec(ctx, "SET TRANSACTION SNAPSHOT "+relay.QuoteLiteral(snapshot), pgx.QueryExecModeSimpleProtocol)
	}
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("import snapshot %s: %w", snapshot, err)
	}
	return h, nil
}

// handOverRows is a hand-over in progress: see relay.HandOverRows.
type handOverRows struct {
	s        *Store
	snapshot string
	conn     *pgxpool.Conn
	tx       pgx.Tx // in the imported snapshot; nil once closed
}

// Aggregates implements relay.HandOverRows.
func (h *handOverRows) Aggregates(ctx context.Context) ([]relay.AggregateKey, error) {
	rows, err := h.tx.Query(ctx, h.s.sql.pendingAggregates)
	if err != nil {
		return nil, fmt.Errorf("read the aggregates pending in snapshot %s: %w", h.snapshot, err)
	}
	aggs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (relay.AggregateKey, error) {
		var a relay.AggregateKey
		err := row.Scan(&a.Type, &a.ID)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the aggregates pending in snapshot %s: %w", h.snapshot, err)
	}
	return aggs, nil
}

// Mark implements relay.HandOverRows. It reads the ids pending in the
// snapshot in one pass and marks each slice of handOverSlice ids as it
// comes, by id at READ COMMITTED in a transaction of its own on another
// connection (handoff_at = now(), due now when the row had no
// available_at), rechecking that the row is still pending, not handed off
// and not delivered everywhere: a row that changed after the snapshot (a
// poller still running claimed it) is left to whoever changed it. Then it
// records the hand-over of slot as done at consistent (see BeginSlot and
// HandedOver): a slot whose hand-over was cut short by a crash or an error
// is recognised and made again, and the rows marked before stay the claim
// path's, which is harmless for any later slot.
func (h *handOverRows) Mark(ctx context.Context, slot string, consistent relay.LSN) (int64, error) {
	defer h.Close()
	var marked int64
	ids := make([]int64, 0, handOverSlice)
	mark := func() error {
		if len(ids) == 0 {
			return nil
		}
		tag, err := h.s.pool.Exec(ctx, h.s.sql.markForClaimByID, ids)
		if err != nil {
			return fmt.Errorf("mark %d rows of snapshot %s for the claim path (ids %d to %d): %w", len(ids), h.snapshot, ids[0], ids[len(ids)-1], err)
		}
		marked += tag.RowsAffected()
		ids = ids[:0]
		return nil
	}
	rows, err := h.tx.Query(ctx, h.s.sql.pendingUnmarked)
	if err != nil {
		return 0, fmt.Errorf("read pending rows in snapshot %s: %w", h.snapshot, err)
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return marked, fmt.Errorf("read pending rows in snapshot %s: %w", h.snapshot, err)
		}
		if ids = append(ids, id); len(ids) == handOverSlice {
			if err := mark(); err != nil {
				return marked, err
			}
		}
	}
	if err := rows.Err(); err != nil {
		return marked, fmt.Errorf("read pending rows in snapshot %s: %w", h.snapshot, err)
	}
	if err := mark(); err != nil {
		return marked, err
	}
	if _, err := h.s.pool.Exec(ctx, h.s.sql.handedOver, slot, consistent); err != nil {
		return marked, fmt.Errorf("record the hand-over of slot %s: %w", slot, err)
	}
	return marked, nil
}

// Close implements relay.HandOverRows.
func (h *handOverRows) Close() {
	if h.tx == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.tx.Rollback(ctx); err != nil {
		// The connection's state is unknown: it does not go back to the pool.
		_ = h.conn.Conn().Close(ctx)
	}
	h.conn.Release()
	h.tx = nil
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
