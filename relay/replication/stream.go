package replication

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/outbox-relay/outbox-relay/relay"
)

// How a session runs
//
// pgconn.PgConn is not safe for concurrent use, and Consumer.Submit blocks
// for as long as the engine applies back-pressure, yet standby status updates
// must keep reaching the server (at least every wal_sender_timeout/3, and
// carrying whatever the engine settles meanwhile). A session therefore runs
// two goroutines joined by a bounded channel:
//
//   - The receiver (the session's own goroutine) owns the connection: it is
//     the only goroutine that reads from it or writes to it, so no lock is
//     needed. It reads until the next status time (a read deadline on the
//     connection, readDeadline), parses each message (parseItem copies what
//     it keeps out of pgconn's read buffer) and queues it, keepalive positions
//     included, on the channel: a transaction's messages go together once
//     its Commit is read (or flushLen of them, in a large one), so that
//     the decoder wakes once per transaction rather than once per message
//     (docs/performance.md, "Between goroutines"). When a status update is due it asks
//     Consumer.Settled for the position, writes the checkpoint when the
//     acknowledgement passes events, and sends the update. When the queue
//     is full (queueLen messages or queueBytes of pgoutput data) it waits
//     for the decoder to take a group and for the status timer together, so
//     acknowledgements keep flowing while the engine pushes back; it stops
//     reading meanwhile, and TCP flow control pauses the walsender, which
//     still reads our status updates.
//
//   - The decoder owns the stream's state (relations, the open transaction,
//     the batch being built) and is the only goroutine that calls Submit,
//     Commit and Keepalive, so they reach the consumer in stream order. A
//     keepalive travels through the same channel as the data read before
//     it: it is reported only after every earlier event was submitted, which
//     is what makes "nothing before it still unsent" true.
//
// Consumer.Settled is thus called concurrently with Submit, Commit and
// Keepalive. A failure on either side cancels the session's context, which
// ends the other: a blocked Submit returns with the context's error, and a
// pending read returns at once.
//
// The alternative, a status goroutine writing under a mutex while another
// goroutine reads, does not fit pgconn: it interrupts an operation under a
// context by setting a deadline on the whole net.Conn, which would also fail
// a status update being written at that moment, and a mutex held across a
// read would delay the update until the read's deadline anyway.

// queueLen and queueBytes bound the messages read but not yet decoded: with
// one message per row, about four batches of small events, and less of large
// ones. A single group larger than queueBytes is still admitted, alone.
const (
	queueLen   = 1024
	queueBytes = 8 << 20
)

// flushLen and flushBytes bound the messages of an open transaction the
// receiver holds before it queues them: a large transaction's events reach
// the decoder while the rest is read.
const (
	flushLen   = 64
	flushBytes = 256 << 10
)

// maxSaveTimeout bounds a checkpoint write. A slower write is abandoned: the
// acknowledgement waits, and the status update still goes out.
const maxSaveTimeout = 10 * time.Second

// streamItem is one message of the stream, in order: a transaction's Begin
// or Commit, read into the item itself; an Insert, its tuple copied; another
// pgoutput message; or a keepalive's WAL position (parseItem).
type streamItem struct {
	kind itemKind
	msg  pglogrepl.Message // itemMessage
	// lsn is a Begin's final LSN (its commit record), a Commit's
	// transaction end LSN, or a keepalive's WAL end.
	lsn  relay.LSN
	time time.Time // the commit time, of a Begin or a Commit
	xid  uint32    // a Begin's transaction id
	// rel and tuple are an Insert's relation id and its TupleData, copied
	// out of pgconn's read buffer.
	rel   uint32
	tuple []byte
	size  int64 // bytes of pgoutput data, counted against queueBytes
}

// itemKind says what a streamItem holds.
type itemKind uint8

const (
	itemKeepalive itemKind = iota
	itemBegin
	itemCommit
	itemInsert
	itemMessage
)

// group is stream items queued together, in order, with their pgoutput
// bytes.
type group struct {
	items []streamItem
	size  int64
}

// queue carries groups of stream items from the receiver to the decoder.
type queue struct {
	groups chan *group
	msgs   atomic.Int64 // items queued, against queueLen
	bytes  atomic.Int64 // their bytes, against queueBytes
	// taken is signalled, without blocking, each time the decoder takes a
	// group, to wake a receiver waiting for room.
	taken chan struct{}
	// free returns decoded groups to the receiver for reuse.
	free chan *group
}

func newQueue() *queue {
	return &queue{groups: make(chan *group, queueLen), taken: make(chan struct{}, 1), free: make(chan *group, 8)}
}

// tryPut queues g if there is room: a group always fits an empty queue.
func (q *queue) tryPut(g *group) bool {
	n, b := q.msgs.Load(), q.bytes.Load()
	if n > 0 && (n+int64(len(g.items)) > queueLen || b+g.size > queueBytes) {
		return false
	}
	q.msgs.Add(int64(len(g.items)))
	q.bytes.Add(g.size)
	select {
	case q.groups <- g:
		return true
	default:
		q.msgs.Add(-int64(len(g.items)))
		q.bytes.Add(-g.size)
		return false
	}
}

// get waits for the next group.
func (q *queue) get(ctx context.Context) (*group, error) {
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case g := <-q.groups:
		q.msgs.Add(-int64(len(g.items)))
		q.bytes.Add(-g.size)
		select {
		case q.taken <- struct{}{}:
		default:
		}
		return g, nil
	}
}

// release hands a decoded group back for reuse.
func (q *queue) release(g *group) {
	clear(g.items)
	g.items, g.size = g.items[:0], 0
	select {
	case q.free <- g:
	default:
	}
}

// newGroup returns an empty group, reused when one is free.
func (q *queue) newGroup() *group {
	select {
	case g := <-q.free:
		return g
	default:
		return &group{items: make([]streamItem, 0, 4)}
	}
}

// stream runs the receiver and the decoder on conn, which is in copy-both
// mode, until either fails or ctx is done. acked is the slot's confirmed
// position; every is the status interval.
func (s *Source) stream(ctx context.Context, conn *pgconn.PgConn, acked relay.LSN, every, senderTimeout time.Duration, onStandby bool, handOver *handOver) error {
	// The decoder and the checkpointer run beside the receiver (relay.Group):
	// one that fails, or returns, ends the session. So does a new slot's
	// hand-over that fails; one that finishes does not.
	workers, sctx := relay.NewGroup(ctx)
	q := newQueue()
	consumer := s.cfg.Consumer
	if handOver != nil {
		consumer = &handOverGate{Consumer: consumer, h: handOver, clear: map[relay.AggregateKey]bool{}}
	}
	workers.Go("decoder", func(ctx context.Context) error { return newDecoder(consumer, s.outbox).run(ctx, q) })
	if handOver != nil {
		workers.GoTask("hand-over", func(ctx context.Context) error { return s.deliverHandOver(ctx, handOver) })
	}

	saveTimeout := maxSaveTimeout
	if senderTimeout > 0 {
		saveTimeout = min(saveTimeout, senderTimeout/3)
	}
	r := &receiver{s: s, conn: conn, queue: q, every: every, saveTimeout: saveTimeout, acked: acked, published: acked, stop: workers.Cancel,
		silentMax: silentLimit(senderTimeout), idleSilentMax: 5*time.Second + 3*every, lastHeard: time.Now(), onStandby: onStandby}
	defer r.closeStandbyConn()
	r.ackable.Store(uint64(acked))
	raise(&s.acknowledged, acked)
	workers.Go("checkpointer", func(ctx context.Context) error { r.checkpointLoop(ctx); return nil })
	recvErr := r.run(sctx)
	workersErr := workers.Stop()

	if changed := r.serverChanged.Load(); changed != nil {
		return *changed
	}
	if ctx.Err() != nil {
		if !conn.IsClosed() {
			r.finalStatus()
		}
		return ctx.Err()
	}
	if workersErr != nil {
		return workersErr
	}
	return recvErr
}

// receiver owns the replication connection; see "How a session runs".
type receiver struct {
	s           *Source
	conn        *pgconn.PgConn
	queue       *queue
	every       time.Duration
	saveTimeout time.Duration

	inTxn   bool      // the last data message read was inside a transaction
	blocked bool      // waiting for room in the queue
	pending *group    // read and not queued yet: the open transaction's messages
	next    time.Time // when the next status update is due

	acked relay.LSN // last position sent to the server

	// A connection whose network swallows packets stays open and silent:
	// the receiver ends it when the server has said nothing for silentMax
	// (mid-transaction, when the walsender may be decoding WAL it does not
	// send), or for idleSilentMax between transactions, where every status
	// update asks the server for an immediate reply (docs/operations.md,
	// "timeouts").
	lastHeard     time.Time
	silentMax     time.Duration
	idleSilentMax time.Duration

	// The checkpointer (its own goroutine) decides what may be
	// acknowledged and publishes it in ackable; the receiver only reads it.
	// A checkpoint is a synchronous commit — milliseconds to far more on a
	// busy primary — and the receiver must never stop reading the stream
	// for one: that stalled every event behind it.
	ackable        atomic.Uint64
	published      relay.LSN // checkpointer: last position stored in ackable
	mustCheckpoint bool      // checkpointer: settled passed events not yet covered by a checkpoint
	saveFailing    bool      // checkpointer: the last checkpoint write failed (logged once)

	// serverChanged is set when the checkpoint was refused because the
	// server the relay writes to is not the one it streams from (a
	// promotion the stream has not seen, or two primaries): the session
	// ends with it, and the term with the session (docs/failover.md).
	serverChanged atomic.Pointer[error]
	stop          context.CancelFunc // ends the session

	// onStandby: the session streams from a standby (Config.Primary). The
	// checkpointer then waits for the standby to receive each checkpoint
	// before acknowledging past events (waitStandbyReceived), on a
	// connection of its own; receiveSlow says it warned.
	onStandby   bool
	standbyConn *pgx.Conn
	receiveSlow bool
}

// checkpointLoop publishes the position the receiver may acknowledge, every
// status interval, until ctx is done.
func (r *receiver) checkpointLoop(ctx context.Context) {
	tick := time.NewTicker(r.every)
	defer tick.Stop()
	for {
		r.publish(ctx)
		if r.serverChanged.Load() != nil {
			r.stop()
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// publish runs position and stores its answer for the receiver.
func (r *receiver) publish(ctx context.Context) {
	if pos := r.position(ctx); pos > r.published {
		r.published = pos
		r.ackable.Store(uint64(pos))
	}
}

func (r *receiver) run(ctx context.Context) error {
	dl := &readDeadline{conn: r.conn.Conn()}
	// AfterFunc forwards the session's end to the read, not a worker:
	// interrupt sets a deadline and returns, and does nothing once clear
	// has run.
	stopWatch := context.AfterFunc(ctx, dl.interrupt)
	defer func() {
		stopWatch()
		dl.clear()
	}()
	// The first update goes out at once: it asks for the server's position.
	r.next = time.Now()
	for {
		if !time.Now().Before(r.next) {
			if err := r.sendStatus(ctx); err != nil {
				return err
			}
		}
		dl.set(r.next)
		// context.Background: the read is interrupted by dl, not by a
		// context pgconn would watch for every message.
		msg, err := r.conn.ReceiveMessage(context.Background())
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if pgconn.Timeout(err) {
				// A status update is due. Unless the server has been silent
				// too long, the connection is intact.
				limit := r.silentMax
				if !r.inTxn {
					limit = min(limit, r.idleSilentMax)
				}
				if silent := time.Since(r.lastHeard); silent > limit {
					return fmt.Errorf("receive: no message from the server for %s: the connection is presumed dead", silent.Round(time.Millisecond))
				}
				continue
			}
			return fmt.Errorf("receive: %w", err)
		}
		r.lastHeard = time.Now()
		if err := r.handle(ctx, msg); err != nil {
			return err
		}
	}
}

// silentLimit is how long the server may say nothing mid-transaction: its
// own wal_sender_timeout (it sends a keepalive at half of it at the latest),
// or 60 s when that is off.
func silentLimit(senderTimeout time.Duration) time.Duration {
	if senderTimeout <= 0 {
		return time.Minute
	}
	return max(senderTimeout, 10*time.Second)
}

// readDeadline ends the receiver's reads at the next status time, and at once
// when the session ends, through the connection's read deadline: set once
// per status period, where a read under a context costs pgconn a context
// watch per message (an AfterFunc and a channel, three allocations;
// docs/performance.md, "Between goroutines"). A read that times out leaves the
// connection intact: pgconn keeps what it had read of a message. The mutex
// keeps set from undoing interrupt.
type readDeadline struct {
	mu          sync.Mutex
	conn        net.Conn
	at          time.Time
	interrupted bool
	cleared     bool
}

// set makes reads end at at, unless the session has ended.
func (d *readDeadline) set(at time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.interrupted || at.Equal(d.at) {
		return
	}
	d.at = at
	_ = d.conn.SetReadDeadline(at)
}

// interrupt ends the pending read and every later one.
func (d *readDeadline) interrupt() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cleared {
		return
	}
	d.interrupted = true
	_ = d.conn.SetReadDeadline(time.Unix(1, 0))
}

// clear leaves the connection without a read deadline, for whatever reads
// it after the session; set and interrupt do nothing after it.
func (d *readDeadline) clear() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.interrupted, d.cleared = true, true
	_ = d.conn.SetReadDeadline(time.Time{})
}

func (r *receiver) handle(ctx context.Context, msg pgproto3.BackendMessage) error {
	switch msg := msg.(type) {
	case *pgproto3.CopyData:
		if len(msg.Data) == 0 {
			return errors.New("receive: empty CopyData message")
		}
		switch msg.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
			if err != nil {
				return fmt.Errorf("parse keepalive: %w", err)
			}
			// Inside a transaction the position is useless: its Commit
			// will report a later one.
			if !r.inTxn {
				if err := r.push(ctx, streamItem{kind: itemKeepalive, lsn: relay.LSN(pkm.ServerWALEnd)}); err != nil {
					return err
				}
			}
			if pkm.ReplyRequested {
				return r.sendStatus(ctx)
			}
		case pglogrepl.XLogDataByteID:
			xld, err := pglogrepl.ParseXLogData(msg.Data[1:])
			if err != nil {
				return fmt.Errorf("parse XLogData: %w", err)
			}
			if len(xld.WALData) == 0 {
				return fmt.Errorf("empty XLogData at %s", relay.LSN(xld.WALStart))
			}
			raise(&r.s.received, relay.LSN(xld.WALStart))
			it, err := parseItem(xld.WALData)
			if err != nil {
				return fmt.Errorf("parse pgoutput message %q at %s: %w", xld.WALData[0], relay.LSN(xld.WALStart), err)
			}
			switch it.kind {
			case itemBegin:
				r.inTxn = true
			case itemCommit:
				r.inTxn = false
				if !it.time.IsZero() && !xld.ServerTime.IsZero() {
					lag := max(xld.ServerTime.Sub(it.time), 0)
					relay.WalSenderLag.Observe(lag.Seconds())
					r.s.cfg.Consumer.Sent(lag)
				}
			}
			return r.push(ctx, it)
		}
	case *pgproto3.ErrorResponse:
		return fmt.Errorf("receive: %w", pgconn.ErrorResponseToPgError(msg))
	case *pgproto3.CopyDone:
		return errors.New("receive: the server ended the replication stream")
	}
	return nil
}

// push adds it to the pending group and queues the group for the decoder
// once no transaction is open (it is a Commit, a keepalive, or a message
// outside a transaction) or the group is flushLen messages or flushBytes.
func (r *receiver) push(ctx context.Context, it streamItem) error {
	if r.pending == nil {
		r.pending = r.queue.newGroup()
	}
	g := r.pending
	g.items = append(g.items, it)
	g.size += it.size
	if r.inTxn && len(g.items) < flushLen && g.size < flushBytes {
		return nil
	}
	r.pending = nil
	return r.put(ctx, g)
}

// put queues g for the decoder, sending status updates on time while the
// queue is full.
func (r *receiver) put(ctx context.Context, g *group) error {
	if r.queue.tryPut(g) {
		return nil
	}
	r.blocked = true
	defer func() {
		r.blocked = false
		// Not reading was our own doing, not the server's silence.
		r.lastHeard = time.Now()
	}()
	for {
		t := time.NewTimer(time.Until(r.next))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-r.queue.taken:
			t.Stop()
		case <-t.C:
			if err := r.sendStatus(ctx); err != nil {
				return err
			}
		}
		if r.queue.tryPut(g) {
			return nil
		}
	}
}

// sendStatus acknowledges the settled position and schedules the next update.
// When the stream is idle it asks the server to answer at once with a
// keepalive: that keepalive carries the walsender's position, which lets the
// slot advance past WAL of other tables while the outbox is quiet.
func (r *receiver) sendStatus(ctx context.Context) error {
	pos := max(relay.LSN(r.ackable.Load()), r.acked)
	err := pglogrepl.SendStandbyStatusUpdate(ctx, r.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: pglogrepl.LSN(pos),
		WALFlushPosition: pglogrepl.LSN(pos),
		WALApplyPosition: pglogrepl.LSN(pos),
		ClientTime:       time.Now(),
		ReplyRequested:   !r.inTxn && !r.blocked,
	})
	if err != nil {
		return fmt.Errorf("send standby status: %w", err)
	}
	if pos > r.acked {
		r.s.log.Trace().Str("lsn", pos.String()).Msg("acknowledged")
		r.acked = pos
		raise(&r.s.acknowledged, pos)
	}
	r.next = time.Now().Add(r.every)
	return nil
}

// position returns the position to acknowledge: the consumer's settled
// position, except that a position passing events is acknowledged only after
// a checkpoint at or beyond it was written (synchronously), and stays at the
// last acknowledgement while that write fails. Advances through keepalives
// alone rewrite the checkpoint at most once per CheckpointEvery.
func (r *receiver) position(ctx context.Context) relay.LSN {
	s := r.s
	settled, passed := s.cfg.Consumer.Settled()
	if passed {
		r.mustCheckpoint = true
	}
	target := max(settled, r.published)
	switch {
	case r.mustCheckpoint:
		// Rewriting an equal or later checkpoint is still needed: the
		// synchronous write is what makes the events' asynchronous ledger
		// writes durable.
	case target > s.checkpointed && time.Since(s.checkpointAt) >= s.cfg.CheckpointEvery:
	default:
		return target
	}

	save := max(target, s.checkpointed)
	sctx, cancel := context.WithTimeout(ctx, r.saveTimeout)
	err := s.cfg.Checkpoint.SaveCheckpoint(sctx, s.cfg.Slot, save)
	cancel()
	if err != nil {
		if errors.Is(err, relay.ErrServerChanged) {
			r.serverChanged.CompareAndSwap(nil, &err)
		}
		if !r.saveFailing {
			s.log.Warn().Err(err).Str("lsn", save.String()).Msg("checkpoint write failed; the slot is not acknowledged past settled events until it succeeds")
			r.saveFailing = true
		}
		if r.mustCheckpoint {
			return r.published
		}
		s.checkpointAt = time.Now() // a keepalive-only rewrite waits for the next period
		return target
	}
	if r.saveFailing {
		s.log.Info().Str("lsn", save.String()).Msg("checkpoint write succeeded again")
		r.saveFailing = false
	}
	if r.onStandby && r.mustCheckpoint {
		r.waitStandbyReceived(ctx)
	}
	s.checkpointed = save
	s.checkpointAt = time.Now()
	r.mustCheckpoint = false
	return target
}

// finalStatus acknowledges, on the way out, what was settled by the time the
// stream stopped. It is best effort: the next start resumes from the slot.
func (r *receiver) finalStatus() {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	r.blocked = true // no reply wanted
	r.publish(ctx)   // the checkpointer has stopped: one last, synchronous round
	if err := r.sendStatus(ctx); err != nil {
		r.s.log.Debug().Err(err).Msg("final standby status update failed")
	}
}
