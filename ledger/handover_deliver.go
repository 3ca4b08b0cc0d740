package ledger

// The hand-over's delivery: the rows read again by id, in slices that fit
// the store's read budget (docs/architecture.md, "Slot creation").

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
