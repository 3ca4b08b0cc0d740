package ledger

// The newest unblocked rows: those a hand-over feeds before its read is
// done (docs/architecture.md, "Slot creation").

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/outbox-relay/outbox-relay/relay"
)

// earlySlice is how many of the newest rows pending in the snapshot NewestUnblocked
// looks at.
var earlySlice = relay.HandOverWindow / 2

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
