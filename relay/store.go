package relay

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// LedgerKey names one (event, sink) pair: the ledger's unique key.
type LedgerKey struct {
	EventKey string
	Action   string // the sink's name
}

// PairState is what the database says about an (event, sink) pair before it
// is sent; a store's Prepare sets it.
type PairState int

const (
	// PairSend: send it.
	PairSend PairState = iota
	// PairDelivered: the ledger shows it delivered; it is not sent again.
	PairDelivered
	// PairBlocked: another owner holds a live claim to send it (claim path):
	// it is not sent now and the event is tried again later.
	PairBlocked
	// PairUnknown: a claim to send it was made before and its outcome is
	// unknown (a crash, or a lease taken over). A sink that holds unknown
	// outcomes holds it without sending; another sends it again with the
	// same id and body.
	PairUnknown
)

// Pair is one (event, sink) of a Work.
type Pair struct {
	Sink string
	// Hold is the sink's on_unknown: hold: the pair is claimed in the ledger
	// before it is sent, and an unknown outcome is held, never sent again.
	Hold bool
	// State and PrevOwner are set by Prepare; PrevOwner names the owner of
	// a claim that was taken over (PairUnknown), when known.
	State     PairState
	PrevOwner string
	// Claimed is set by Prepare when the store holds this relay's 'sending'
	// claim on the pair; Settle turns it into delivered or unknown, or
	// withdraws it.
	Claimed bool
	// Outcome is set by the engine once the pair is done.
	Outcome Outcome
	// refused is the error of the sink's filter on the event (Takes): the
	// pair fails unsent (docs/sinks.md, "Filters").
	refused string
}

// Path names where a Work came from: the stream (PathStream) or the claim
// path (PathClaim). It is the path label of the metrics.
type Path string

// The paths; metric label values.
const (
	PathStream Path = "stream"
	PathClaim  Path = "claim"
)

// Work is one event on its way through the engine. A store reads it in
// Prepare (before anything is sent) and writes it in Settle (once every
// routed sink has an outcome).
type Work struct {
	Event *Event
	// Replay is 0 for a normal delivery and n for the n-th operator replay
	// (claim path).
	Replay int
	// Pairs has one entry per sink the event is routed to, in route order.
	Pairs []*Pair
	// Skip is set by Prepare (stream path) when the row is no longer the
	// stream's: settled, diverted or claimed before a restart.
	Skip bool
	// Decision is set by the engine before Settle.
	Decision Decision

	path Path
	// handOver: a row of a new slot's hand-over, read from the table
	// (Consumer.HandOver): on the stream path, ahead of every streamed
	// event of its aggregate, acknowledging no slot position.
	handOver bool
	// size is what the engine counts of the event against its byte budget
	// (Event.Size), set when it is routed.
	size  int64
	lanes []*lane   // the lane of each pair
	run   *claimRun // the claimed run it belongs to, if any
	// ClaimedAt is when the claim path's lease on the row began, at the
	// latest: the store's Claim sets it to a moment before its statement
	// (zero: SubmitClaimed's time). The engine sends a claimed row only
	// while the lease, from then or the last renewal, has not passed.
	ClaimedAt time.Time
	remaining atomic.Int32
	// tickets are the stream transactions waiting for this event to settle
	// (more than one when the slot sent it again while it was in flight);
	// guarded by Engine.mu.
	tickets                 []*txnEntry
	envelopeOnce, nudgeOnce sync.Once
	envelope, nudge         []byte
	// settling state, owned by the settle loop
	invisibleSince time.Time
	dataErrors     int
	// refused says why the ledger cannot record the event's deliveries:
	// it has no pairs and is dead-lettered unsent (refuse.go).
	refused string
}

// Path returns where the work came from.
func (w *Work) Path() Path { return w.path }

// ErrRowData marks a store error caused by one row's data (a value
// PostgreSQL refuses, a key longer than an index holds), not by the
// connection or the server: the engine then prepares or settles the rows
// of the batch apart, so that one row never holds the others back.
var ErrRowData = errors.New("a row's data was refused")

// StreamStore is the stream path's view of the outbox table and the ledger.
// Implementations are safe for concurrent use.
type StreamStore interface {
	// PrepareStream reads what the database knows about works before they
	// are sent, one statement per kind for the batch. When restreamed is
	// true the slot may be sending them again after a restart: a row that
	// is no longer pending and not diverted is marked Skip, and pairs the
	// ledger shows delivered become PairDelivered. Pairs of Hold sinks are
	// claimed for owner ('sending', committed synchronously): Claimed, or
	// PairDelivered, or PairUnknown when another claim is there. An error
	// wrapping ErrRowData names a row's data as the cause. Safe to repeat.
	PrepareStream(ctx context.Context, works []*Work, restreamed bool, owner string) error

	// SettleStream writes the works' decisions in one transaction: a
	// delivered ledger row for each delivered pair (insert-only; the record
	// of each delivery), and each row's status — Done as status done, Later
	// as a diversion to the claim path (handoff_at, available_at, attempts,
	// last_error), DeadLetter as status failed, Hold as status held with the
	// pair 'unknown'; claims of pairs not sent are withdrawn. The status is
	// the row's one state: written with the pairs, never after them. Every
	// row change is conditional on the row still being the stream's
	// (pending, not diverted); a row no longer the stream's is left to its
	// new owner. It may
	// commit asynchronously: the synchronous checkpoint written before each
	// acknowledgement makes it durable. It returns the ids of rows it could
	// not see: the walsender may send a transaction before its rows are
	// visible to other sessions; the engine settles those again. An error
	// wrapping ErrRowData names a row's data as the cause. Safe to repeat.
	SettleStream(ctx context.Context, works []*Work, owner string) (invisible []int64, err error)

	// Gone returns, of works whose row a settlement (SettleStream,
	// SettleClaim) could not see, the ids of rows that were deleted: the
	// insert is visible and the row is not there. A row read from the
	// table (Event.Xid 0: a hand-over's, a claimed one) was visible when
	// read; a streamed row's inserting transaction (Event.Xid) is checked.
	// Those are settled without a write; the others wait to become
	// visible. It only reads.
	Gone(ctx context.Context, works []*Work) ([]int64, error)

	// Diverted returns the aggregates with a row at the claim path (diverted
	// and not settled) or held: the stream diverts their later events
	// too.
	Diverted(ctx context.Context) ([]AggregateKey, error)
}

// ClaimQuery says which rows Claim takes.
type ClaimQuery struct {
	// All claims every due pending row (poll mode); otherwise only rows
	// diverted to the claim path.
	All bool
	// Limit is the most rows one claim takes.
	Limit int
	// MaxBytes, when positive, is the most payload bytes one claim takes
	// (Engine.ReadBytes); a first row larger than it is taken alone.
	MaxBytes int64
	// Owner names this relay in locked_by.
	Owner string
	// DueSince, when set (replication mode), claims only runs of
	// aggregates with rows due since then, newest first: what a claim path
	// yielding to a lagging stream still takes (docs/architecture.md, "The
	// claim path yields to a lagging stream").
	DueSince time.Time
}

// Full reports whether works, what one claim under q took, are all that
// claim may take: Limit rows, or payloads of at least half MaxBytes — a
// claim cut by its bytes takes that much, unless the row it stopped before
// is larger than half of them alone. The claim path claims again at once
// after a full claim; it waits for a settlement or its poll interval
// otherwise.
func (q ClaimQuery) Full(works []*Work) bool {
	return len(works) >= q.Limit || q.MaxBytes > 0 && PayloadBytes(works) >= q.MaxBytes/2
}

// PayloadBytes is the bytes of the works' payloads.
func PayloadBytes(works []*Work) int64 {
	var n int64
	for _, w := range works {
		n += int64(len(w.Event.Payload))
	}
	return n
}

// ClaimStore is the claim path's view of the outbox table and the ledger.
// Implementations are safe for concurrent use.
type ClaimStore interface {
	// Claim takes up to q.Limit due rows, oldest first, skipping rows
	// locked by others and rows that must wait for an earlier event of
	// their aggregate (unless ordering is off), and marks them processing,
	// locked by q.Owner. A row with a NULL available_at is due. It takes
	// runs: several consecutive rows of one aggregate when none of them
	// must wait for another (docs/guarantees.md, "Claim runs"); the works
	// come back in id order, so that each aggregate's rows reach its lane
	// in order.
	Claim(ctx context.Context, q ClaimQuery) ([]*Work, error)

	// PrepareClaim claims the works' pairs in the ledger for owner before
	// anything is sent, in one round trip: pairs already delivered become
	// PairDelivered, pairs another live owner is sending PairBlocked, pairs
	// whose claim it took over (lease passed, owner gone) PairUnknown with
	// PrevOwner; the rest are Claimed. lease is the claim's lease. An error
	// wrapping ErrRowData names a row's data as the cause; an error leaves
	// no claim made.
	PrepareClaim(ctx context.Context, works []*Work, owner string, lease time.Duration) error

	// SettleClaim writes the works' decisions in one synchronous
	// transaction, each change conditional on the row being processing and
	// locked by owner, or the ledger claim being owner's: Done as status
	// done, Later back to pending at Decision.At, DeadLetter as failed, Hold
	// as held; delivered pairs, unknown pairs and withdrawn claims in the
	// ledger. It returns the ids of rows it could not find (deleted since
	// they were claimed), which the engine settles as gone
	// (StreamStore.Gone). An error wrapping ErrRowData names a row's data
	// as the cause.
	SettleClaim(ctx context.Context, works []*Work, owner string) (invisible []int64, err error)

	// SettledAggregates returns those of aggs with no row left at the claim
	// path (diverted and not settled) or held: the stream may deliver
	// their events again.
	SettledAggregates(ctx context.Context, aggs []AggregateKey) ([]AggregateKey, error)

	// ExtendLeases renews owner's lease on the processing rows ids and on
	// its 'sending' claims of their pairs, so that a slow delivery is not
	// taken over by another relay while it is being worked on.
	ExtendLeases(ctx context.Context, ids []int64, owner string) error
}

// Checkpoint persists the confirmed position of a slot.
type Checkpoint interface {
	// LoadCheckpoint returns the last saved position, or 0 when none.
	LoadCheckpoint(ctx context.Context, slot string) (LSN, error)
	// SaveCheckpoint writes lsn with a synchronous commit, which also makes
	// every earlier asynchronous commit of the session's server durable.
	SaveCheckpoint(ctx context.Context, slot string, lsn LSN) error
}

// HandOverRows is a new slot's hand-over in progress (docs/architecture.md,
// "Slot creation"): the rows pending in the slot's exported snapshot, read
// in a transaction that imported it, so that the replication connection is
// free to stream while they are delivered.
type HandOverRows interface {
	// Aggregates returns the aggregates of the rows to hand over: the
	// stream diverts their events (Consumer.Divert) until their rows are
	// fed. The first call reads the rows in the snapshot and lets the
	// snapshot go; it may run while the slot streams.
	Aggregates(ctx context.Context) ([]AggregateKey, error)
	// Len returns how many rows there are to hand over, once Aggregates
	// has read them.
	Len() int
	// Pending returns those of aggs that have rows to hand over. It may
	// be called while Aggregates reads (the stream asks it for its first
	// events' aggregates, to deliver those with none at once), and from
	// another goroutine.
	Pending(ctx context.Context, aggs []AggregateKey) ([]AggregateKey, error)
	// NewestUnblocked returns, for the caller to feed before the read (Aggregates),
	// the newest rows whose aggregates have no other row to hand over (and
	// rows without an aggregate), and those aggregates; Deliver leaves the
	// rows out and counts them. It returns nothing once the read is done.
	NewestUnblocked(ctx context.Context) ([]*Event, []AggregateKey, error)
	// Deliver reads the rows again, a slice at a time, and gives them to
	// feed (Consumer.HandOver), each aggregate's in id order; rows no
	// longer pending, or diverted, since the snapshot are left out. After each slice it calls fed with the
	// aggregates whose every row is now fed. Once every slice is fed it
	// waits for settled (Consumer.HandOverSettled), then records the
	// hand-over of slot as done at consistent, and returns how many rows
	// it fed. An error, or ctx's end, leaves the record unwritten: the
	// next session makes the slot again, and hands over what is still
	// pending then.
	Deliver(ctx context.Context, slot string, consistent LSN, feed func(context.Context, []*Event) error, fed func([]AggregateKey), settled func(context.Context) error) (int64, error)
	// Close lets the hand-over go; safe after Deliver and twice.
	Close()
}

// Consumer is what the stream source feeds. Submit, Commit and Keepalive
// are called from one goroutine, in stream order; Settled may be called
// concurrently with them (acknowledgements keep flowing while Submit
// blocks).
type Consumer interface {
	// Submit hands over events of the transaction being decoded, in order.
	// It blocks while the engine applies back-pressure, and returns early
	// only with ctx's error; events it did not take are not counted, and
	// the slot will send them again. The events are the consumer's to
	// keep; the slice is not: the stream reuses it.
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
	// forgets all positions and treats events committed before horizon (the
	// server's WAL position at connect time) as possibly seen before. It
	// does not wait for events still in flight: an event the slot sends
	// again while it is in flight joins it instead of being sent twice.
	Restart(ctx context.Context, horizon LSN) error
	// Sent reports, for the transaction whose Commit the source has just
	// received, how long after its commit the walsender sent it (both
	// times by the server's clock): how far behind the walsender's
	// decoding is. It may be called concurrently with the others.
	Sent(lag time.Duration)
	// Divert sends the streamed events of aggs to the claim path until
	// release is called with the aggregate: the aggregates of a new slot's
	// hand-over, whose rows (committed before the slot) are being given to
	// HandOver while the slot streams (docs/architecture.md, "Slot
	// creation"). An aggregate is released once HandOver has queued its
	// last row: its later streamed events queue behind them. Called before
	// the first Submit of a session; releasing an aggregate twice is
	// harmless.
	Divert(aggs []AggregateKey) (release func([]AggregateKey))
	// HandOver takes rows of a new slot's hand-over, read from the table:
	// they are delivered like streamed events — checked against the ledger
	// first, settled in the stream's batches, diverted to the claim path
	// when they cannot be delivered — but acknowledge no slot position,
	// and go into their lanes even while their aggregate is diverted by
	// Divert's pin. Each aggregate's rows come in id order. It blocks
	// while HandOverWindow of them are unsettled, so that streamed events
	// never queue behind more; it may be called concurrently with Submit.
	HandOver(ctx context.Context, events []*Event) error
	// HandOverSettled waits until every row given to HandOver is settled
	// (delivered and recorded, or diverted to the claim path), or ctx ends,
	// or the engine stops (ErrEngineStopped), or none of them settled for
	// the engine's StallAfter: then it returns an error naming some.
	HandOverSettled(ctx context.Context) error
}

// Lock is a held session lock on a dedicated connection (an owner or leader
// lock).
type Lock interface {
	// Ping checks that the connection, and with it the lock, is alive.
	Ping(ctx context.Context) error
	// Release unlocks and closes the connection.
	Release()
}

// ErrLockTaken is returned (wrapped) when another live session holds a lock.
var ErrLockTaken = errors.New("lock is held by another session")

// Lease is a row whose lease passed, or whose owner is gone, returned to
// pending.
type Lease struct {
	ID       int64
	OldOwner string
}
