package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// result is one scenario's outcome, a row of the summary table.
type result struct {
	Name       string
	Events     int
	Executions int64 // successful webhook executions during the scenario
	Effects    int64 // business effects of the scenario's events
	// Duplicates are deliveries the workflow absorbed: successful
	// executions that applied nothing.
	Duplicates int64
	Took       time.Duration
	Note       string
	Err        error
	// Batched: the scenario's events go to the batched sink, whose
	// executions carry many events each.
	Batched bool
}

// runScenarios runs the scenarios in order. A failure that leaves n8n or
// the relay unusable, or Ctrl-C, stops the run; the others are recorded and
// the next scenario runs.
func (e *e2e) runScenarios(ctx context.Context) []result {
	all := []func(context.Context) result{e.bulk, e.duplicate, e.outage, e.unpublished, e.batchBulk, e.batchRestart, e.batchFailing, e.batchHotAggregates}
	var scenarios []func(context.Context) result
	for i, s := range all {
		if e.opts.only == "" || slices.Contains(strings.Split(e.opts.only, ","), strconv.Itoa(i+1)) {
			scenarios = append(scenarios, s)
		}
	}
	var results []result
	for i, s := range scenarios {
		r := s(ctx)
		results = append(results, r)
		if r.Err != nil {
			e.say("%s: FAIL", r.Name)
		} else {
			e.say("%s: PASS (%d events, %d executions, %d effects, %d duplicates absorbed, %s)",
				r.Name, r.Events, r.Executions, r.Effects, r.Duplicates, r.Took.Round(100*time.Millisecond))
		}
		if ctx.Err() != nil || i == len(scenarios)-1 {
			break
		}
		if err := e.healthy(); err != nil {
			results = append(results, result{Name: "remaining scenarios", Err: fmt.Errorf("not run: %w", err)})
			break
		}
	}
	return results
}

// healthy fails when the relay or n8n has exited on its own.
func (e *e2e) healthy() error {
	if done, err := e.relay.exited(); done {
		return fmt.Errorf("the relay exited (%v); end of its log:\n%s", err, e.relay.log.Tail(20))
	}
	return e.n8n.Running()
}

// snapshot is what a scenario watches: the Postgres counts of its events and
// n8n's executions since the scenario began.
type snapshot struct {
	db   dbCounts
	exec execCounts
}

// measure takes a snapshot; base is n8n's counts when the scenario began.
func (e *e2e) measure(ctx context.Context, prefix string, base execCounts) (snapshot, error) {
	db, err := countScenario(ctx, e.pool, prefix)
	if err != nil {
		return snapshot{}, err
	}
	ex, err := e.n8n.Executions(ctx)
	if err != nil {
		return snapshot{}, err
	}
	ex.Success -= base.Success
	ex.Failed -= base.Failed
	ex.Running -= base.Running
	return snapshot{db: db, exec: ex}, nil
}

// errNotSettled is returned by settle when the counts stopped changing, or
// the time ran out, before the scenario's condition held.
var errNotSettled = errors.New("counts did not reach the expected values")

// settle polls the scenario's counts every 500 ms until done holds and the
// counts have not changed for 3 s (so late duplicates are seen), or until
// they have not changed for opts.stall or opts.timeout has passed
// (errNotSettled). It also fails when the relay or n8n exits.
func (e *e2e) settle(ctx context.Context, prefix string, base execCounts, done func(snapshot) bool) (snapshot, error) {
	const quiet = 3 * time.Second
	start := time.Now()
	var last snapshot
	lastChange := time.Now()
	lastReport := time.Now()
	for first := true; ; first = false {
		s, err := e.measure(ctx, prefix, base)
		if err != nil {
			return last, err
		}
		if first || s != last {
			last, lastChange = s, time.Now()
		}
		unchanged := time.Since(lastChange)
		switch {
		case done(s) && unchanged >= quiet:
			return s, nil
		case unchanged >= e.opts.stall || time.Since(start) >= e.opts.timeout:
			return s, errNotSettled
		}
		if err := e.healthy(); err != nil {
			return s, err
		}
		if time.Since(lastReport) >= 10*time.Second {
			lastReport = time.Now()
			e.say("  waiting: %d/%d events applied, %d effects; executions: %d successful, %d failed, %d running (unchanged for %s)",
				s.db.Applied, s.db.Outbox, s.db.Effects, s.exec.Success, s.exec.Failed, s.exec.Running, unchanged.Round(time.Second))
		}
		select {
		case <-ctx.Done():
			return s, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// fill copies the final counts into the result and checks what holds in
// every scenario: n events, each applied exactly once and its claim marked
// done. Failed executions are reported in the note. It returns the events
// without an effect.
func (e *e2e) fill(ctx context.Context, r *result, prefix string, s snapshot, waitErr error, started time.Time) []missingRow {
	r.Took = time.Since(started)
	if ctx.Err() != nil {
		r.Err = errors.New("interrupted")
		return nil
	}
	r.Executions, r.Effects = s.exec.Success, s.db.Effects
	if r.Executions < 0 {
		// Seen in the queue profile across a restart (n8n on
		// PostgreSQL; the cause is not established, possibly the
		// re-import removing past executions): the count since the
		// scenario began is not known.
		r.Executions = 0
		r.Note = strings.TrimPrefix(r.Note+"; executions not counted: n8n's count of them went down across the restart", "; ")
	}
	sink := sinkName
	if r.Batched {
		sink = batchSinkName
	} else {
		r.Duplicates = s.exec.Success - s.db.Effects
	}
	if s.exec.Failed > 0 {
		r.Note = strings.TrimPrefix(r.Note+fmt.Sprintf("; %d executions failed (error/crashed; the relay retried them)", s.exec.Failed), "; ")
	}
	var problems []string
	var missing []missingRow
	if s.db.Twice > 0 {
		problems = append(problems, fmt.Sprintf("%d events were applied MORE THAN ONCE (%d effects for %d events)", s.db.Twice, s.db.Effects, s.db.Applied))
	}
	if s.db.OutOfOrder > 0 {
		problems = append(problems, fmt.Sprintf("%d events were applied OUT OF ORDER: after a later event of their aggregate", s.db.OutOfOrder))
	}
	if waitErr != nil && !errors.Is(waitErr, errNotSettled) {
		problems = append(problems, waitErr.Error())
	}
	if s.db.Applied < int64(r.Events) {
		rows, err := missingEffects(ctx, e.pool, prefix, sink)
		if err != nil {
			problems = append(problems, err.Error())
		} else {
			missing = rows
			problems = append(problems, explainMissing(rows, r.Took))
		}
	}
	if s.db.Applied == int64(r.Events) && s.db.ClaimsDone != int64(r.Events) {
		problems = append(problems, fmt.Sprintf("%d of %d claims in n8n_processed_events have no done_at", int64(r.Events)-s.db.ClaimsDone, r.Events))
	}
	if len(problems) > 0 {
		r.Err = errors.New(strings.Join(problems, "\n"))
	}
	return missing
}

// allApplied is the usual settle condition: every event applied, its claim
// done, and at least one successful execution per event.
func allApplied(n int) func(snapshot) bool {
	return func(s snapshot) bool {
		return s.db.Applied == int64(n) && s.db.ClaimsDone == int64(n) && s.exec.Success >= int64(n)
	}
}

// makeEvents returns n events with keys prefix0001, prefix0002, ..., each
// its own aggregate.
func makeEvents(prefix, eventType string, n int) []event {
	return makeEventsOver(prefix, eventType, n, 0)
}

// makeEventsOver returns n events with keys prefix0001, prefix0002, ...
// over aggregates aggregates, in turn (0: each its own).
func makeEventsOver(prefix, eventType string, n, aggregates int) []event {
	evs := make([]event, n)
	for i := range evs {
		evs[i] = event{
			Key:     fmt.Sprintf("%s%04d", prefix, i+1),
			Type:    eventType,
			Payload: fmt.Sprintf(`{"n": %d, "note": "published by outbox-relay-e2e-n8n"}`, i+1),
		}
		if aggregates > 0 {
			evs[i].Aggregate = fmt.Sprintf("%sagg-%02d", prefix, i%aggregates)
		}
	}
	return evs
}

// bulk: N events published with outbox_publish become N successful
// executions and N business effects, one per event.
func (e *e2e) bulk(ctx context.Context) result {
	r := result{Name: "1 bulk delivery", Events: e.opts.events}
	const prefix = "e2e-s1-"
	base, err := e.n8n.Executions(ctx)
	if err != nil {
		r.Err = err
		return r
	}
	e.say("scenario 1: publishing %d events with outbox_publish", r.Events)
	started := time.Now()
	if err := publish(ctx, e.pool, makeEvents(prefix, "e2e.bulk", r.Events)); err != nil {
		r.Err = err
		return r
	}
	s, werr := e.settle(ctx, prefix, base, allApplied(r.Events))
	e.fill(ctx, &r, prefix, s, werr, started)
	if r.Err == nil && r.Duplicates != 0 {
		r.Note = strings.TrimPrefix(r.Note+fmt.Sprintf("; %d redeliveries absorbed by the claim", r.Duplicates), "; ")
	}
	e.noteLatency(ctx, &r, prefix)
	return r
}

// duplicate: one event is delivered by the relay, then its envelope is
// POSTed again with the same headers. The workflow must answer 2xx and
// apply nothing. The key has a comma, spaces and quotes, so it also checks
// that the workflow passes keys as query parameters intact (and that the
// relay maps a key that is not header-safe). A request without the token
// must be refused without running the workflow.
func (e *e2e) duplicate(ctx context.Context) result {
	r := result{Name: "2 duplicate delivery", Events: 1}
	const prefix = "e2e-s2-"
	key := prefix + `dup, "quoted" key`
	base, err := e.n8n.Executions(ctx)
	if err != nil {
		r.Err = err
		return r
	}
	e.say("scenario 2: publishing %q, waiting for its effect", key)
	started := time.Now()
	evs := []event{{Key: key, Type: "e2e.duplicate", Payload: `{"note": "delivered twice on purpose"}`}}
	if err := publish(ctx, e.pool, evs); err != nil {
		r.Err = err
		return r
	}
	s, werr := e.settle(ctx, prefix, base, allApplied(1))
	if werr != nil {
		e.fill(ctx, &r, prefix, s, werr, started)
		return r
	}

	ev, err := loadEvent(ctx, e.pool, key)
	if err != nil {
		r.Err = err
		return r
	}
	body := ev.AppendEnvelope(nil)
	id := webhook.IdempotencyKey(key, 0)
	post := func(token string) (int, string, error) { return e.postWebhook(ctx, key, body, token) }

	e.say("scenario 2: POST without %s must be refused", tokenHeader)
	code, answer, err := post("")
	if err != nil {
		r.Err = fmt.Errorf("POST without the token: %w", err)
		return r
	}
	if code != http.StatusForbidden && code != http.StatusUnauthorized {
		r.Err = fmt.Errorf("POST without the token answered %d %q, want 403 (the Webhook node's header auth)", code, answer)
		return r
	}
	e.say("scenario 2: POSTing the same envelope (%d bytes, webhook-id %s) a second time", len(body), id)
	code, answer, err = post(e.token)
	if err != nil {
		r.Err = fmt.Errorf("POST the duplicate: %w", err)
		return r
	}
	if code < 200 || code > 299 {
		r.Err = fmt.Errorf("the duplicate was answered %d %q, want 2xx", code, answer)
		return r
	}
	if !strings.Contains(answer, `"duplicate"`) {
		r.Err = fmt.Errorf("the duplicate was answered %d %q, want the workflow's \"duplicate\" result", code, answer)
		return r
	}
	s, werr = e.settle(ctx, prefix, base, func(s snapshot) bool { return allApplied(1)(s) && s.exec.Success >= 2 })
	e.fill(ctx, &r, prefix, s, werr, started)
	switch {
	case r.Err != nil:
	case s.exec.Success != 2 || s.db.Effects != 1 || s.db.Claims != 1:
		r.Err = fmt.Errorf("after the duplicate: %d successful executions, %d effects, %d claims; want 2, 1, 1", s.exec.Success, s.db.Effects, s.db.Claims)
	default:
		r.Note = fmt.Sprintf("duplicate answered %d %s; no token: %d", code, strings.TrimSpace(answer), http.StatusForbidden)
		if err := e.failingStep(ctx); err != nil {
			r.Err = err
		} else {
			r.Note += "; a failing business step released its claim and the retry applied it"
		}
	}
	return r
}

// postWebhook POSTs body to the workflow's webhook with the headers the
// relay's webhook sink sends for key (sink/webhook), plus the token header
// when token is set, and returns the status and the start of the answer.
func (e *e2e) postWebhook(ctx context.Context, key string, body []byte, token string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.n8n.WebhookURL(), bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	id := webhook.IdempotencyKey(key, 0)
	h := req.Header
	h.Set("Content-Type", "application/json")
	h.Set("Idempotency-Key", id)
	h.Set("Webhook-Id", id)
	h.Set("Webhook-Timestamp", strconv.FormatInt(time.Now().Unix(), 10))
	h.Set("Webhook-Attempt", "1")
	if id == key {
		h.Set("Outbox-Event-Key", key)
	}
	if token != "" {
		h.Set(tokenHeader, token)
	}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, string(b), nil
}

// failingStep checks the workflow's error path, directly against n8n: while
// a CHECK constraint makes the placeholder business step fail for one key,
// a delivery of that key must answer 5xx and leave no claim behind (else
// every retry would be answered "still in progress"); once the step works
// again, the retry must apply the event once.
func (e *e2e) failingStep(ctx context.Context) error {
	const key = "e2e-fail-once"
	body, err := json.Marshal(map[string]any{"id": 0, "event_key": key, "event_type": "e2e.fail",
		"aggregate_type": nil, "aggregate_id": nil, "payload": map[string]any{}, "created_at": time.Now().UTC()})
	if err != nil {
		return err
	}
	e.say("scenario 2: a business step that fails must release its claim")
	if _, err := e.pool.Exec(ctx, `ALTER TABLE n8n_business_effects ADD CONSTRAINT e2e_fail_once CHECK (event_key <> '`+key+`')`); err != nil {
		return fmt.Errorf("make the business step fail: %w", err)
	}
	code, answer, err := e.postWebhook(ctx, key, body, e.token)
	if _, derr := e.pool.Exec(ctx, `ALTER TABLE n8n_business_effects DROP CONSTRAINT e2e_fail_once`); derr != nil && err == nil {
		err = derr
	}
	if err != nil {
		return fmt.Errorf("POST with a failing business step: %w", err)
	}
	if code < 500 {
		return fmt.Errorf("with a failing business step the workflow answered %d %q, want 5xx so that the sender retries", code, answer)
	}
	var claims int
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM n8n_processed_events WHERE event_key = $1`, key).Scan(&claims); err != nil {
		return err
	}
	if claims != 0 {
		return fmt.Errorf("the business step failed (answer %d) but its claim was not released: a retry would be answered \"still in progress\" until the event is dead-lettered", code)
	}
	code, answer, err = e.postWebhook(ctx, key, body, e.token)
	if err != nil {
		return fmt.Errorf("POST the retry: %w", err)
	}
	var effects int
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM n8n_business_effects WHERE event_key = $1`, key).Scan(&effects); err != nil {
		return err
	}
	if code/100 != 2 || !strings.Contains(answer, `"applied"`) || effects != 1 {
		return fmt.Errorf("the retry after the failed business step answered %d %q with %d effects, want 2xx \"applied\" and 1", code, answer, effects)
	}
	return nil
}

// outage: n8n is stopped with SIGTERM mid-run and started again while events
// keep being published: a fifth before the stop (over 8 s), three fifths
// spread over the outage, a fifth once n8n is back (over 10 s). n8n stays
// stopped for opts.outage, or longer when re-importing and publishing the
// workflow (which needs n8n stopped) takes longer. Every event must end with
// exactly one effect. Events the relay could not deliver meanwhile are
// diverted to the claim path (pending with handoff_at); when nothing
// delivers them the failure lists them, and says when they were published.
func (e *e2e) outage(ctx context.Context) result {
	r := result{Name: "3 n8n outage", Events: e.opts.outageEvents}
	const prefix = "e2e-s3-"
	base, err := e.n8n.Executions(ctx)
	if err != nil {
		r.Err = err
		return r
	}
	evs := makeEvents(prefix, "e2e.outage", r.Events)
	nBefore := max(r.Events/5, 1)
	nAfter := min(max(r.Events/5, 1), r.Events-nBefore)
	before, during, after := evs[:nBefore], evs[nBefore:r.Events-nAfter], evs[r.Events-nAfter:]
	started := time.Now()
	fail := func(err error) result {
		r.Took, r.Err = time.Since(started), err
		return r
	}

	e.say("scenario 3: publishing %d events over 8 s", len(before))
	if err := e.publishPaced(ctx, before, 8*time.Second); err != nil {
		return fail(err)
	}
	e.say("scenario 3: stopping n8n (SIGTERM to pid %d); publishing %d events during the outage", e.n8n.proc.Pid(), len(during))
	downAt := time.Now()
	pubCtx, stopPub := context.WithCancel(ctx)
	defer stopPub()
	pubDone := make(chan error, 1)
	go func() { pubDone <- e.publishPaced(pubCtx, during, e.opts.outage) }()
	failDuring := func(err error) result {
		stopPub()
		<-pubDone
		return fail(err)
	}
	stopTook, err := e.n8n.Stop()
	if err != nil {
		return failDuring(err)
	}
	if err := e.n8n.Deploy(ctx, true); err != nil {
		return failDuring(err)
	}
	if wait := e.opts.outage - time.Since(downAt); wait > 0 {
		select {
		case <-ctx.Done():
			return failDuring(ctx.Err())
		case <-time.After(wait):
		}
	}
	stoppedFor := time.Since(downAt)
	e.say("scenario 3: n8n stopped for %s (SIGTERM took %s, then import:workflow + publish:workflow); starting it again",
		stoppedFor.Round(time.Second), stopTook.Round(100*time.Millisecond))
	startTook, err := e.n8n.Start(ctx, true)
	if err != nil {
		return failDuring(err)
	}
	upAt := time.Now()
	if err := <-pubDone; err != nil {
		return fail(err)
	}
	e.say("scenario 3: n8n ready again after %s down (start %s); publishing %d events over 10 s",
		upAt.Sub(downAt).Round(time.Second), startTook.Round(100*time.Millisecond), len(after))
	if err := e.publishPaced(ctx, after, 10*time.Second); err != nil {
		return fail(err)
	}

	s, werr := e.settle(ctx, prefix, base, allApplied(r.Events))
	phase := func(ev event) int {
		switch {
		case ev.Published.Before(downAt):
			return 0
		case ev.Published.Before(upAt):
			return 1
		default:
			return 2
		}
	}
	var published [3]int
	byKey := map[string]event{}
	for _, ev := range evs {
		published[phase(ev)]++
		byKey[ev.Key] = ev
	}
	r.Note = fmt.Sprintf("n8n stopped %s + start %s; events published before/while down or starting/after: %d/%d/%d",
		stoppedFor.Round(time.Second), startTook.Round(time.Second), published[0], published[1], published[2])
	if missing := e.fill(ctx, &r, prefix, s, werr, started); len(missing) > 0 {
		var lost [3]int
		for _, m := range missing {
			lost[phase(byKey[m.Key])]++
		}
		r.Err = fmt.Errorf("%w\n  by when they were published: %d of %d before n8n was stopped, %d of %d while it was stopped or starting, %d of %d after it was ready again",
			r.Err, lost[0], published[0], lost[1], published[1], lost[2], published[2])
	}
	return r
}

// publishPaced publishes evs one at a time, spread evenly over span.
func (e *e2e) publishPaced(ctx context.Context, evs []event, span time.Duration) error {
	every := span / time.Duration(max(len(evs), 1))
	if every <= 0 {
		return publish(ctx, e.pool, evs)
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for i := range evs {
		if err := publish(ctx, e.pool, evs[i:i+1]); err != nil {
			return err
		}
		if i == len(evs)-1 {
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
	return nil
}

// unpublished: with the workflow unpublished n8n answers 404 "not
// registered"; the relay must open the sink's circuit (its log says so) and
// the events wait. After the workflow is published again, they and events
// published afterwards must all be applied once.
func (e *e2e) unpublished(ctx context.Context) result {
	const waiting, after = 20, 5
	r := result{Name: "4 workflow unpublished", Events: waiting + after}
	const prefix = "e2e-s4-"
	base, err := e.n8n.Executions(ctx)
	if err != nil {
		r.Err = err
		return r
	}
	started := time.Now()
	fail := func(err error) result {
		r.Took, r.Err = time.Since(started), err
		return r
	}
	e.say("scenario 4: stopping n8n, unpublishing the workflow, starting n8n")
	if _, err := e.n8n.Stop(); err != nil {
		return fail(err)
	}
	if err := e.n8n.Deploy(ctx, false); err != nil {
		return fail(err)
	}
	if _, err := e.n8n.Start(ctx, false); err != nil {
		return fail(err)
	}
	logOff := e.relay.log.Len()
	e.say("scenario 4: n8n answers 404 \"not registered\"; publishing %d events", waiting)
	if err := publish(ctx, e.pool, makeEvents(prefix+"held-", "e2e.unpublished", waiting)); err != nil {
		return fail(err)
	}
	var circuit []string
	for deadline := time.Now().Add(30 * time.Second); ; {
		circuit = e.relay.log.LinesSince(logOff, "circuit open", "not registered")
		if len(circuit) > 0 || time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return fail(ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
	if len(circuit) == 0 {
		return fail(fmt.Errorf("the relay logged no \"circuit open\" line naming n8n's \"not registered\" answer within 30 s; relay log since the events were published:\n%s",
			lastLines(e.relay.log.Since(logOff), 20)))
	}
	e.say("scenario 4: relay: %s", circuit[0])
	// The events must wait: nothing applied, no execution, for 5 s.
	select {
	case <-ctx.Done():
		return fail(ctx.Err())
	case <-time.After(5 * time.Second):
	}
	s, err := e.measure(ctx, prefix, base)
	if err != nil {
		return fail(err)
	}
	if n := s.exec.Success + s.exec.Failed + s.exec.Running; s.db.Effects != 0 || n != 0 {
		return fail(fmt.Errorf("with the workflow unpublished: %d effects and %d executions, want none", s.db.Effects, n))
	}
	var handed int64
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM integration_outbox WHERE starts_with(event_key, $1) AND status = 'pending' AND handoff_at IS NOT NULL`,
		prefix).Scan(&handed); err != nil {
		return fail(err)
	}
	e.say("scenario 4: events wait (%d of %d pending with handoff_at); publishing the workflow again", handed, waiting)

	if _, err := e.n8n.Stop(); err != nil {
		return fail(err)
	}
	if err := e.n8n.Deploy(ctx, true); err != nil {
		return fail(err)
	}
	if _, err := e.n8n.Start(ctx, true); err != nil {
		return fail(err)
	}
	e.say("scenario 4: published and running; publishing %d more events", after)
	if err := publish(ctx, e.pool, makeEvents(prefix+"after-", "e2e.unpublished", after)); err != nil {
		return fail(err)
	}
	s, werr := e.settle(ctx, prefix, base, allApplied(r.Events))
	closed := len(e.relay.log.LinesSince(logOff, "circuit closed")) > 0
	r.Note = fmt.Sprintf("circuit opened on 404 not registered; %d diverted while unpublished; circuit closed again: %t", handed, closed)
	e.fill(ctx, &r, prefix, s, werr, started)
	return r
}
