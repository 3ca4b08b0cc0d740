package ledger

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// handOverSlice is how many rows one transaction of a hand-over marks: each
// slice is a transaction the slot's walsender decodes before the events
// committed after it, and the next slice waits for it (Mark's pace), so a
// slice is what a fresh event can wait behind: about 2.4 MB of WAL (a
// row's mark is not a HOT update; with full-page images) and 0.2 s of the
// walsender's time on the bench machine (docs/architecture.md, "slot
// creation").
var handOverSlice = 1_000

// OpenHandOver begins the slot-creation hand-over of a new slot
// (docs/architecture.md, "slot creation"). In a REPEATABLE READ, read-only
// transaction it imports the snapshot that CREATE_REPLICATION_SLOT …
// EXPORT_SNAPSHOT exported and reads the rows pending there and not handed
// off (and not delivered everywhere) — exactly the rows committed before
// the slot's consistent point, which the new slot will never stream: their
// ids and aggregates, held in memory (16 bytes a row, and each aggregate
// once), so that no transaction stays open while they are marked (an open
// snapshot would keep every row version the claim path and the marking
// leave behind from being pruned). Once it returns, the replication connection that created
// the slot is free to stream.
//
// The replication connection must run nothing else until OpenHandOver
// returns: the snapshot exists only until then.
func (s *Store) OpenHandOver(ctx context.Context, snapshot string) (relay.HandOverRows, error) {
	if snapshot == "" {
		return nil, errors.New("hand rows to the claim path: empty snapshot name")
	}
	setSnapshot := "SET TRANSACTION SNAPSHOT " + relay.QuoteLiteral(snapshot)
	h := &handOverRows{s: s, snapshot: snapshot}
	s.handingOver.Add(1)
	readOnly := pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}
	err := pgx.BeginTxFunc(ctx, s.pool, readOnly, func(tx pgx.Tx) error {
		// SET TRANSACTION SNAPSHOT takes no parameters and must be the
		// transaction's first statement; the simple protocol keeps this
		// one-off text out of the connection's statement cache.
		if _, err := tx.Exec(ctx, setSnapshot, pgx.QueryExecModeSimpleProtocol); err != nil {
			return fmt.Errorf("import snapshot %s: %w", snapshot, err)
		}
		rows, err := tx.Query(ctx, s.sql.pendingUnmarked)
		if err != nil {
			return fmt.Errorf("read pending rows in snapshot %s: %w", snapshot, err)
		}
		defer rows.Close()
		index := map[relay.AggregateKey]int32{}
		for rows.Next() {
			var (
				id     int64
				at, ai *string
			)
			if err := rows.Scan(&id, &at, &ai); err != nil {
				return fmt.Errorf("read pending rows in snapshot %s: %w", snapshot, err)
			}
			agg := int32(-1) // not ordered
			if at != nil && ai != nil {
				k := relay.AggregateKey{Type: *at, ID: *ai}
				n, ok := index[k]
				if !ok {
					n = int32(len(h.aggs))
					index[k] = n
					h.aggs = append(h.aggs, k)
				}
				agg = n
			}
			h.rows = append(h.rows, pendingRow{id: id, agg: agg})
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("read pending rows in snapshot %s: %w", snapshot, err)
		}
		return nil
	})
	if err != nil {
		h.Close()
		return nil, err
	}
	return h, nil
}

// handOverRows is a hand-over in progress: see relay.HandOverRows.
type handOverRows struct {
	s        *Store
	snapshot string
	aggs     []relay.AggregateKey // the rows' aggregates
	rows     []pendingRow         // the rows to mark
	closed   bool
}

// pendingRow is a row to hand over: its id and its aggregate (an index in
// aggs, -1 for a row without one).
type pendingRow struct {
	id  int64
	agg int32
}

// Aggregates implements relay.HandOverRows.
func (h *handOverRows) Aggregates(context.Context) ([]relay.AggregateKey, error) {
	return h.aggs, nil
}

// Mark implements relay.HandOverRows. It marks the rows in slices of
// handOverSlice, by id at READ COMMITTED, each slice a transaction of its
// own (handoff_at = now(), due now when the row had no available_at),
// rechecking that the row is still pending, not handed off and not
// delivered everywhere: a row that changed after the snapshot (a poller
// still running claimed it) is left to whoever changed it. The aggregates
// with the fewest rows go first, each in id order: the last row or two of
// the live aggregates, whose new events the stream diverts behind them,
// before an old backlog, whose aggregates are marked from their oldest
// rows, where the claim path's runs start. After each slice, done gets the
// aggregates whose last row it marked: the stream's pin on them can end
// (relay.Consumer.Divert), so a live aggregate whose last row or two were
// pending goes back to the usual diversion, which ends when the claim path
// has delivered them, not when the whole backlog is marked. Each slice is written once pace
// reports that the stream has decoded past the previous one: the marks are
// WAL the walsender decodes before every event committed after them, and
// unpaced they put seconds of it in front of fresh events
// (docs/architecture.md, "Slot creation"). Then it records the hand-over of
// slot as done at consistent (see BeginSlot and HandedOver): a slot whose
// hand-over was cut short by a crash or an error is recognised and made
// again, and the rows marked before stay the claim path's, which is
// harmless for any later slot.
func (h *handOverRows) Mark(ctx context.Context, slot string, consistent relay.LSN, pace func(context.Context, relay.LSN) bool, done func([]relay.AggregateKey)) (int64, error) {
	if h.closed {
		// Its rows are gone: recording the hand-over now would leave them
		// to a slot that never streams them.
		return 0, errors.New("mark rows for the claim path: the hand-over was closed")
	}
	defer h.Close()
	count := make([]int, len(h.aggs))
	for _, r := range h.rows {
		if r.agg >= 0 {
			count[r.agg]++
		}
	}
	rowsOf := func(r pendingRow) int {
		if r.agg < 0 {
			return 0 // not ordered: nothing waits behind it
		}
		return count[r.agg]
	}
	slices.SortFunc(h.rows, func(a, b pendingRow) int {
		return cmp.Or(cmp.Compare(rowsOf(a), rowsOf(b)), cmp.Compare(a.id, b.id))
	})
	left := slices.Clone(count) // each aggregate's rows not marked yet
	var marked int64
	var at relay.LSN // where the last slice's WAL ends
	ids := make([]int64, 0, handOverSlice)
	for chunk := range slices.Chunk(h.rows, handOverSlice) {
		if at != 0 && !pace(ctx, at) {
			return marked, fmt.Errorf("mark rows for the claim path: %w", cmp.Or(ctx.Err(), context.Canceled))
		}
		ids = ids[:0]
		var complete []relay.AggregateKey // done may keep it
		for _, r := range chunk {
			ids = append(ids, r.id)
			if r.agg >= 0 {
				if left[r.agg]--; left[r.agg] == 0 {
					complete = append(complete, h.aggs[r.agg])
				}
			}
		}
		n, end, err := h.markSlice(ctx, ids)
		if err != nil {
			return marked, fmt.Errorf("mark %d rows of snapshot %s for the claim path: %w", len(ids), h.snapshot, err)
		}
		marked, at = marked+n, end
		// Committed: the claim store answers for these aggregates now.
		done(complete)
	}
	if _, err := h.s.pool.Exec(ctx, h.s.sql.handedOver, slot, consistent); err != nil {
		return marked, fmt.Errorf("record the hand-over of slot %s: %w", slot, err)
	}
	return marked, nil
}

// markSlice marks ids for the claim path in one synchronous transaction
// (the walsender decodes only flushed WAL: an asynchronous commit would hold
// the pace back by the WAL writer's delay) and returns how many it marked
// and the WAL position the transaction wrote up to.
func (h *handOverRows) markSlice(ctx context.Context, ids []int64) (int64, relay.LSN, error) {
	var n int64
	var at relay.LSN
	err := h.s.inTx(ctx, h.s.sql.setSynchronousCommit, func(b *pgx.Batch) {
		b.Queue(h.s.sql.markForClaimByID, ids)
		b.Queue(h.s.sql.stream.walPosition)
	}, func(br pgx.BatchResults) error {
		tag, err := br.Exec()
		if err != nil {
			return err
		}
		n = tag.RowsAffected()
		return br.QueryRow().Scan(&at)
	})
	return n, at, err
}

// Close implements relay.HandOverRows: it lets the rows go, and the
// pending scan resume.
func (h *handOverRows) Close() {
	if h.closed {
		return
	}
	h.closed = true
	h.rows, h.aggs = nil, nil
	h.s.handingOver.Add(-1)
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
