package ledger

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// handOverSlice is how many rows of a hand-over one read takes at most: half
// the engine's window for them (relay.HandOverWindow), so that the next
// slice is read while the last is delivered. Their payloads take at most
// the store's readBytes as well (sliceBytes).
var handOverSlice = relay.HandOverWindow / 2

// earlySlice is how many of the newest rows pending in the snapshot NewestUnblocked
// looks at.
var earlySlice = relay.HandOverWindow / 2

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

// NewestUnblocked implements relay.HandOverRows. It reads, in the snapshot, the rows
// pending there among the newest earlySlice ids and keeps those whose
// aggregate has every pending row among them (and those without one): the
// events committed just before the slot, of aggregates without a backlog,
// which would otherwise wait for the whole read. It reads them again like
// a slice of Deliver, as many as fit one slice's bytes in id order, and
// returns them with the aggregates whose every row it returns, for the
// caller to feed; Deliver leaves them out and counts them, and feeds the
// others. It returns nothing once the read is done.
func (h *handOverRows) NewestUnblocked(ctx context.Context) ([]*relay.Event, []relay.AggregateKey, error) {
	rows, err := h.earlyRows(ctx)
	if err != nil || len(rows) == 0 {
		return nil, nil, err
	}
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.id
	}
	// One slice, like Deliver's: the rows past its bytes are left to
	// Deliver, and their aggregates to the pin.
	n, err := h.sliceBytes(ctx, ids)
	if err != nil {
		return nil, nil, fmt.Errorf("read the %d newest rows of snapshot %s to deliver: %w", len(ids), h.snapshot, err)
	}
	ids = ids[:n]
	left := map[relay.AggregateKey]bool{}
	for _, r := range rows[n:] {
		if r.ordered {
			left[r.agg] = true
		}
	}
	var aggs []relay.AggregateKey
	for _, r := range rows[:n] {
		if r.ordered && !left[r.agg] {
			left[r.agg] = true // once
			aggs = append(aggs, r.agg)
		}
	}
	if ok, err := h.recordEarly(ids); !ok || err != nil {
		return nil, nil, err
	}
	events, err := h.readSlice(ctx, h.s.sql.handOverRead, ids)
	if err != nil {
		return nil, nil, fmt.Errorf("read the %d newest rows of snapshot %s to deliver: %w", len(ids), h.snapshot, err)
	}
	h.mu.Lock()
	h.earlyFed += int64(len(events))
	h.mu.Unlock()
	return events, aggs, nil
}

// earlyRow is a row NewestUnblocked may feed: its id and its aggregate, if it has one.
type earlyRow struct {
	id      int64
	agg     relay.AggregateKey
	ordered bool
}

// earlyRows reads NewestUnblocked's rows on the second transaction, in id order.
func (h *handOverRows) earlyRows(ctx context.Context) ([]earlyRow, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, errors.New("deliver the hand-over's newest rows: the hand-over was closed")
	}
	if h.readDone || h.probe == nil {
		return nil, nil
	}
	dbCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	var maxID int64
	if err := h.probe.QueryRow(dbCtx, h.s.sql.maxID).Scan(&maxID); err != nil {
		return nil, fmt.Errorf("read the newest rows of snapshot %s: %w", h.snapshot, err)
	}
	rows, err := h.probe.Query(dbCtx, h.s.sql.snapshotEarly, maxID-int64(earlySlice), maxID)
	if err != nil {
		return nil, fmt.Errorf("read the newest rows of snapshot %s: %w", h.snapshot, err)
	}
	defer rows.Close()
	var out []earlyRow
	for rows.Next() {
		var r earlyRow
		var typ, aggID *string
		if err := rows.Scan(&r.id, &typ, &aggID); err != nil {
			return nil, fmt.Errorf("read the newest rows of snapshot %s: %w", h.snapshot, err)
		}
		if typ != nil && aggID != nil {
			r.agg, r.ordered = relay.AggregateKey{Type: *typ, ID: *aggID}, true
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the newest rows of snapshot %s: %w", h.snapshot, err)
	}
	slices.SortFunc(out, func(a, b earlyRow) int { return cmp.Compare(a.id, b.id) })
	return out, nil
}

// recordEarly records the rows NewestUnblocked feeds, for Deliver to leave out, and
// reports false when the read has run since earlyRows: Deliver has every
// row then, and NewestUnblocked feeds none.
func (h *handOverRows) recordEarly(ids []int64) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return false, errors.New("deliver the hand-over's newest rows: the hand-over was closed")
	}
	if h.readDone {
		return false, nil
	}
	h.early = make(map[int64]bool, len(ids))
	for _, id := range ids {
		h.early[id] = true
	}
	return true, nil
}

// sliceBytes returns how many of ids, from the first, one slice reads: as
// many as fit the store's readBytes by their payloads' size
// (payloadSizes), and at least one, so that a row larger than that is read
// alone.
func (h *handOverRows) sliceBytes(ctx context.Context, ids []int64) (int, error) {
	sizes, err := h.s.payloadSizes(ctx, ids)
	if err != nil {
		return 0, err
	}
	return fitBytes(ids, sizes, h.s.readBytes), nil
}

// payloadSizes returns the payload bytes of the rows ids (PayloadBytes); a
// row gone is left out.
func (s *Store) payloadSizes(ctx context.Context, ids []int64) (map[int64]int64, error) {
	dbCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	rows, err := s.pool.Query(dbCtx, s.sql.payloadSizes, ids)
	if err != nil {
		return nil, fmt.Errorf("read the payloads' sizes: %w", err)
	}
	sizes := make(map[int64]int64, len(ids))
	var id, size int64
	if _, err := pgx.ForEachRow(rows, []any{&id, &size}, func() error { sizes[id] = size; return nil }); err != nil {
		return nil, fmt.Errorf("read the payloads' sizes: %w", err)
	}
	return sizes, nil
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

// Deliver implements relay.HandOverRows. It reads the rows again by id, a
// slice at a time at READ COMMITTED — at most handOverSlice rows, whose
// payloads take at most the store's readBytes (a row larger than that
// alone), so that the memory a slice holds before the engine takes it is
// bounded by bytes (docs/performance.md, "Memory") — keeping only those
// still pending and not diverted (a poller still running may have
// claimed one since the snapshot, the stream may have settled one), and
// gives them
// to feed. The aggregates with the fewest rows go first, each in id order:
// the last row or two of the live aggregates, whose streamed events the
// pin diverts until their rows are fed, before an old backlog. After each
// slice, fed gets the aggregates whose last row it held: their pins end
// (relay.Consumer.Divert). Once settled returns it records the hand-over
// of slot as done at consistent, with a synchronous commit that makes the
// settlements before it durable too (see BeginSlot and HandedOver): a slot
// whose hand-over was cut short by a crash or an error is recognised and
// made again, and hands over what is still pending then
// (docs/architecture.md, "Slot creation").
func (h *handOverRows) Deliver(ctx context.Context, slot string, consistent relay.LSN, feed func(context.Context, []*relay.Event) error, fed func([]relay.AggregateKey), settled func(context.Context) error) (int64, error) {
	if h.closed {
		// Its rows are gone: recording the hand-over now would leave them
		// to a slot that never streams them.
		return 0, errors.New("deliver the hand-over's rows: the hand-over was closed")
	}
	defer h.Close()
	if err := h.read(ctx); err != nil {
		return 0, err
	}
	h.mu.Lock()
	early, total := h.early, h.earlyFed
	h.mu.Unlock()
	if len(early) > 0 { // fed by NewestUnblocked
		h.rows = slices.DeleteFunc(h.rows, func(r pendingRow) bool { return early[r.id] })
	}
	readSQL := h.s.sql.handOverRead
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
	left := slices.Clone(count) // each aggregate's rows not fed yet
	for chunk := range slices.Chunk(h.rows, handOverSlice) {
		ids := make([]int64, len(chunk))
		for i, r := range chunk {
			ids[i] = r.id
		}
		// The chunk is read in slices of readBytes: the rows' sizes
		// first, then each slice's payloads.
		sizes, err := h.s.payloadSizes(ctx, ids)
		if err != nil {
			return total, fmt.Errorf("read %d rows of snapshot %s to deliver: %w", len(ids), h.snapshot, err)
		}
		for len(chunk) > 0 {
			n := fitBytes(ids, sizes, h.s.readBytes)
			slice, sliceIDs := chunk[:n], ids[:n]
			chunk, ids = chunk[n:], ids[n:]
			var complete []relay.AggregateKey // fed may keep it
			for _, r := range slice {
				if r.agg >= 0 {
					if left[r.agg]--; left[r.agg] == 0 {
						complete = append(complete, h.aggs[r.agg])
					}
				}
			}
			events, err := h.readSlice(ctx, readSQL, sliceIDs)
			if err != nil {
				return total, fmt.Errorf("read %d rows of snapshot %s to deliver: %w", n, h.snapshot, err)
			}
			if err := feed(ctx, events); err != nil {
				return total, fmt.Errorf("deliver %d rows of snapshot %s: %w", len(events), h.snapshot, err)
			}
			total += int64(len(events))
			// Queued: the aggregates' streamed events follow them in the
			// lanes.
			fed(complete)
		}
	}
	if err := settled(ctx); err != nil {
		return total, fmt.Errorf("wait for the hand-over's rows to settle: %w", err)
	}
	if _, err := h.s.pool.Exec(ctx, h.s.sql.handedOver, slot, consistent); err != nil {
		return total, fmt.Errorf("record the hand-over of slot %s: %w", slot, err)
	}
	return total, nil
}

// fitBytes returns how many of ids, from the first, fit limit by their
// payloads' sizes: at least one, so that a row larger than limit is read
// alone.
func fitBytes(ids []int64, sizes map[int64]int64, limit int64) int {
	var bytes int64
	for i, id := range ids {
		bytes += sizes[id]
		if i > 0 && bytes > limit {
			return i
		}
	}
	return len(ids)
}

// readSlice reads the rows of ids still to deliver, in the order of ids.
func (h *handOverRows) readSlice(ctx context.Context, readSQL string, ids []int64) ([]*relay.Event, error) {
	dbCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	rows, err := h.s.pool.Query(dbCtx, readSQL, ids)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	byID := make(map[int64]*relay.Event, len(ids))
	var (
		created, availAt pgtype.Timestamptz
		attempts         int32
	)
	for rows.Next() {
		ev := &relay.Event{Status: "pending"}
		if err := rows.Scan(&ev.ID, &ev.EventKey, &ev.EventType, &ev.AggregateType, &ev.AggregateID, &ev.Payload,
			&created, &attempts, &availAt, &ev.TraceContext); err != nil {
			return nil, err
		}
		ev.CreatedAt, ev.AvailableAt, ev.Attempts = created.Time, availAt.Time, int(attempts)
		byID[ev.ID] = ev
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	out := make([]*relay.Event, 0, len(byID))
	for _, id := range ids {
		if ev := byID[id]; ev != nil {
			out = append(out, ev)
		}
	}
	return out, nil
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
