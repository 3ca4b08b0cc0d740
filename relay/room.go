package relay

import (
	"context"
	"iter"

	"golang.org/x/sync/semaphore"
)

// DefaultMaxInFlightBytes is the engine's byte budget when none is set
// (delivery.max_inflight_bytes).
const DefaultMaxInFlightBytes = 64 << 20

// ReadBytes is the most payload bytes one read of rows may hold before the
// engine takes them — a claim, a slice of a hand-over — for an engine whose
// budget is maxInFlight: an eighth of it. Taken, with the envelopes built
// from them, a read's rows fill about a quarter of the budget, so two of
// them fit the hand-over's half while the next is read (docs/performance.md,
// "Memory").
func ReadBytes(maxInFlight int64) int64 { return max(maxInFlight/8, 1) }

// room bounds what the engine holds unsettled, by count and by bytes
// (Event.Size): the engine's room, which every path shares, and the
// hand-over's share of it. A group of works is taken at once, and waits
// until it fits both bounds; each work gives its room back once settled.
//
// A work larger than the byte bound is charged the whole of it: it is taken
// alone, once nothing else holds any room, and nothing is taken beside it
// until it is settled. So it is delivered, never waits for room that cannot
// come, and the bound holds for everything else.
type room struct {
	count, bytes *semaphore.Weighted
	maxCount     int
	maxBytes     int64
}

func newRoom(maxCount int, maxBytes int64) *room {
	maxCount, maxBytes = max(maxCount, 1), max(maxBytes, 1)
	return &room{
		count:    semaphore.NewWeighted(int64(maxCount)),
		bytes:    semaphore.NewWeighted(maxBytes),
		maxCount: maxCount,
		maxBytes: maxBytes,
	}
}

// charge is what a work of size bytes takes of r's bytes.
func (r *room) charge(size int64) int64 { return min(size, r.maxBytes) }

// fit returns how many of works, from the first, one take may ask for: as
// many as an empty room holds, and at least one.
func (r *room) fit(works []*Work) int {
	var bytes int64
	for i, w := range works {
		bytes += r.charge(w.size)
		if i > 0 && (i >= r.maxCount || bytes > r.maxBytes) {
			return i
		}
	}
	return len(works)
}

// groups cuts works, in order, into the groups one take may ask for (fit).
func (r *room) groups(works []*Work) iter.Seq[[]*Work] {
	return func(yield func([]*Work) bool) {
		for len(works) > 0 {
			n := r.fit(works)
			if !yield(works[:n]) {
				return
			}
			works = works[n:]
		}
	}
}

// take waits until the group works (cut by fit) fits r, and takes its
// room; it returns ctx's error if that ends first, having taken nothing.
func (r *room) take(ctx context.Context, works []*Work) error {
	if len(works) == 0 {
		return nil
	}
	var bytes int64
	for _, w := range works {
		bytes += r.charge(w.size)
	}
	// The group holds its count while it waits for bytes: bytes are held
	// only by works taken, which give them back once settled, whatever the
	// sources do, so the wait ends.
	if err := r.count.Acquire(ctx, int64(len(works))); err != nil {
		return err
	}
	if err := r.bytes.Acquire(ctx, bytes); err != nil {
		r.count.Release(int64(len(works)))
		return err
	}
	return nil
}

// give gives back the room of works taken with take.
func (r *room) give(works ...*Work) {
	var bytes int64
	for _, w := range works {
		bytes += r.charge(w.size)
	}
	r.count.Release(int64(len(works)))
	r.bytes.Release(bytes)
}
