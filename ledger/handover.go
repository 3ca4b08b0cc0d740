package ledger

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// handOverSlice is how many rows of a hand-over one read takes at most: half
// the engine's window for them (relay.HandOverWindow), so that the next
// slice is read while the last is delivered. Their payloads take at most
// the store's readBytes as well (sliceBytes).
var handOverSlice = relay.HandOverWindow / 2

// OpenHandOver begins the slot-creation hand-over of a new slot
// (docs/architecture.md, "slot creation"): it imports the snapshot that
// CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT exported into a REPEATABLE
// READ, read-only transaction, which holds it until Aggregates has read
// the rows pending there. Once it returns, the replication connection that
// created the slot is free to stream: the read of a large backlog no longer
// delays the stream's start.
//
// The replication connection must run nothing else until OpenHandOver
// returns: the snapshot exists only until then.
func (s *Store) OpenHandOver(ctx context.Context, snapshot string) (relay.HandOverRows, error) {
	if snapshot == "" {
		return nil, errors.New("hand rows to the claim path: empty snapshot name")
	}
	h := &handOverRows{s: s, snapshot: snapshot}
	s.handingOver.Add(1)
	tx, err := s.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("import snapshot %s: %w", snapshot, err)
	}
	h.tx = tx
	// A second transaction holds the same snapshot for Pending, which the
	// stream asks while the first reads.
	if h.probe, err = s.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}); err != nil {
		h.Close()
		return nil, fmt.Errorf("import snapshot %s: %w", snapshot, err)
	}
	// SET TRANSACTION SNAPSHOT takes no parameters and must be the
	// transaction's first statement; the simple protocol keeps this one-off
	// text out of the connection's statement cache.
	for _, tx := range []pgx.Tx{h.tx, h.probe} {
		if _, err := tx.Exec(ctx, "SET TRANSACTION SNAPSHOT "+relay.QuoteLiteral(snapshot), pgx.QueryExecModeSimpleProtocol); err != nil {
			h.Close()
			return nil, fmt.Errorf("import snapshot %s: %w", snapshot, err)
		}
	}
	return h, nil
}

// Pending implements relay.HandOverRows. Until the read is done it asks
// the snapshot, on a transaction of its own, through the order index
// (aggregate_type, aggregate_id, id); then it answers from the rows read.
func (h *handOverRows) Pending(ctx context.Context, aggs []relay.AggregateKey) ([]relay.AggregateKey, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, errors.New("ask the hand-over's aggregates: the hand-over was closed")
	}
	if h.readDone {
		if h.readErr != nil {
			return nil, h.readErr
		}
		if h.inSnapshot == nil {
			h.inSnapshot = make(map[relay.AggregateKey]bool, len(h.aggs))
			for _, a := range h.aggs {
				h.inSnapshot[a] = true
			}
		}
		var out []relay.AggregateKey
		for _, a := range aggs {
			if h.inSnapshot[a] {
				out = append(out, a)
			}
		}
		return out, nil
	}
	types, ids := make([]string, len(aggs)), make([]string, len(aggs))
	for i, a := range aggs {
		types[i], ids[i] = a.Type, a.ID
	}
	dbCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	rows, err := h.probe.Query(dbCtx, h.s.sql.snapshotPendingAmong, types, ids)
	if err != nil {
		return nil, fmt.Errorf("ask snapshot %s for the rows of %d aggregates: %w", h.snapshot, len(aggs), err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (a relay.AggregateKey, err error) {
		err = row.Scan(&a.Type, &a.ID)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("ask snapshot %s for the rows of %d aggregates: %w", h.snapshot, len(aggs), err)
	}
	return out, nil
}

// read reads, once, in the imported snapshot, the rows pending there and
// not diverted — exactly the rows committed before the slot's consistent
// point, which the new slot will never stream: their ids and aggregates,
// held in memory (16 bytes a row, and each aggregate once), and ends the
// snapshot's transaction, so that none stays open while they are delivered
// (an open snapshot would keep every row version left behind meanwhile from
// being pruned).
func (h *handOverRows) read(ctx context.Context) error {
	if h.closed {
		return errors.New("read the hand-over's rows: the hand-over was closed")
	}
	if h.tx == nil {
		return h.readErr
	}
	tx := h.tx
	h.tx = nil
	err := h.scan(ctx, tx)
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		rollback(tx)
		h.rows, h.aggs = nil, nil
		err = fmt.Errorf("read pending rows in snapshot %s: %w", h.snapshot, err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.readErr, h.readDone = err, true
	if h.probe != nil {
		rollback(h.probe)
		h.probe = nil
	}
	return err
}

// scan reads the snapshot's pending rows on tx.
func (h *handOverRows) scan(ctx context.Context, tx pgx.Tx) error {
	rows, err := tx.Query(ctx, h.s.sql.snapshotPending)
	if err != nil {
		return err
	}
	defer rows.Close()
	// The stream's first events wait for this read (they need the
	// aggregates to pin): each row is read from its wire bytes, and an
	// aggregate's key is built only the first time it is seen.
	index := map[string]int32{}
	var key []byte
	for rows.Next() {
		raw := rows.RawValues()
		id, err := rawInt8(raw[0], rows.FieldDescriptions()[0].Format)
		if err != nil {
			return err
		}
		agg := int32(-1) // not ordered
		if raw[1] != nil && raw[2] != nil {
			key = append(append(append(key[:0], raw[1]...), 0), raw[2]...)
			n, ok := index[string(key)]
			if !ok {
				n = int32(len(h.aggs))
				index[string(key)] = n
				h.aggs = append(h.aggs, relay.AggregateKey{Type: string(raw[1]), ID: string(raw[2])})
			}
			agg = n
		}
		h.rows = append(h.rows, pendingRow{id: id, agg: agg})
	}
	return rows.Err()
}

// rollback ends tx, on a context of its own: the one that failed may be
// done.
func rollback(tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.Background(), dbTimeout)
	defer cancel()
	_ = tx.Rollback(ctx)
}

// rawInt8 decodes a bigint column's wire bytes, in the format the server
// sent.
func rawInt8(b []byte, format int16) (int64, error) {
	if format == pgx.BinaryFormatCode {
		if len(b) != 8 {
			return 0, fmt.Errorf("bigint of %d bytes", len(b))
		}
		return int64(binary.BigEndian.Uint64(b)), nil
	}
	return strconv.ParseInt(string(b), 10, 64)
}

// handOverRows is a hand-over in progress: see relay.HandOverRows.
type handOverRows struct {
	s        *Store
	snapshot string
	tx       pgx.Tx // holds the snapshot until read

	mu         sync.Mutex                  // guards the fields below, and closed
	probe      pgx.Tx                      // holds the snapshot for Pending until read
	readDone   bool                        // the read ran
	readErr    error                       // the read's
	inSnapshot map[relay.AggregateKey]bool // aggs as a set, made when Pending asks after the read
	early      map[int64]bool              // the rows NewestUnblocked took
	earlyFed   int64                       // how many it returned

	aggs   []relay.AggregateKey // the rows' aggregates
	rows   []pendingRow         // the rows to deliver
	closed bool
}

// pendingRow is a row to hand over: its id and its aggregate (an index in
// aggs, -1 for a row without one).
type pendingRow struct {
	id  int64
	agg int32
}

// Len implements relay.HandOverRows.
func (h *handOverRows) Len() int { return len(h.rows) }

// Aggregates implements relay.HandOverRows: the first call reads the rows
// (read).
func (h *handOverRows) Aggregates(ctx context.Context) ([]relay.AggregateKey, error) {
	if err := h.read(ctx); err != nil {
		return nil, err
	}
	return h.aggs, nil
}

// Close implements relay.HandOverRows: it lets the rows go, and the
// pending scan resume.
func (h *handOverRows) Close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return
	}
	h.closed = true
	for _, tx := range []pgx.Tx{h.tx, h.probe} {
		if tx != nil {
			rollback(tx)
		}
	}
	h.tx, h.probe = nil, nil
	h.rows, h.aggs, h.inSnapshot, h.early = nil, nil, nil, nil
	h.s.handingOver.Add(-1)
}
