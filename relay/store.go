package relay

import (
	"context"
	"time"
)

// LedgerKey names one (event, sink) pair: the ledger's unique key.
type LedgerKey struct {
	EventKey string
	Action   string // the sink's name
}

// HandOff gives a row to the claim path: the row stays pending, marked with
// handoff_at, due at AvailableAt.
type HandOff struct {
	ID          int64
	AvailableAt time.Time
	LastError   string
	// Attempts is how many attempts the stream made that count against
	// max_attempts (sink-level failures and open circuits do not count).
	Attempts int
}

// DeadLetter fails a row for good: status failed, with the reason.
type DeadLetter struct {
	ID        int64
	LastError string
}

// Settlement is a batch of stream outcomes written in one transaction.
type Settlement struct {
	Delivered   []LedgerKey
	HandOffs    []HandOff
	DeadLetters []DeadLetter
}

// RowState is what the database says about a re-streamed row.
type RowState struct {
	// Owned is true while the row is still the stream's: pending and not
	// handed off. A row that is not owned is skipped by the stream.
	Owned bool
	// Delivered lists the sinks the ledger shows delivered.
	Delivered []string
}

// Store is the stream path's view of the outbox table and the ledger.
// Implementations are safe for concurrent use.
type Store interface {
	// Settle writes s in one transaction: insert-only delivered ledger rows
	// (a pair already present is left alone), hand-offs and dead letters,
	// each conditional on the row still being pending. It may commit
	// asynchronously (synchronous_commit = off); the synchronous checkpoint
	// written before each acknowledgement makes it durable. Safe to repeat.
	//
	// It returns the ids of hand-offs and dead letters whose row it cannot
	// see yet: the walsender may send a transaction before the committing
	// backend has left the proc array, so a fast delivery can settle an
	// event whose row is not yet visible to other sessions. The caller
	// settles those again shortly.
	Settle(ctx context.Context, s Settlement) (invisible []int64, err error)

	// Restreamed returns the state of the rows with these ids, in one query,
	// for events the slot may be sending again after a restart. Rows missing
	// from the table are absent from the map.
	Restreamed(ctx context.Context, events []*Event) (map[int64]RowState, error)

	// MarkDone sets status done on rows that are still pending and owned by
	// the stream. Off the acknowledgement path; safe to repeat. Like Settle,
	// it returns the ids whose row it cannot see yet.
	MarkDone(ctx context.Context, ids []int64) (invisible []int64, err error)

	// Diverted returns the aggregates that have a handed-off or held row not
	// yet settled; the stream hands their later events off too.
	Diverted(ctx context.Context) ([]AggregateKey, error)
}

// HoldStore is what a sink with on_unknown: hold needs: a claim committed
// before each send, so that an unknown outcome (or a crash) is never sent
// twice, and the held state for a person to resolve.
type HoldStore interface {
	// ClaimSending claims key for owner; false means the pair is delivered
	// or already claimed (by another owner, or before a crash): do not send.
	ClaimSending(ctx context.Context, key LedgerKey, owner string) (bool, error)
	// Release withdraws owner's claim after a send known not to have
	// happened.
	Release(ctx context.Context, key LedgerKey, owner string) error
	// Hold marks the pair unknown and the row held, with reason.
	Hold(ctx context.Context, id int64, key LedgerKey, reason string) error
}

// Checkpoint persists the confirmed position of a slot.
type Checkpoint interface {
	// LoadCheckpoint returns the last saved position, or 0 when none.
	LoadCheckpoint(ctx context.Context, slot string) (LSN, error)
	// SaveCheckpoint writes lsn with a synchronous commit, which also makes
	// every earlier asynchronous commit of the session's server durable.
	SaveCheckpoint(ctx context.Context, slot string, lsn LSN) error
}

// Consumer is what a source feeds. Submit, Commit and Keepalive are called
// from one goroutine, in stream order; Settled may be called concurrently
// with them (acknowledgements keep flowing while Submit blocks).
type Consumer interface {
	// Submit hands over events of the transaction being decoded, in order.
	// It blocks while the engine applies back-pressure, and returns early
	// only with ctx's error.
	Submit(ctx context.Context, events []*Event) error
	// Commit closes the transaction whose events were submitted since the
	// last Commit; endLSN is its TransactionEndLSN. A transaction with no
	// events may be committed too.
	Commit(endLSN LSN)
	// Keepalive reports a server WAL position with nothing before it still
	// unsent; it becomes settled once every earlier event is.
	Keepalive(walEnd LSN)
	// Settled returns the highest position whose every earlier event is
	// settled, and whether that position passes a transaction with events
	// since the previous call that returned passed == true.
	Settled() (lsn LSN, passedEvents bool)
	// Restart is called when the stream restarts (a new connection): it
	// waits until everything submitted is settled, forgets all positions,
	// and treats events committed before horizon (the server's WAL position
	// at connect time) as possibly seen before.
	Restart(ctx context.Context, horizon LSN) error
}
