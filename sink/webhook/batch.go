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
	"sync/atomic"
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
	s.queue(ctx, []batchItem{{ctx: ctx, d: d, id: id, enc: enc, done: done}})
}

// queue hands unit — one event, or a run that one request carries whole —
// to assemble, or calls each of its events' done when it cannot.
func (s *Sink) queue(ctx context.Context, unit []batchItem) {
	fail := func(err error) {
		for _, it := range unit {
			it.done(err)
		}
	}
	// gave up: the unit never reached assemble.
	gaveUp := func(err error) {
		fail(err)
		s.mu.Lock()
		s.inflight -= len(unit)
		s.drainedLocked()
		s.mu.Unlock()
	}
	s.mu.Lock()
	if err := s.downLocked(); err != nil {
		s.mu.Unlock()
		fail(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, err), 0))
		return
	}
	s.inflight += len(unit)
	s.mu.Unlock()
	select {
	case s.pending <- unit:
	case <-ctx.Done():
		gaveUp(relay.TransientError(fmt.Errorf("webhook %s: not sent, waiting for room in a batch: %w", s.name, ctx.Err()), 0))
	case <-s.closing:
		gaveUp(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, ErrClosed), 0))
	case <-s.stopped:
		gaveUp(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, s.down()), 0))
	}
}

// MaxRun is the most events of one aggregate a request carries: max_events
// with batch.ordered, else 1 (docs/sinks.md "Ordered batches").
func (s *Sink) MaxRun() int {
	if s.batchOrdered {
		return s.batchMax
	}
	return 1
}

// FitRun returns how many of ds, from the first, one request should carry
// whole: at most MaxRun, within max_body, none from the first event that
// cannot be sent (an empty event key, an element over max_body), and no
// more than the run's share of a request when the aggregates are spread
// evenly over the concurrency requests in flight, max_events ÷
// ⌈aggregates ÷ concurrency⌉; at least 1 (docs/sinks.md "Ordered batches").
func (s *Sink) FitRun(ds []*relay.Delivery, aggregates int) int {
	perRequest := (max(aggregates, 1) + cap(s.slots) - 1) / cap(s.slots)
	return max(min(s.fitRun(ds), s.batchMax/perRequest), 1)
}

// fitRun returns how many of ds, from the first, one request can carry
// whole, by MaxRun, max_body and events that cannot be sent.
func (s *Sink) fitRun(ds []*relay.Delivery) int {
	n, size := 0, 2 // the brackets
	for _, d := range ds[:min(len(ds), s.MaxRun())] {
		if d.Event.EventKey == "" {
			break
		}
		add := len(appendBatchItem(nil, IdempotencyKey(d.Event.EventKey, d.Replay), d))
		if n > 0 {
			add++ // the comma
		}
		if int64(size+add) > s.maxBody {
			break
		}
		n, size = n+1, size+add
	}
	return max(n, 1)
}

// SendRun queues ds, a run of one aggregate's events FitRun accepted whole,
// for one batch request that carries them side by side in ds's order, and
// calls done once with each event's outcome from the batch's answer. It
// blocks as Send does. A single event goes as Send sends it; a run one
// request cannot carry is not sent (transient: the engine sends it again).
func (s *Sink) SendRun(ctx context.Context, ds []*relay.Delivery, done func([]error)) {
	errs := make([]error, len(ds))
	if len(ds) == 1 {
		s.Send(ctx, ds[0], func(err error) { errs[0] = err; done(errs) })
		return
	}
	if n := s.fitRun(ds); n < len(ds) || ctx.Err() != nil {
		err := relay.TransientError(fmt.Errorf("webhook %s: a run of %d events not sent: one request carries %d of them", s.name, len(ds), n), 0)
		if ctx.Err() != nil {
			err = relay.TransientError(fmt.Errorf("webhook %s: not sent: %w", s.name, ctx.Err()), 0)
		}
		for i := range errs {
			errs[i] = err
		}
		done(errs)
		return
	}
	var left atomic.Int32
	left.Store(int32(len(ds)))
	unit := make([]batchItem, len(ds))
	for i, d := range ds {
		id := IdempotencyKey(d.Event.EventKey, d.Replay)
		unit[i] = batchItem{ctx: ctx, d: d, id: id, enc: appendBatchItem(nil, id, d), done: func(err error) {
			errs[i] = err
			if left.Add(-1) == 0 {
				done(errs)
			}
		}}
	}
	s.queue(ctx, unit)
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

// assemble gathers pending events and runs into batches and hands each to a
// worker once it holds a request slot, until ctx ends (Close, which ends it
// only once nothing is pending). A batch goes when it has MaxEvents events,
// when the next event or run would take it past MaxEvents or max_body, or
// once its first event waited MaxWait and a slot is free; while it waits for
// a slot it keeps taking events. A run is never split: one that does not
// fit starts the next batch.
func (s *Sink) assemble(ctx context.Context) error {
	var next []batchItem
	for {
		var batch []batchItem
		size := 2 // the brackets
		// take adds unit to the batch, or keeps it for the next batch when
		// it would take the batch past MaxEvents or max_body. An empty
		// batch takes any unit: each fits a request alone.
		take := func(unit []batchItem) {
			add := len(unit) - 1 // the commas
			if len(batch) > 0 {
				add++
			}
			for _, it := range unit {
				add += len(it.enc)
			}
			if len(batch) > 0 && (len(batch)+len(unit) > s.batchMax || int64(size+add) > s.maxBody) {
				next = unit
				return
			}
			batch, size = append(batch, unit...), size+add
		}
		if next != nil {
			unit := next
			next = nil
			take(unit)
		} else {
			select {
			case unit := <-s.pending:
				take(unit)
			case <-ctx.Done():
				return nil
			}
		}
		timer := time.NewTimer(s.batchWait)
	collect:
		for len(batch) < s.batchMax && next == nil {
			select {
			case unit := <-s.pending:
				take(unit)
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
			case unit := <-s.pending:
				take(unit)
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

	req, trace, err := s.newRequest(s.reqCtx, s.url, body)
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
