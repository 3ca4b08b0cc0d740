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
	current *txnEntry   // the transaction being submitted, if any
	settled LSN
	passed  bool // a transaction with events was passed since the last report
}

// txnEntry is one transaction or keepalive position.
type txnEntry struct {
	end       LSN
	pending   int  // events not yet settled
	closed    bool // Commit (or keepalive) seen: end is known
	hasEvents bool
}

func newTracker() *tracker { return &tracker{} }

// open returns the entry of the transaction being submitted, creating it.
func (t *tracker) open() *txnEntry {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.current == nil {
		t.current = &txnEntry{}
		t.entries = append(t.entries, t.current)
	}
	return t.current
}

// count adds one unsettled event to e.
func (t *tracker) count(e *txnEntry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e.pending++
	e.hasEvents = true
}

// markEvents makes e count as a transaction with events, so that the
// acknowledgement past it waits for a synchronous checkpoint, without an
// event to settle.
func (t *tracker) markEvents(e *txnEntry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e.hasEvents = true
}

// commit closes the open transaction at end (TransactionEndLSN).
func (t *tracker) commit(end LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.current == nil {
		t.entries = append(t.entries, &txnEntry{end: end, closed: true})
	} else {
		t.current.end = end
		t.current.closed = true
		t.current = nil
	}
	t.advanceLocked()
}

// keepalive queues a position with no events of its own.
func (t *tracker) keepalive(walEnd LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if n := len(t.entries); n > 0 && t.entries[n-1].closed && t.entries[n-1].pending == 0 && t.current == nil {
		// Coalesce: a run of keepalives needs one entry, not one each.
		if walEnd > t.entries[n-1].end {
			t.entries[n-1].end = walEnd
		}
	} else {
		t.entries = append(t.entries, &txnEntry{end: walEnd, closed: true})
	}
	t.advanceLocked()
}

// done settles one event of entry e (of this session or an earlier one).
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

// reset forgets every position: the next connection starts from the slot's
// confirmed position, which the server, not we, knows. Entries of the
// previous session that are still counted are dropped from the list; done
// on them changes nothing any more.
func (t *tracker) reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.entries = nil
	t.current = nil
	t.settled = 0
	t.passed = false
}
