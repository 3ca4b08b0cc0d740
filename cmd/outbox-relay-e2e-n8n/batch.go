package main

import (
	"context"
	"crypto/md5"
	"fmt"
	"strings"
	"time"
)

// Scenarios 5-8: the batched sink (docs/sinks.md "Batched delivery") into
// the same workflow, which answers per event. Scenario 5's events are each
// their own aggregate; those of 6-8 fall on -aggregates aggregates, so with
// batch.ordered a batch carries runs of one aggregate, which the workflow
// applies in order, stopping an aggregate at its first event not applied
// (docs/sinks.md "Ordered batches").

// latency is what a scenario measured from commit to side effect.
type latency struct {
	Rate     float64 // events applied per second, first commit to last effect
	P50, P99 time.Duration
}

func (l latency) String() string {
	return fmt.Sprintf("%.0f events/s applied; commit→effect p50 %s, p99 %s", l.Rate, l.P50.Round(time.Millisecond), l.P99.Round(time.Millisecond))
}

// measureLatency reads the scenario's rate and commit-to-effect latencies:
// an outbox row's created_at (its transaction's start, just before commit)
// to its business effect's applied_at, both on the same PostgreSQL clock.
func (e *e2e) measureLatency(ctx context.Context, prefix string) (latency, error) {
	var l latency
	var span, p50, p99 float64
	err := e.pool.QueryRow(ctx, `
SELECT extract(epoch FROM max(b.applied_at) - min(o.created_at)),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM b.applied_at - o.created_at)),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM b.applied_at - o.created_at))
  FROM integration_outbox o JOIN n8n_business_effects b ON b.event_key = o.event_key
 WHERE starts_with(o.event_key, $1)`, prefix).Scan(&span, &p50, &p99)
	if err != nil {
		return l, fmt.Errorf("measure latency: %w", err)
	}
	var n int64
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM n8n_business_effects WHERE starts_with(event_key, $1)`, prefix).Scan(&n); err != nil {
		return l, err
	}
	if span > 0 {
		l.Rate = float64(n) / span
	}
	l.P50 = time.Duration(p50 * float64(time.Second))
	l.P99 = time.Duration(p99 * float64(time.Second))
	return l, nil
}

// allAppliedBatched: every event applied and its claim done; a batched
// execution carries many events, so executions are not counted.
func allAppliedBatched(n int) func(snapshot) bool {
	return func(s snapshot) bool { return s.db.Applied == int64(n) && s.db.ClaimsDone == int64(n) }
}

// batchBulk: N events to the batched sink, published as fast as one
// connection writes them; each applied once. Reports the rate and the
// commit-to-effect latencies.
func (e *e2e) batchBulk(ctx context.Context) result {
	r := result{Name: "5 batched bulk", Events: e.opts.batchEvents, Batched: true}
	const prefix = "e2e-s5-"
	base, err := e.n8n.Executions(ctx)
	if err != nil {
		r.Err = err
		return r
	}
	e.say("scenario 5: publishing %d events for the batched sink (max_events %d, concurrency %d)", r.Events, e.opts.batchMax, e.opts.batchConcurrency)
	started := time.Now()
	if err := publish(ctx, e.pool, makeEvents(prefix, "batch.bulk", r.Events)); err != nil {
		r.Err = err
		return r
	}
	s, werr := e.settle(ctx, prefix, base, allAppliedBatched(r.Events))
	e.fill(ctx, &r, prefix, s, werr, started)
	e.noteLatency(ctx, &r, prefix)
	return r
}

// noteLatency adds the scenario's measured rate and latencies to its note.
func (e *e2e) noteLatency(ctx context.Context, r *result, prefix string) {
	if r.Err != nil {
		return
	}
	l, err := e.measureLatency(ctx, prefix)
	if err != nil {
		r.Err = err
		return
	}
	note := l.String()
	if r.Batched && r.Executions > 0 {
		note += fmt.Sprintf("; %.1f events per execution", float64(r.Effects)/float64(r.Executions))
	}
	r.Note = strings.TrimPrefix(r.Note+"; "+note, "; ")
}

// batchHotAggregates: scenario 5 with the events over -aggregates
// aggregates: with batch.ordered a batch carries several events of one
// aggregate, so the rate stays near scenario 5's instead of being capped
// by one event per aggregate per request. Each applied once, in order.
func (e *e2e) batchHotAggregates(ctx context.Context) result {
	r := result{Name: fmt.Sprintf("8 batched bulk, %d aggregates", e.opts.aggregates), Events: e.opts.batchEvents, Batched: true}
	const prefix = "e2e-s8-"
	base, err := e.n8n.Executions(ctx)
	if err != nil {
		r.Err = err
		return r
	}
	e.say("scenario 8: publishing %d events over %d aggregates for the batched sink (max_events %d, concurrency %d, ordered %t)",
		r.Events, e.opts.aggregates, e.opts.batchMax, e.opts.batchConcurrency, e.opts.batchOrdered)
	started := time.Now()
	if err := publish(ctx, e.pool, makeEventsOver(prefix, "batch.hot", r.Events, e.opts.aggregates)); err != nil {
		r.Err = err
		return r
	}
	s, werr := e.settle(ctx, prefix, base, allAppliedBatched(r.Events))
	e.fill(ctx, &r, prefix, s, werr, started)
	e.noteLatency(ctx, &r, prefix)
	return r
}

// batchRestart: events over -aggregates aggregates published over 12 s to
// the batched sink while n8n is stopped (SIGTERM) after 3 s and started
// again: every event applied exactly once and in order, none lost.
func (e *e2e) batchRestart(ctx context.Context) result {
	r := result{Name: "6 batched, n8n restarted", Events: max(e.opts.batchEvents/4, 10), Batched: true}
	const prefix = "e2e-s6-"
	base, err := e.n8n.Executions(ctx)
	if err != nil {
		r.Err = err
		return r
	}
	evs := makeEventsOver(prefix, "batch.restart", r.Events, e.opts.aggregates)
	started := time.Now()
	pubDone := make(chan error, 1)
	go func() { pubDone <- e.publishPaced(ctx, evs, 12*time.Second) }()
	fail := func(err error) result {
		<-pubDone
		r.Took, r.Err = time.Since(started), err
		return r
	}
	select {
	case <-ctx.Done():
		return fail(ctx.Err())
	case <-time.After(3 * time.Second):
	}
	e.say("scenario 6: stopping n8n (SIGTERM to pid %d) while batches are in flight", e.n8n.proc.Pid())
	stopTook, err := e.n8n.Stop()
	if err != nil {
		return fail(err)
	}
	if err := e.n8n.Deploy(ctx, true); err != nil {
		return fail(err)
	}
	startTook, err := e.n8n.Start(ctx, true)
	if err != nil {
		return fail(err)
	}
	e.say("scenario 6: n8n back (stop %s, start %s)", stopTook.Round(100*time.Millisecond), startTook.Round(100*time.Millisecond))
	if err := <-pubDone; err != nil {
		r.Took, r.Err = time.Since(started), err
		return r
	}
	s, werr := e.settle(ctx, prefix, base, allAppliedBatched(r.Events))
	r.Note = fmt.Sprintf("n8n stopped after 3 s (SIGTERM %s) and started again (%s)", stopTook.Round(100*time.Millisecond), startTook.Round(time.Second))
	e.fill(ctx, &r, prefix, s, werr, started)
	return r
}

// failOnceSQL makes the placeholder business step fail on the first try for
// events of type batch.failonce: each has a sequence, whose nextval is not
// rolled back with the failed INSERT, so the second try succeeds.
const failOnceSQL = `
CREATE OR REPLACE FUNCTION e2e_fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.event_type = 'batch.failonce'
     AND nextval(('e2e_fail_' || md5(NEW.event_key))::regclass) = 1 THEN
    RAISE EXCEPTION 'e2e: the business step fails once for %', NEW.event_key;
  END IF;
  RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS e2e_fail_once ON n8n_business_effects;
CREATE TRIGGER e2e_fail_once BEFORE INSERT ON n8n_business_effects
  FOR EACH ROW EXECUTE FUNCTION e2e_fail_once();`

// batchFailing: one event in every max_events fails its business step on
// the first try; the events fall on -aggregates aggregates. The workflow
// answers it retry (releasing its claim), the later events of its aggregate
// in the same batch retry too, not applied, and the rest of the batch ok;
// the relay sends the failing event again, and those later events after it.
// Every event is applied exactly once and in order, each failing event was
// tried exactly twice, and with batch.ordered some batch answered an
// aggregate's later events "not applied".
func (e *e2e) batchFailing(ctx context.Context) result {
	r := result{Name: "7 batched, one failing event per batch", Events: max(e.opts.batchEvents/4, 10), Batched: true}
	const prefix = "e2e-s7-"
	base, err := e.n8n.Executions(ctx)
	if err != nil {
		r.Err = err
		return r
	}
	stoppedBefore, err := e.n8n.ExecutionsContaining(ctx, notAppliedAnswer)
	if err != nil {
		r.Err = err
		return r
	}
	evs := makeEventsOver(prefix, "batch.bulk", r.Events, e.opts.aggregates)
	var failing []string
	for i := range evs {
		if i%e.opts.batchMax == e.opts.batchMax/2 {
			evs[i].Type = "batch.failonce"
			failing = append(failing, evs[i].Key)
		}
	}
	for _, key := range failing {
		if _, err := e.pool.Exec(ctx, fmt.Sprintf(`CREATE SEQUENCE IF NOT EXISTS "e2e_fail_%x"`, md5sum(key))); err != nil {
			r.Err = err
			return r
		}
	}
	if _, err := e.pool.Exec(ctx, failOnceSQL); err != nil {
		r.Err = fmt.Errorf("install the failing step: %w", err)
		return r
	}
	defer func() {
		_, _ = e.pool.Exec(context.WithoutCancel(ctx), `DROP TRIGGER IF EXISTS e2e_fail_once ON n8n_business_effects`)
	}()
	e.say("scenario 7: publishing %d events, %d of them (one in %d) failing their business step once", r.Events, len(failing), e.opts.batchMax)
	started := time.Now()
	if err := publish(ctx, e.pool, evs); err != nil {
		r.Err = err
		return r
	}
	s, werr := e.settle(ctx, prefix, base, allAppliedBatched(r.Events))
	e.fill(ctx, &r, prefix, s, werr, started)
	if r.Err != nil {
		return r
	}
	var tries []int64
	for _, key := range failing {
		var n int64
		if err := e.pool.QueryRow(ctx, fmt.Sprintf(`SELECT last_value FROM "e2e_fail_%x"`, md5sum(key))).Scan(&n); err != nil {
			r.Err = err
			return r
		}
		tries = append(tries, n)
	}
	for i, n := range tries {
		if n != 2 {
			r.Err = fmt.Errorf("failing event %s reached its business step %d times, want 2 (fail, then the relay's retry of that event alone)", failing[i], n)
			return r
		}
	}
	// The ledger counts each event's attempts: the others of the failing
	// events' batches must have needed one.
	var retriedOthers, maxOthers int64
	if err := e.pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE attempts > 1), COALESCE(max(attempts), 0)
  FROM integration_idempotency
 WHERE action = $1 AND starts_with(event_key, $2) AND event_key <> ALL($3)`, batchSinkName, prefix, failing).Scan(&retriedOthers, &maxOthers); err != nil {
		r.Err = err
		return r
	}
	if retriedOthers > 0 {
		r.Err = fmt.Errorf("%d events that did not fail were attempted more than once: a failing event failed its whole batch", retriedOthers)
		return r
	}
	stopped, err := e.n8n.ExecutionsContaining(ctx, notAppliedAnswer)
	if err != nil {
		r.Err = err
		return r
	}
	stopped -= stoppedBefore
	if e.opts.batchOrdered && stopped == 0 {
		r.Err = fmt.Errorf("no execution answered %q: no batch carried an event after a failing one of its aggregate, so the ordered-batch contract was not exercised", notAppliedAnswer)
		return r
	}
	r.Note = fmt.Sprintf("%d events failed once and were tried twice; %d executions answered later events of their aggregate %q; the ledger's most attempts of any other event: %d",
		len(failing), stopped, notAppliedAnswer, maxOthers)
	e.noteLatency(ctx, &r, prefix)
	return r
}

// notAppliedAnswer starts the workflow's message for an event it did not
// apply because an earlier event of its aggregate in the batch was not.
const notAppliedAnswer = "not applied: an earlier event of its aggregate in this batch was not applied"

// md5sum is PostgreSQL's md5() of s, as bytes.
func md5sum(s string) [16]byte { return md5.Sum([]byte(s)) }
