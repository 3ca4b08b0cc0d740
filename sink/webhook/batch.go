package webhook

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
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
// webhook-id), which is new for every request: it names the request, never
// the events it carries, so a receiver or gateway that dedupes on it cannot
// take a re-sent batch for its first send. Receivers dedupe per event, on
// each element's id (docs/sinks.md "Batched delivery").
const batchIDPrefix = "batch_"

// maxResultsBody is how much of a 2xx batch response is read for its
// per-event results; a longer answer leaves every event of the batch
// unknown.
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
	if err := s.downLocked(); err != nil {
		s.mu.Unlock()
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, err), 0))
		return
	}
	s.inflight++
	s.mu.Unlock()
	select {
	case s.pending <- batchItem{ctx: ctx, d: d, id: id, enc: enc, done: done}:
	case <-ctx.Done():
		done(relay.TransientError(fmt.Errorf("webhook %s: not sent, waiting for room in a batch: %w", s.name, ctx.Err()), 0))
		s.finished()
	case <-s.closing:
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, ErrClosed), 0))
		s.finished()
	case <-s.stopped:
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, s.down()), 0))
		s.finished()
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
// once it holds a request slot, until ctx ends (Close, which ends it only
// once no event is pending). A batch goes when it has MaxEvents events,
// when one more would pass max_body, or once its first event waited
// MaxWait and a slot is free; while it waits for a slot it keeps taking
// events.
func (s *Sink) assemble(ctx context.Context) error {
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
			case <-ctx.Done():
				return nil
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
	s.startWorkerLocked()
	s.jobs <- job{batch: batch}
	s.mu.Unlock()
}

// postBatch makes one request for batch and returns each event's outcome,
// in batch's order.
func (s *Sink) postBatch(batch []batchItem) []error {
	now := time.Now()
	body := make([]byte, 0, 2+len(batch)*256)
	body = append(body, '[')
	attempt := 0
	for i, it := range batch {
		if i > 0 {
			body = append(body, ',')
		}
		body = append(body, it.enc...)
		attempt = max(attempt, it.d.Attempt)
	}
	body = append(body, ']')
	id := batchIDPrefix + rand.Text()
	label := fmt.Sprintf("batch %s of %d events", id, len(batch))
	all := func(err error) []error {
		errs := make([]error, len(batch))
		for i := range errs {
			errs[i] = err
		}
		return errs
	}

	req, trace, err := s.newRequest(s.reqCtx, body)
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
	// The receiver answered 2xx: it ran the batch. Which of its events it
	// applied is in the answer, so an answer that cannot be read whole
	// leaves every event unknown.
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxResultsBody+1))
	if err != nil {
		return all(relay.UnknownError(fmt.Errorf("webhook %s: %s: reading the 2xx answer's results: %w", s.name, label, err)))
	}
	if len(answer) > maxResultsBody {
		return all(relay.UnknownError(fmt.Errorf("webhook %s: %s: the 2xx answer is larger than the %d bytes read for per-event results: which events the receiver applied is unknown",
			s.name, label, maxResultsBody)))
	}
	if bytes.Equal(bytes.TrimSpace(answer), []byte(n8nStartingUp)) {
		return all(relay.TransientError(fmt.Errorf("webhook %s: %s: n8n answered %d %q: it is still starting, the workflow did not run",
			s.name, label, resp.StatusCode, n8nStartingUp), time.Second))
	}
	return s.settle(label, batch, answer)
}

// eventResult is one entry of a results answer, as far as it can be read.
type eventResult struct {
	id, result, message string
	// malformed says why the entry cannot settle its event; "" when it can.
	malformed string
}

// readResult reads one entry of a results answer: {"id","result","message"}
// with string values, "message" optional.
func readResult(raw json.RawMessage) eventResult {
	var e struct {
		ID      any `json:"id"`
		Result  any `json:"result"`
		Message any `json:"message"`
	}
	if json.Unmarshal(raw, &e) != nil {
		return eventResult{malformed: "not an object"}
	}
	var r eventResult
	r.id, _ = e.ID.(string)
	r.message, _ = e.Message.(string)
	switch v := e.Result.(type) {
	case nil:
		r.malformed = `no "result"`
	case string:
		r.result = v
		if v == "" {
			r.malformed = `"result" is empty`
		}
	default:
		r.malformed = `"result" is not a string`
	}
	return r
}

// String describes the entry's answer in errors.
func (r eventResult) String() string {
	if r.malformed != "" {
		return "a malformed entry (" + r.malformed + ")"
	}
	return strconv.Quote(excerpt([]byte(r.result)))
}

// errNotAList is the outcome of every event of a batch whose answer has a
// "results" that is not an array.
var errNotAList = errors.New(`the 2xx answer's "results" is not an array`)

// resultEntries returns the entries of a 2xx batch answer that may hold
// per-event results: those of {"results":[…]} (explicit is true), or of a
// bare array. It returns none for any other answer (empty, n8n's default,
// other JSON), and errNotAList for a "results" that is not an array.
func resultEntries(answer []byte) (raws []json.RawMessage, explicit bool, err error) {
	answer = bytes.TrimSpace(answer)
	if len(answer) == 0 {
		return nil, false, nil
	}
	if answer[0] == '[' {
		if json.Unmarshal(answer, &raws) != nil {
			return nil, false, nil
		}
		return raws, false, nil
	}
	var wrapped struct {
		Results json.RawMessage `json:"results"`
	}
	if json.Unmarshal(answer, &wrapped) != nil || wrapped.Results == nil || string(wrapped.Results) == "null" {
		return nil, false, nil
	}
	if json.Unmarshal(wrapped.Results, &raws) != nil {
		return nil, true, errNotAList
	}
	return raws, true, nil
}

// settle reads a 2xx batch answer and returns each event's outcome, in
// batch's order (docs/sinks.md "Batched delivery"). The answer holds
// per-event results when it is {"results":[…]}, or an array in which some
// entry names an event of the batch by its id or answers ok, retry or fail;
// any other answer (empty, n8n's default, other JSON) is a plain 2xx that
// delivers every event. Results are read entry by entry: an event gets its
// entry's result; an event with no entry, a malformed one, or two entries
// that disagree is unknown. An entry without a readable id, or with an id
// the batch does not carry, settles nothing and is logged.
func (s *Sink) settle(label string, batch []batchItem, answer []byte) []error {
	errs := make([]error, len(batch))
	raws, explicit, err := resultEntries(answer)
	if err != nil {
		err = relay.UnknownError(fmt.Errorf("webhook %s: %s: %w: which events the receiver applied is unknown", s.name, label, err))
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	inBatch := make(map[string]bool, len(batch))
	for _, it := range batch {
		inBatch[it.id] = true
	}
	entries := make([]eventResult, len(raws))
	perEvent := explicit
	for i, raw := range raws {
		r := readResult(raw)
		entries[i] = r
		perEvent = perEvent || inBatch[r.id] || r.result == ResultOK || r.result == ResultRetry || r.result == ResultFail
	}
	if !perEvent {
		return errs // a plain 2xx: every event delivered
	}

	// answered is an event's entry, and the first entry for it that
	// disagrees, if any.
	type answered struct{ first, other *eventResult }
	results := make(map[string]*answered, len(batch))
	var ignored []string
	for i := range entries {
		r := &entries[i]
		if !inBatch[r.id] {
			why := "no id"
			if r.id != "" {
				why = fmt.Sprintf("id %q is not in the batch", excerpt([]byte(r.id)))
			}
			ignored = append(ignored, fmt.Sprintf("entry %d: %s", i+1, why))
			continue
		}
		a, ok := results[r.id]
		switch {
		case !ok:
			results[r.id] = &answered{first: r}
		case a.other == nil && (a.first.result != r.result || a.first.malformed != r.malformed):
			a.other = r
		}
	}
	if len(ignored) > 0 {
		s.log.Warn().Str("request", label).Int("ignored", len(ignored)).Strs("entries", ignored[:min(len(ignored), 5)]).
			Msg("webhook batch answer: entries that name no event of the batch were ignored")
	}

	for i, it := range batch {
		a, listed := results[it.id]
		what := fmt.Sprintf("webhook %s: event %q", s.name, it.d.Event.EventKey)
		switch {
		case !listed:
			errs[i] = relay.UnknownError(fmt.Errorf("%s: the receiver answered %s with per-event results that do not list it (id %q): it may have applied it", what, label, it.id))
		case a.other != nil:
			errs[i] = relay.UnknownError(fmt.Errorf("%s: the receiver answered %s with results for it twice, %s and %s: it may have applied it", what, label, a.first, a.other))
		case a.first.malformed != "":
			errs[i] = relay.UnknownError(fmt.Errorf("%s: the receiver answered %s with %s for it: it may have applied it", what, label, a.first))
		case a.first.result == ResultOK:
		case a.first.result == ResultRetry:
			errs[i] = relay.TransientError(fmt.Errorf("%s: the receiver answered retry: %s", what, excerpt([]byte(a.first.message))), 0)
		case a.first.result == ResultFail:
			errs[i] = relay.PermanentError(fmt.Errorf("%s: the receiver answered fail: %s", what, excerpt([]byte(a.first.message))))
		default:
			errs[i] = relay.UnknownError(fmt.Errorf("%s: the receiver answered result %s, not one of ok, retry, fail", what, a.first))
		}
	}
	return errs
}
