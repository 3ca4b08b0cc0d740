package main

import (
	"context"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// The claim path at volume (docs/performance.md "The claim path at
// volume"): drain-claim times poll mode draining a backlog over few and
// over many aggregates; slot-recreated times a backlog written behind a
// slot the relay did not create, while fresh events arrive.

// claimOptions are the claim phases' flags.
var claimOptions struct {
	n            int
	hotAggs      int
	manyAggs     int
	freshTimeout time.Duration
}

// claimFlags registers the claim phases' flags on fs.
func claimFlags(fs *flag.FlagSet) {
	fs.IntVar(&claimOptions.n, "claim-n", 200000, "rows for drain-claim and slot-recreated")
	fs.IntVar(&claimOptions.hotAggs, "claim-hot-aggregates", 50, "drain-claim: the aggregates of the hot run")
	fs.IntVar(&claimOptions.manyAggs, "claim-many-aggregates", 5000, "drain-claim: the aggregates of the spread run")
	fs.DurationVar(&claimOptions.freshTimeout, "claim-drain-timeout", 10*time.Minute, "longest wait for a claim phase's backlog to drain")
}

// insertOver inserts events [0, n) with prefix over aggs aggregates (ids
// aggPrefix0 …), 1,000 rows per statement, from four connections.
func (e *env) insertOver(ctx context.Context, url, prefix string, n, aggs int, aggPrefix string) error {
	sql := strings.Replace(bulkInsertSQL, "(g % $3)::text", pgQuote(aggPrefix)+" || (g % $3)", 1)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["application_name"] = benchAppName + " load"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	const per = 1000
	sem := make(chan struct{}, 4)
	errs := make(chan error, (n+per-1)/per)
	for from := 0; from < n; from += per {
		sem <- struct{}{}
		go func(from int) {
			defer func() { <-sem }()
			if _, err := pool.Exec(ctx, sql, from, min(from+per, n)-1, aggs, prefix, e.o.payloadSize); err != nil {
				errs <- err
			}
		}(from)
	}
	for range cap(sem) {
		sem <- struct{}{}
	}
	close(errs)
	return <-errs
}

// waitBacklog waits until t has n arrivals at JetStream, and returns how
// long that took from start.
func (e *env) waitBacklog(ctx context.Context, phase string, t *tracker, n int, rp *harness.Relay, start time.Time) (time.Duration, error) {
	lastSay := start
	for {
		got := t.nats.unique.Load()
		if got >= int64(n) {
			return time.Since(start), nil
		}
		if rp.Exited() {
			return 0, rp.Failure()
		}
		if time.Since(start) > claimOptions.freshTimeout {
			return 0, fmt.Errorf("%s: %d of %d delivered after %s (log %s)", phase, got, n, claimOptions.freshTimeout, rp.LogPath())
		}
		if time.Since(lastSay) >= 5*time.Second {
			lastSay = time.Now()
			e.say("%s: %.0f s: %d/%d", phase, time.Since(start).Seconds(), got, n)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// pgQuote quotes s as an SQL string literal.
func pgQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// claimDrain times poll mode draining n rows over aggs aggregates into
// JetStream.
func (e *env) claimDrain(ctx context.Context, r *report, aggs int) (time.Duration, error) {
	name := fmt.Sprintf("drain-claim-%d", aggs)
	s := relaySetup{name: name, mode: "poll"}
	cfg, done, err := e.setUpRelay(ctx, "bench_"+fmt.Sprintf("drain_claim_%d", aggs), &s)
	if err != nil {
		return 0, err
	}
	defer done()
	n := claimOptions.n
	t := newTracker(name+"-", n)
	sub, err := e.subscribe(s, t)
	if err != nil {
		return 0, err
	}
	defer sub.Unsubscribe()
	e.say("%s: inserting %d rows over %d aggregates with the relay stopped", name, n, aggs)
	if err := e.insertOver(ctx, s.url, t.prefix, n, aggs, ""); err != nil {
		return 0, err
	}
	if err := e.quiet(ctx, name, r, e.roots(nil)); err != nil {
		return 0, err
	}
	rp, err := e.startRelay(s, cfg)
	if err != nil {
		return 0, err
	}
	defer rp.Stop(30 * time.Second)
	meter := startCPU(e.roots(rp))
	took, err := e.waitBacklog(ctx, name, t, n, rp, time.Now())
	u := meter.stop()
	if err != nil {
		return 0, err
	}
	r.addCPU(name, u, "")
	r.add("drain-claim", fmt.Sprintf("poll mode drains %s rows over %s aggregates → JetStream", thousands(n), thousands(aggs)),
		fmt.Sprintf("%s rows/s (%.1f s); %s", thousands(int(float64(n)/took.Seconds())), took.Seconds(), cpuPerEvent(u, n)), "", "info", u)
	return took, nil
}

// phaseDrainClaim: poll mode drains -claim-n rows over -claim-hot-aggregates
// and over -claim-many-aggregates aggregates.
func phaseDrainClaim(ctx context.Context, e *env, r *report) error {
	hot, err := e.claimDrain(ctx, r, claimOptions.hotAggs)
	if err != nil {
		return err
	}
	many, err := e.claimDrain(ctx, r, claimOptions.manyAggs)
	if err != nil {
		return err
	}
	n := float64(claimOptions.n)
	hotRate, manyRate := n/hot.Seconds(), n/many.Seconds()
	r.add("drain-claim", fmt.Sprintf("%d aggregates: rows/s", claimOptions.hotAggs), thousands(int(hotRate)), "≥ 5,000", passMiss(hotRate >= 5000), cpuUsage{})
	r.add("drain-claim", fmt.Sprintf("%d aggregates against %d: rate ratio", claimOptions.hotAggs, claimOptions.manyAggs),
		fmt.Sprintf("%.2f", hotRate/manyRate), "≥ 0.50", passMiss(hotRate/manyRate >= 0.5), cpuUsage{})
	return nil
}

// phaseSlotRecreated: -claim-n rows are written behind a slot created with
// pg_create_logical_replication_slot (no hand-over record), then the relay
// starts while fresh events arrive at -rate: the time until every backlog
// row is delivered, against the stream's drain of the same rows, and the
// fresh events' latency meanwhile. The same rows behind the relay's own
// slot with the same fresh load beside them tell what the stream itself
// does in the phase's conditions (an info row: the target stays against
// the stream's drain alone).
func phaseSlotRecreated(ctx context.Context, e *env, r *report) error {
	const name = "slot-recreated"
	n := claimOptions.n

	// The stream's drain of the same rows, behind the relay's own slot.
	streamDB := "bench_slot_recreated_stream"
	url, err := e.newDatabase(ctx, streamDB)
	if err != nil {
		return err
	}
	ss := relaySetup{name: name + "-stream", url: url}
	d, err := e.drain(ctx, r, ss, n, 100, 4)
	e.deleteStream(ss.stream())
	e.dropDatabase(streamDB)
	if err != nil {
		return err
	}
	streamTook := d.elapsed

	// The same behind the relay's own slot, with the fresh load beside it.
	loaded, err := e.backlogUnderLoad(ctx, r, name+"-stream-loaded", "bench_slot_recreated_loaded", false)
	if err != nil {
		return err
	}
	r.addCPU(name+" (the stream, loaded)", loaded.usage, "")

	o, err := e.backlogUnderLoad(ctx, r, name, "bench_slot_recreated", true)
	if err != nil {
		return err
	}
	r.addCPU(name, o.usage, "")
	ratio := o.took.Seconds() / streamTook.Seconds()
	r.add(name, fmt.Sprintf("%s rows behind a slot without the relay's hand-over record: all delivered (fresh events at %s/s meanwhile)", thousands(n), thousands(int(e.o.rate))),
		fmt.Sprintf("%.1f s; the stream drains the same rows in %.1f s: %.2f×", o.took.Seconds(), streamTook.Seconds(), ratio), "≤ 2× the stream", passMiss(ratio <= 2), o.usage)
	r.add(name, "fresh events meanwhile (other aggregates than the backlog's): commit→NATS p50 / p99", fmt.Sprintf("%s / %s (%s arrived, %d missing)", fmtMS(percentile(o.fresh, 0.5)), fmtMS(percentile(o.fresh, 0.99)), thousands(len(o.fresh)), o.missing),
		"p99 < 1 s", passMiss(percentile(o.fresh, 0.99) < 1000 && o.missing == 0), o.usage)
	r.add(name, "the relay's start: launch → streaming from the new slot; fresh events committed before it, and after it: p50 / p99",
		fmt.Sprintf("%.2f s; before: %s / %s (%s); after: %s / %s (%s)", o.streaming.Seconds(),
			fmtMS(percentile(o.freshBefore, 0.5)), fmtMS(percentile(o.freshBefore, 0.99)), thousands(len(o.freshBefore)),
			fmtMS(percentile(o.freshStreamed, 0.5)), fmtMS(percentile(o.freshStreamed, 0.99)), thousands(len(o.freshStreamed))), "—", "info", o.usage)
	r.add(name, "the same rows behind the relay's own slot, with the same fresh load: all delivered; fresh p50 / p99",
		fmt.Sprintf("%.1f s (%.2f× the stream's drain alone; the phase took %.2f× this); %s / %s (%s arrived, %d missing)", loaded.took.Seconds(), loaded.took.Seconds()/streamTook.Seconds(),
			o.took.Seconds()/loaded.took.Seconds(), fmtMS(percentile(loaded.fresh, 0.5)), fmtMS(percentile(loaded.fresh, 0.99)), thousands(len(loaded.fresh)), loaded.missing), "—", "info", loaded.usage)
	return nil
}

// backlogOutcome is what backlogUnderLoad measured.
type backlogOutcome struct {
	took    time.Duration // relay start → every backlog row at JetStream
	fresh   []float64     // the fresh events' commit→NATS, sorted, ms
	missing int           // fresh events not arrived
	usage   cpuUsage

	// The relay's start: from its launch until it streamed from the slot
	// (0 when not seen), and the fresh events committed before and after.
	streaming                  time.Duration
	freshBefore, freshStreamed []float64
}

// backlogUnderLoad writes -claim-n rows over -aggregates aggregates behind
// a slot — one made with pg_create_logical_replication_slot, without the
// relay's hand-over record (foreign), or the relay's own — and starts the
// relay while fresh events on other aggregates arrive at -rate, until every
// backlog row is at JetStream.
func (e *env) backlogUnderLoad(ctx context.Context, r *report, name, db string, foreign bool) (backlogOutcome, error) {
	var o backlogOutcome
	n := claimOptions.n
	s := relaySetup{name: name}
	cfg, done, err := e.setUpRelay(ctx, db, &s)
	if err != nil {
		return o, err
	}
	defer done()
	if foreign {
		conn, err := pgx.Connect(ctx, s.url)
		if err != nil {
			return o, err
		}
		_, err = conn.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, s.slot())
		conn.Close(context.Background())
		if err != nil {
			return o, fmt.Errorf("create the foreign slot: %w", err)
		}
	} else {
		e.say("%s: creating slot %s (start the relay, stop it with SIGTERM)", name, s.slot())
		if err := e.createSlot(ctx, s, cfg); err != nil {
			return o, err
		}
	}
	backlog := newTracker(name+"-", n)
	sub, err := e.subscribe(s, backlog)
	if err != nil {
		return o, err
	}
	defer sub.Unsubscribe()
	// The backlog's aggregates are not the fresh events': a fresh event of
	// an aggregate with rows in the backlog waits for them (per-aggregate
	// order), whatever the claim path's speed.
	e.say("%s: inserting %d rows behind slot %s (foreign: %v)", name, n, s.slot(), foreign)
	if err := e.insertOver(ctx, s.url, backlog.prefix, n, e.o.aggregates, "backlog-"); err != nil {
		return o, err
	}
	fresh := newTracker(name+"-fresh-", int(e.o.rate*claimOptions.freshTimeout.Seconds()))
	freshSub, err := e.subscribe(s, fresh)
	if err != nil {
		return o, err
	}
	defer freshSub.Unsubscribe()
	pool, err := e.newLoadPool(ctx, s.url)
	if err != nil {
		return o, err
	}
	defer pool.Close()
	if err := e.quiet(ctx, name, r, e.roots(nil)); err != nil {
		return o, err
	}
	rp, err := e.startRelay(s, cfg)
	if err != nil {
		return o, err
	}
	defer rp.Stop(30 * time.Second)
	start := time.Now()
	meter := startCPU(e.roots(rp))
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	streamingAt := make(chan time.Time, 1)
	go func() { // when the relay streams from the slot (the foreign one is never active)
		defer close(streamingAt)
		conn, err := pgx.Connect(loadCtx, s.url)
		if err != nil {
			return
		}
		defer conn.Close(context.Background())
		for loadCtx.Err() == nil {
			if active, err := harness.SlotStreaming(loadCtx, conn, s.slot()); err == nil && active {
				streamingAt <- time.Now()
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	loaded := make(chan error, 1)
	go func() {
		_, err := e.runLoad(loadCtx, pool, "", fresh, e.o.rate, claimOptions.freshTimeout)
		loaded <- err
	}()
	o.took, err = e.waitBacklog(ctx, name, backlog, n, rp, start)
	stopLoad()
	<-loaded
	o.usage = meter.stop()
	if err != nil {
		return o, err
	}
	// The fresh events committed while the backlog drained: wait for them.
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if _, missing := fresh.latencies(&fresh.nats); missing == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	o.fresh, o.missing = fresh.latencies(&fresh.nats)
	if at, ok := <-streamingAt; ok {
		o.streaming = at.Sub(start)
		o.freshBefore, o.freshStreamed = fresh.latenciesSplit(&fresh.nats, int64(at.Sub(e.base))+1)
	}
	e.saySeries(name+" fresh", fresh)
	return o, nil
}
