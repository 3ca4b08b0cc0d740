package relay

import "sync"

// tracker turns settled events into a position the slot may be acknowledged
// at. Entries are transactions (and keepalive positions) in stream order; the
// settled position is the end of the longest prefix whose events are all
// settled. A keepalive received in the middle of a transaction queues behind
// it, so its WAL end is acknowledged only once everything received before it
// is settled.
type tracker struct {
	mu      sync.Mutex
	entries []*txnEntry // unsettled prefix first; settled entries are popped
	open    *txnEntry   // the transaction being submitted, if any
	settled LSN
	passed  bool // a transaction with events was passed since the last report
	idle    *sync.Cond
}

// txnEntry is one transaction or keepalive position.
type txnEntry struct {
	end       LSN
	pending   int  // events not yet settled
	closed    bool // Commit (or keepalive) seen: end is known
	hasEvents bool
}

func newTracker() *tracker {
	t := &tracker{}
	t.idle = sync.NewCond(&t.mu)
	return t
}

// add counts n more events of the open transaction and returns its entry.
func (t *tracker) add(n int) *txnEntry {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.open == nil {
		t.open = &txnEntry{}
		t.entries = append(t.entries, t.open)
	}
	t.open.pending += n
	t.open.hasEvents = true
	return t.open
}

// commit closes the open transaction at end (TransactionEndLSN).
func (t *tracker) commit(end LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.open == nil {
		t.entries = append(t.entries, &txnEntry{end: end, closed: true})
	} else {
		t.open.end = end
		t.open.closed = true
		t.open = nil
	}
	t.advanceLocked()
}

// keepalive queues a position with no events of its own.
func (t *tracker) keepalive(walEnd LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if n := len(t.entries); n > 0 && t.entries[n-1].closed && t.entries[n-1].pending == 0 && t.open == nil {
		// Coalesce: a run of keepalives needs one entry, not one each.
		if walEnd > t.entries[n-1].end {
			t.entries[n-1].end = walEnd
		}
	} else {
		t.entries = append(t.entries, &txnEntry{end: walEnd, closed: true})
	}
	t.advanceLocked()
}

// done settles one event of entry e.
func (t *tracker) done(e *txnEntry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e.pending--
	t.advanceLocked()
}

func (t *tracker) advanceLocked() {
	i := 0
	for ; i < len(t.entries); i++ {
		e := t.entries[i]
		if !e.closed || e.pending > 0 {
			break
		}
		if e.end > t.settled {
			t.settled = e.end
		}
		t.passed = t.passed || e.hasEvents
	}
	if i > 0 {
		n := copy(t.entries, t.entries[i:])
		clear(t.entries[n:])
		t.entries = t.entries[:n]
	}
	if t.unsettledLocked() == 0 {
		t.idle.Broadcast()
	}
}

// unsettledLocked counts events submitted and not yet settled.
func (t *tracker) unsettledLocked() int {
	n := 0
	for _, e := range t.entries {
		n += e.pending
	}
	return n
}

// position reports the settled position and whether it passed a transaction
// with events since the previous report that said so.
func (t *tracker) position() (LSN, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	passed := t.passed
	t.passed = false
	return t.settled, passed
}

// waitIdle blocks until every submitted event is settled or stop is closed.
func (t *tracker) waitIdle(stop <-chan struct{}) bool {
	done := make(chan struct{})
	go func() {
		select {
		case <-stop:
			t.mu.Lock()
			t.idle.Broadcast()
			t.mu.Unlock()
		case <-done:
		}
	}()
	defer close(done)
	t.mu.Lock()
	defer t.mu.Unlock()
	for t.unsettledLocked() > 0 {
		select {
		case <-stop:
			return false
		default:
		}
		t.idle.Wait()
	}
	return true
}

// reset forgets every position: the next connection starts from the slot's
// confirmed position, which the server, not we, knows.
func (t *tracker) reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.entries = nil
	t.open = nil
	t.settled = 0
	t.passed = false
}
