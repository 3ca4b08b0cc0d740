package webhook

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

var _ relay.Sink = (*Sink)(nil)

// ErrClosed is the cause of the SinkDownError a Send on a closed Sink
// reports.
var ErrClosed = errors.New("webhook sink closed")

const (
	// jwtLifetime is how long a per-request JWT is valid.
	jwtLifetime = 5 * time.Minute
	// maxRetryAfter caps a receiver's Retry-After.
	maxRetryAfter = time.Hour
	// headLimit is how much of an error response is read to classify it
	// and quote it; excerptLimit is how much of that is quoted.
	headLimit    = 4 << 10
	excerptLimit = 512
	// drainLimit is how much of a response body is read so its connection
	// can be reused; a longer body closes the connection instead.
	drainLimit = 64 << 10
	// idleConnTimeout is below Node.js's default 5 s keepAliveTimeout (n8n
	// runs on Node), so the relay does not reuse a connection the receiver
	// is about to close, which would turn the request's outcome unknown.
	idleConnTimeout = 4 * time.Second
	userAgent       = "outbox-relay"
)

// Sink posts deliveries to one webhook URL. It is safe for concurrent use.
type Sink struct {
	name      string
	url       string
	urlTmpl   *urlTemplate // url's {{ }} actions, rendered per event; nil: url as is
	ceSource  string       // ce-source; "" unless the format is cloudevents
	maxBody   int64
	permanent map[int]bool
	treat409  bool
	headers   http.Header
	auth      Auth
	signKeys  [][]byte // standard-webhooks: one signature each (rotation)
	log       zerolog.Logger

	transport *http.Transport
	client    *http.Client

	// slots holds one token per request in flight.
	slots chan struct{}
	// jobs feeds the workers that make the requests: long-lived goroutines,
	// whose stacks have grown to what net/http needs, instead of one new
	// goroutine per request. A job is queued only by a Send holding a slot
	// and holds it until a worker has taken it, so the buffer (Concurrency)
	// never fills.
	jobs chan job
	// workers runs the request workers (started as Sends need them, up to
	// Concurrency: started, guarded by mu) and, with batching, assemble,
	// from New to Close, which stops them once nothing is in flight. A
	// worker that fails (panics) stops them all (stopped is closed): the
	// sink is down from then on, naming the failure, and Close returns it.
	workers *relay.Group
	stopped <-chan struct{}
	started int
	// reqCtx is the parent of every request; Close cancels it when its
	// deadline passes with requests still in flight.
	reqCtx     context.Context
	cancelReqs context.CancelFunc

	// Batching (docs/sinks.md "Batched delivery"); pending is nil when it
	// is off. assemble owns the batch being gathered.
	batchMax     int
	batchWait    time.Duration
	batchOrdered bool
	pending      chan []batchItem // one event, or one run (SendRun)

	mu        sync.Mutex // guards closed, inflight and started
	closed    bool
	closing   chan struct{}
	closeOnce sync.Once
	// inflight counts the requests and batched events taken and not yet
	// answered (their done not called); drained is closed once the sink is
	// closed and it is zero.
	inflight int
	drained  chan struct{}

	// lastDown is why the last request that learnt anything about the
	// receiver found it down; nil once one got an answer that was not
	// (Down).
	lastDown atomic.Pointer[error]
}

// Name returns the sink's configured name.
func (s *Sink) Name() string { return s.name }

// Send posts d.Body (with format cloudevents, the event's payload and its
// attributes) and calls done exactly once with the outcome: nil on a
// 2xx (or a 409 with Treat409AsDelivered), otherwise an error classified by
// relay.Classify.
//
// Send blocks while Concurrency requests are in flight, until a slot frees,
// ctx is done, or the sink is closed. It calls done on the calling
// goroutine, without a request, when ctx is already done or ends while
// waiting (TransientError wrapping ctx's error), when the sink is closed
// (SinkDownError wrapping ErrClosed), when the body is over MaxBody, when
// the event key is empty (PermanentError, wrapping relay.ErrEmptyEventKey)
// and, with format cloudevents, when the event has no type (PermanentError,
// wrapping relay.ErrNoEventType).
// Otherwise the request runs on its own goroutine, which calls done; ctx no
// longer affects it (Close does).
//
// With batching on (Config.Batch), a Send that passes those checks queues
// the event for a batch request instead, blocking while the batch being
// gathered is full and every request slot is taken; done then gets the
// event's own outcome from the batch's answer (docs/sinks.md "Batched
// delivery").
//
// Sending the same Delivery again is safe: the id and body are the same.
func (s *Sink) Send(ctx context.Context, d *relay.Delivery, done func(error)) {
	if d.Event.EventKey == "" {
		done(relay.PermanentError(fmt.Errorf("webhook %s: event %d: %w", s.name, d.Event.ID, relay.ErrEmptyEventKey)))
		return
	}
	if err := ctx.Err(); err != nil {
		done(relay.TransientError(fmt.Errorf("webhook %s: not sent: %w", s.name, err), 0))
		return
	}
	body := d.Body
	var ce []relay.Header
	if s.ceSource != "" {
		body = relay.CloudEventsData(d.Event)
		var err error
		if ce, err = relay.CloudEventsHeaders(d.Event, IdempotencyKey(d.Event.EventKey, d.Replay), s.ceSource); err != nil {
			done(relay.PermanentError(fmt.Errorf("webhook %s: event %q: %w", s.name, d.Event.EventKey, err)))
			return
		}
	}
	if n := int64(len(body)); n > s.maxBody {
		done(relay.PermanentError(fmt.Errorf("webhook %s: event %q: body is %d bytes, over the sink's max_body of %d bytes",
			s.name, d.Event.EventKey, n, s.maxBody)))
		return
	}
	if s.pending != nil {
		s.sendBatched(ctx, d, done)
		return
	}
	if len(body) == 0 {
		// An empty POST counts as replayable to net/http, which would then
		// re-send it on its own; the engine never builds one.
		done(relay.PermanentError(fmt.Errorf("webhook %s: event %q: empty body", s.name, d.Event.EventKey)))
		return
	}
	select {
	case s.slots <- struct{}{}:
	case <-ctx.Done():
		done(relay.TransientError(fmt.Errorf("webhook %s: not sent, waiting for a free slot: %w", s.name, ctx.Err()), 0))
		return
	case <-s.closing:
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, ErrClosed), 0))
		return
	case <-s.stopped:
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, s.down()), 0))
		return
	}
	s.mu.Lock()
	if err := s.downLocked(); err != nil {
		s.mu.Unlock()
		<-s.slots
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, err), 0))
		return
	}
	s.inflight++
	s.startWorkerLocked()
	s.jobs <- job{ctx: ctx, d: d, body: body, ce: ce, done: done}
	s.mu.Unlock()
}

// Down reports why the sink is down now, or nil: it is closed, its workers
// failed, or the last request that reached a verdict on the receiver found
// it down (no connection, TLS refused, 401/403, the URL or the n8n workflow
// not there). An answer that is the event's own (a 400, a 500) is an
// answer: the sink is up. /readyz names a sink that is down (docs/sinks.md,
// "A server down at start").
func (s *Sink) Down() error {
	if err := s.down(); err != nil {
		return err
	}
	if p := s.lastDown.Load(); p != nil {
		return *p
	}
	return nil
}

// note records what a request's outcome says of the receiver for Down: a
// sink-down failure makes it down, a success or any answer up; an outcome
// without an answer (not sent, in doubt) says nothing.
func (s *Sink) note(err error) {
	var de *relay.DeliveryError
	switch {
	case err == nil:
		s.lastDown.Store(nil)
	case !errors.As(err, &de):
	case de.Class == relay.SinkDown && !errors.Is(err, ErrClosed):
		s.lastDown.Store(&err)
	case de.Status != 0:
		s.lastDown.Store(nil)
	}
}

// down returns why the sink takes no more Sends — it is closed, or its
// workers failed — or nil.
func (s *Sink) down() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.downLocked()
}

// downLocked is down with s.mu held.
func (s *Sink) downLocked() error {
	if s.closed {
		return ErrClosed
	}
	return s.workers.Failed()
}

// startWorkerLocked starts one more request worker unless Concurrency of
// them run already. s.mu is held.
func (s *Sink) startWorkerLocked() {
	if s.started < cap(s.slots) {
		s.started++
		s.workers.Go("request worker", s.work)
	}
}

// finished ends the count in flight of one request or batched event, whose
// done has been called.
func (s *Sink) finished() {
	s.mu.Lock()
	s.inflight--
	s.drainedLocked()
	s.mu.Unlock()
}

// drainedLocked closes drained once the sink is closed and nothing is in
// flight. s.mu is held.
func (s *Sink) drainedLocked() {
	if s.closed && s.inflight == 0 {
		select {
		case <-s.drained:
		default:
			close(s.drained)
		}
	}
}

// job is one request for a worker: one event, or a batch.
type job struct {
	ctx   context.Context // the sender's: when it has ended, the event is not posted
	d     *relay.Delivery
	body  []byte
	ce    []relay.Header
	done  func(error)
	batch []batchItem
}

// notSent is the outcome of an event whose sender's context ended before
// its request was made — the engine halted on a lost lock, say
// (docs/operations-health.md, "a lost lock"): transient, nothing written.
func (s *Sink) notSent(ctx context.Context) error {
	return relay.TransientError(fmt.Errorf("webhook %s: not sent, its sender stopped: %w", s.name, context.Cause(ctx)), 0)
}

// work makes the requests of the jobs it takes until ctx ends (Close,
// once nothing is in flight).
func (s *Sink) work(ctx context.Context) error {
	for {
		var j job
		select {
		case j = <-s.jobs:
		case <-ctx.Done():
			return nil
		}
		if j.batch != nil {
			// Events whose sender stopped while they waited in the batch
			// are not posted; the others go.
			live := j.batch[:0:0]
			for _, it := range j.batch {
				if it.ctx.Err() != nil {
					it.done(s.notSent(it.ctx))
					s.finished()
					continue
				}
				live = append(live, it)
			}
			var errs []error
			if len(live) > 0 {
				errs = s.postBatch(live)
				for _, err := range errs {
					s.note(err)
				}
			}
			<-s.slots
			for i, it := range live {
				it.done(errs[i])
				s.finished()
			}
			continue
		}
		var err error
		if j.ctx.Err() != nil {
			err = s.notSent(j.ctx)
		} else {
			err = s.post(j.d, j.body, j.ce)
			s.note(err)
		}
		<-s.slots
		j.done(err)
		s.finished()
	}
}

// Close stops accepting Sends (later ones report ErrClosed), waits for the
// requests in flight to call done until ctx is done, then aborts the rest
// (their done reports Unknown or Transient, by whether they were written)
// and waits for those callbacks; then it stops the sink's workers and waits
// for them. It returns ctx's error when it had to abort, or the failure of
// a worker. Calling Close again is safe.
func (s *Sink) Close(ctx context.Context) error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		close(s.closing)
		s.drainedLocked()
		s.mu.Unlock()
	})
	var err error
	select {
	case <-s.drained:
	case <-ctx.Done():
		err = fmt.Errorf("webhook %s: close: requests still in flight: %w", s.name, ctx.Err())
		s.cancelReqs()
		// A worker that failed took its request's done with it: that one
		// is not waited for.
		select {
		case <-s.drained:
		case <-s.stopped:
		}
	}
	s.cancelReqs()
	// Nothing is in flight, and closed stops new Sends: the workers and
	// assemble have nothing left to do.
	if werr := s.workers.Stop(); werr != nil && err == nil {
		err = fmt.Errorf("webhook %s: %w", s.name, werr)
	}
	s.transport.CloseIdleConnections()
	return err
}
