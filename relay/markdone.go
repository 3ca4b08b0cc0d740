package relay

import (
	"context"
	"sync"
	"time"
)

// Marking rows done (mark_done: async). An event the stream delivered has
// its delivered ledger rows when it settles: that is the record of delivery
// (docs/operations.md, "what the relay writes back"). Its row's status is
// marked done afterwards, in batches, off the acknowledgement path, for the
// people and tools that read the status column. The ids waiting here are an
// accelerator, never the only record of anything: ids lost in a crash leave
// delivered rows pending until the next phase's MarkDeliveredDone marks them
// from the ledger, and every reader of the table counts a pending row the
// ledger shows delivered everywhere as done meanwhile.
//
// Every write is WAL that the walsender must decode before the events
// committed after it. A backlog of marks (after a drain of many thousands
// of events) written at once would put seconds of decoding in front of
// fresh events, so the loop paces itself by the walsender: it writes a
// batch only once the stream has decoded past the end of the previous one
// (Consumer positions: commits and keepalives; while it waits it asks the
// stream to fetch the position often, Consumer.PositionWanted), so at most
// one batch of marks is ever queued in front of a fresh commit. While the walsender is
// far behind (it is decoding a backlog) it writes a batch at most every
// markWaitMax.

const (
	// markEvery is how often the loop looks for rows to mark.
	markEvery = 200 * time.Millisecond
	// markBatch bounds one write: about 1,000 rows' worth of WAL decodes
	// in a few milliseconds.
	markBatch = 1000
	// markWaitMax is the longest the loop waits for the walsender to pass
	// its previous write before it writes again anyway (the walsender is
	// busy with a backlog, or no stream runs).
	markWaitMax = 5 * time.Second
	// markPoll is how often a waiting loop looks at the decoded position.
	markPoll = 5 * time.Millisecond
	// markTries bounds the batches that retry a row not visible yet.
	markTries = 150
)

// markQueue collects stream rows to mark done.
type markQueue struct {
	mu    sync.Mutex
	ids   []int64
	tries map[int64]int // ids whose row was not visible yet: tries so far
	// lastAt is where the last write ended in the WAL. The loop and a
	// stop's flush (Drain) both write batches, so it is read under mu
	// (last).
	lastAt LSN
}

func newMarkQueue() *markQueue { return &markQueue{tries: map[int64]int{}} }

func (m *markQueue) add(id int64) {
	m.mu.Lock()
	m.ids = append(m.ids, id)
	m.mu.Unlock()
}

// take removes and returns up to n ids.
func (m *markQueue) take(n int) []int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	n = min(n, len(m.ids))
	ids := m.ids[:n:n]
	m.ids = m.ids[n:]
	if len(m.ids) == 0 {
		m.ids = nil
	}
	return ids
}

// last reports where the last batch written ended in the WAL.
func (m *markQueue) last() LSN {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lastAt
}

// waiting reports how many ids wait.
func (m *markQueue) waiting() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.ids)
}

// markDoneLoop marks delivered rows done in paced batches until ctx ends.
func (e *Engine) markDoneLoop(ctx context.Context) {
	tick := time.NewTicker(markEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for e.marks.waiting() > 0 {
			if !e.waitDecodedPast(ctx, e.marks.last()) {
				return
			}
			e.markBatch(ctx, e.marks.take(markBatch))
		}
	}
}

// waitDecodedPast waits until the stream has decoded past at, or
// markWaitMax passed; it reports false when ctx ended first. Every writer of
// WAL the stream must decode before fresh events, but does not need,
// paces itself by it: the done marks and a new slot's hand-over.
func (e *Engine) waitDecodedPast(ctx context.Context, at LSN) bool {
	if at == 0 || e.stream.decodedPast(at) {
		return ctx.Err() == nil
	}
	deadline := time.Now().Add(markWaitMax)
	tick := time.NewTicker(markPoll)
	defer tick.Stop()
	e.stream.waiters.Add(1)
	defer e.stream.waiters.Add(-1)
	for !e.stream.decodedPast(at) && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return false
		case <-tick.C:
		}
	}
	return ctx.Err() == nil
}

// flushMarkDone marks every waiting row at once, unpaced: the relay is
// stopping (Drain), and the stream no longer decodes.
func (e *Engine) flushMarkDone(ctx context.Context) {
	for e.marks.waiting() > 0 && ctx.Err() == nil {
		e.markBatch(ctx, e.marks.take(5*markBatch))
	}
}

// markBatch writes one batch; rows not visible yet go back to the queue
// (at most markTries times each).
func (e *Engine) markBatch(ctx context.Context, ids []int64) {
	if len(ids) == 0 {
		return
	}
	m := e.marks
	invisible, at, err := e.cfg.Stream.MarkDone(ctx, ids)
	if err != nil {
		if ctx.Err() == nil {
			e.log.Warn().Err(err).Int("rows", len(ids)).Msg("mark rows done; they stay pending until the next start marks them from the ledger")
		}
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if at > m.lastAt {
		m.lastAt = at
	}
	if len(m.tries) > 0 {
		// Forget the tries of rows marked.
		retrying := make(map[int64]bool, len(invisible))
		for _, id := range invisible {
			retrying[id] = true
		}
		for _, id := range ids {
			if !retrying[id] {
				delete(m.tries, id)
			}
		}
	}
	for _, id := range invisible {
		if m.tries[id]++; m.tries[id] < markTries {
			m.ids = append(m.ids, id)
		} else {
			delete(m.tries, id)
		}
	}
}
