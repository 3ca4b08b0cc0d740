package webhook

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Batched delivery (docs/sinks.md "Batched delivery"): Sends from the
// engine's lane arrive concurrently, at most one per aggregate in flight, so
// a batch never holds an event whose aggregate has an earlier event still
// undelivered. One goroutine, assemble, gathers the pending events into
// batches; the workers post them; every event's done gets its own outcome.

// Per-event results a receiver answers in a batch response.
const (
	ResultOK    = "ok"
	ResultRetry = "retry"
	ResultFail  = "fail"
)

// batchIDPrefix starts the id of a batch request (Idempotency-Key,
// webhook-id). Event ids never start with it: see IdempotencyKey.
const batchIDPrefix = "batch_"

// maxResultsBody is how much of a 2xx batch response is read for its
// per-event results.
const maxResultsBody = 4 << 20

// batchItem is one event waiting for, or riding in, a batch request.
type batchItem struct {
	ctx  context.Context // the sender's: when it has ended, the event is not posted
	d    *relay.Delivery
	id   string // the event's idempotency id
	enc  []byte // the event's array element
	done func(error)
}

// sendBatched queues d for a batch request. Like Send, it calls done once;
// it blocks while the batch being assembled and every request slot are
// full, until ctx is done or the sink is closed.
func (s *Sink) sendBatched(ctx context.Context, d *relay.Delivery, done func(error)) {
	id := IdempotencyKey(d.Event.EventKey, d.Replay)
	enc := appendBatchItem(nil, id, d)
	if n := int64(len(enc) + 2); n > s.maxBody {
		done(relay.PermanentError(fmt.Errorf("webhook %s: event %q: body is %d bytes in a batch, over the sink's max_body of %d bytes",
			s.name, d.Event.EventKey, n, s.maxBody)))
		return
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, ErrClosed), 0))
		return
	}
	s.inflight.Add(1)
	s.mu.Unlock()
	select {
	case s.pending <- batchItem{ctx: ctx, d: d, id: id, enc: enc, done: done}:
	case <-ctx.Done():
		s.inflight.Done()
		done(relay.TransientError(fmt.Errorf("webhook %s: not sent, waiting for room in a batch: %w", s.name, ctx.Err()), 0))
	case <-s.closing:
		s.inflight.Done()
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, ErrClosed), 0))
	}
}

// appendBatchItem appends the array element of one event:
// {"id":…,"attempt":…,"event":<body>} with the trace context when it has one.
func appendBatchItem(b []byte, id string, d *relay.Delivery) []byte {
	b = append(b, `{"id":`...)
	b = appendJSONString(b, id)
	b = append(b, `,"attempt":`...)
	b = strconv.AppendInt(b, int64(d.Attempt), 10)
	if tc := d.Event.Trace; tc.Traceparent != "" {
		b = append(b, `,"traceparent":`...)
		b = appendJSONString(b, tc.Traceparent)
		if tc.Tracestate != "" {
			b = append(b, `,"tracestate":`...)
			b = appendJSONString(b, tc.Tracestate)
		}
	}
	b = append(b, `,"event":`...)
	b = append(b, d.Body...)
	return append(b, '}')
}

func appendJSONString(b []byte, s string) []byte {
	q, _ := json.Marshal(s) // a string always encodes
	return append(b, q...)
}

// assemble gathers pending events into batches and hands each to a worker
// once it holds a request slot, until Close stops it (which it does only
// once no event is pending). A batch goes when it has MaxEvents events, when
// one more would pass max_body, or once its first event waited MaxWait and
// a slot is free; while it waits for a slot it keeps taking events.
func (s *Sink) assemble() {
	defer close(s.assembled)
	var next *batchItem
	for {
		var batch []batchItem
		size := 2 // the brackets
		if next != nil {
			batch, size, next = append(batch, *next), size+len(next.enc), nil
		} else {
			select {
			case it := <-s.pending:
				batch, size = append(batch, it), size+len(it.enc)
			case <-s.stopAssemble:
				return
			}
		}
		// take adds it to the batch, or keeps it for the next batch when it
		// would take the body over max_body.
		take := func(it batchItem) {
			if int64(size+1+len(it.enc)) > s.maxBody {
				next = &it
				return
			}
			batch, size = append(batch, it), size+1+len(it.enc)
		}
		timer := time.NewTimer(s.batchWait)
	collect:
		for len(batch) < s.batchMax && next == nil {
			select {
			case it := <-s.pending:
				take(it)
			case <-timer.C:
				break collect
			}
		}
		timer.Stop()
		sent := false
		for !sent && len(batch) < s.batchMax && next == nil {
			select {
			case s.slots <- struct{}{}:
				sent = true
			case it := <-s.pending:
				take(it)
			}
		}
		if !sent {
			s.slots <- struct{}{}
		}
		s.dispatchBatch(batch)
	}
}

// dispatchBatch hands batch, which holds a request slot, to a worker.
func (s *Sink) dispatchBatch(batch []batchItem) {
	s.mu.Lock()
	if s.workers < cap(s.slots) {
		s.workers++
		go s.work()
	}
	s.jobs <- job{batch: batch}
	s.mu.Unlock()
}

// postBatch makes one request for batch and returns each event's outcome,
// in batch's order.
func (s *Sink) postBatch(batch []batchItem) []error {
	now := time.Now()
	body := make([]byte, 0, 2+len(batch)*256)
	body = append(body, '[')
	ids := sha256.New()
	attempt := 0
	for i, it := range batch {
		if i > 0 {
			body = append(body, ',')
		}
		body = append(body, it.enc...)
		_, _ = io.WriteString(ids, it.id+"\n")
		attempt = max(attempt, it.d.Attempt)
	}
	body = append(body, ']')
	// The batch's id depends only on the ids it carries, in order: the
	// same events sent again form the same id, a retry of some of them a
	// new one.
	id := batchIDPrefix + base64.RawURLEncoding.EncodeToString(ids.Sum(nil))
	label := fmt.Sprintf("batch %s of %d events", id, len(batch))
	all := func(err error) []error {
		errs := make([]error, len(batch))
		for i := range errs {
			errs[i] = err
		}
		return errs
	}

	req, trace, err := s.newRequest(body)
	if err != nil {
		return all(err)
	}
	req.Header.Set("Webhook-Attempt", strconv.Itoa(attempt))
	req.Header.Set("Outbox-Batch-Size", strconv.Itoa(len(batch)))
	if err := s.authenticate(req, id, now, body, jwt.MapClaims{"batch": id, "events": len(batch)}); err != nil {
		return all(err)
	}
	resp, err := s.do(req, trace, label, attempt, now)
	if err != nil {
		return all(err)
	}
	defer drain(resp)
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return all(s.outcome(label, resp, now))
	}
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxResultsBody+1))
	if err != nil {
		// The receiver answered 2xx: it ran the batch, but which of its
		// events it applied is lost with the rest of the body.
		return all(relay.UnknownError(fmt.Errorf("webhook %s: %s: reading the 2xx answer's results: %w", s.name, label, err)))
	}
	if bytes.Equal(bytes.TrimSpace(answer), []byte(n8nStartingUp)) {
		return all(relay.TransientError(fmt.Errorf("webhook %s: %s: n8n answered %d %q: it is still starting, the workflow did not run",
			s.name, label, resp.StatusCode, n8nStartingUp), time.Second))
	}
	results, ok := parseResults(answer)
	if !ok {
		return make([]error, len(batch)) // a plain 2xx: every event delivered
	}
	errs := make([]error, len(batch))
	for i, it := range batch {
		r, listed := results[it.id]
		what := fmt.Sprintf("webhook %s: event %q", s.name, it.d.Event.EventKey)
		switch {
		case !listed:
			errs[i] = relay.UnknownError(fmt.Errorf("%s: the receiver answered %s with per-event results that do not list it (id %q): it may have applied it", what, label, it.id))
		case r.Result == ResultOK:
		case r.Result == ResultRetry:
			errs[i] = relay.TransientError(fmt.Errorf("%s: the receiver answered retry: %s", what, excerpt([]byte(r.Message))), 0)
		case r.Result == ResultFail:
			errs[i] = relay.PermanentError(fmt.Errorf("%s: the receiver answered fail: %s", what, excerpt([]byte(r.Message))))
		default:
			errs[i] = relay.UnknownError(fmt.Errorf("%s: the receiver answered result %q, not one of ok, retry, fail", what, excerpt([]byte(r.Result))))
		}
	}
	return errs
}

// eventResult is one event's answer in a batch response.
type eventResult struct {
	ID      string `json:"id"`
	Result  string `json:"result"`
	Message string `json:"message"`
}

// parseResults reads a 2xx batch answer: {"results":[{"id","result",
// "message"}]} or the array alone. ok is false when the answer is not
// that shape (an empty body, n8n's default answer, any other JSON): then
// the 2xx covers every event.
func parseResults(answer []byte) (map[string]eventResult, bool) {
	answer = bytes.TrimSpace(answer)
	if len(answer) == 0 || len(answer) > maxResultsBody {
		return nil, false
	}
	var list []eventResult
	if answer[0] == '[' {
		if json.Unmarshal(answer, &list) != nil {
			return nil, false
		}
	} else {
		var wrapped struct {
			Results *[]eventResult `json:"results"`
		}
		if json.Unmarshal(answer, &wrapped) != nil || wrapped.Results == nil {
			return nil, false
		}
		list = *wrapped.Results
	}
	results := make(map[string]eventResult, len(list))
	for _, r := range list {
		if r.ID == "" || r.Result == "" {
			return nil, false
		}
		results[r.ID] = r
	}
	return results, true
}
