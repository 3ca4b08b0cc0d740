package main

import (
	"context"
	"fmt"
	"time"
)

// phaseSteadyAfterDrain starts the relay with -backlog events queued and,
// the moment the last of them has arrived at both sinks, starts -rate
// events/s for -duration: the latency of new events while the relay is
// still writing back the backlog (settling its ledger rows and statuses).
// The bare pglogrepl client decodes the same events beside it, on its own
// slot created after the backlog (so it does not decode the backlog).
func phaseSteadyAfterDrain(ctx context.Context, e *env, r *report) error {
	const phase, db = "steady-after-drain", "bench_steady_after_drain"
	s := relaySetup{name: phase, webhook: true}
	cfg, done, err := e.setUpRelay(ctx, db, &s)
	if err != nil {
		return err
	}
	defer done()
	url := s.url
	e.say("%s: creating slot %s (start the relay, stop it with SIGTERM)", phase, s.slot())
	if err := e.createSlot(ctx, s, cfg); err != nil {
		return err
	}
	n := e.o.backlog
	backlog := newTracker("sad-b-", n)
	t := newTracker("sad-", int(e.o.rate*e.o.duration.Seconds()))
	e.recv.cur.Store(backlog)
	defer e.recv.cur.Store(nil)
	subBacklog, err := e.subscribe(s, backlog)
	if err != nil {
		return err
	}
	defer subBacklog.Unsubscribe()
	sub, err := e.subscribe(s, t)
	if err != nil {
		return err
	}
	defer sub.Unsubscribe()
	e.say("%s: inserting a backlog of %d rows (%d per transaction) with the relay stopped", phase, n, e.o.drainBatch)
	if err := e.bulkInsert(ctx, url, backlog.prefix, n, e.o.drainBatch, 4); err != nil {
		return err
	}
	f, err := e.startFloor(ctx, url, "bench_floor_after_drain", t, &t.floor)
	if err != nil {
		return err
	}
	defer f.close()
	pool, err := e.newLoadPool(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := e.quiet(ctx, phase, r, e.roots(nil)); err != nil {
		return err
	}
	e.say("%s: starting the relay; the load starts when the backlog has arrived at both sinks", phase)
	rp, err := e.startRelay(s, cfg)
	if err != nil {
		return err
	}
	defer rp.Stop(30 * time.Second)
	meter := startCPU(e.roots(rp))
	start := time.Now()
	lastProgress, lastCount := start, int64(0)
	for backlog.nats.unique.Load() < int64(n) || backlog.hook.unique.Load() < int64(n) {
		if progress := backlog.nats.unique.Load() + backlog.hook.unique.Load(); progress > lastCount {
			lastProgress, lastCount = time.Now(), progress
		}
		if rp.Exited() {
			return rp.Failure()
		}
		if time.Since(lastProgress) > 60*time.Second {
			return fmt.Errorf("backlog: no progress for 60 s: NATS %d of %d, webhook %d (log %s)", backlog.nats.unique.Load(), n, backlog.hook.unique.Load(), rp.LogPath())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	drained := time.Since(start)
	drainedAt := time.Now()
	drainUsage := meter.stop()
	e.recv.cur.Store(t)
	var gap time.Duration
	waitProfile := func() {}
	defer func() { waitProfile() }()
	o, err := e.loadWindow(ctx, pool, loadPlan{name: phase, url: url, t: t, relay: rp, nats: true, hook: true, floor: true,
		duration: e.o.duration, settle: 30 * time.Second, onStart: func() {
			gap = time.Since(drainedAt)
			waitProfile = e.profileCPU(s.httpPort, phase, e.o.duration)
		}})
	if err != nil {
		return err
	}
	e.saySeries(phase, t)
	r.add(phase, fmt.Sprintf("backlog: relay started with %s events queued → JetStream + webhook", thousands(n)),
		fmt.Sprintf("all at both sinks after %.2f s (%s events/s); the load started %s later; %s", drained.Seconds(), thousands(int(float64(n)/drained.Seconds())),
			gap.Round(time.Millisecond), cpuPerEvent(drainUsage, n)), "", "info", drainUsage)
	r.add(phase, "load right after the drain (relay: replication, JetStream + webhook)", loadSummary(e, o, true, true), "", "info", o.usage)
	addLatencies(r, phase, "commit→NATS arrival", o.nats, o.natsMissing, o.usage, true)
	addLatencies(r, phase, "commit→webhook 2xx", o.hook, o.hookMissing, o.usage, true)
	first := min(5*time.Second, e.o.duration)
	r.add(phase, fmt.Sprintf("events committed in the first %.0f s of the load: p99 NATS / webhook / floor", first.Seconds()),
		fmt.Sprintf("%s / %s / %s", fmtMS(percentile(t.latenciesWithin(&t.nats, first), 0.99)), fmtMS(percentile(t.latenciesWithin(&t.hook, first), 0.99)),
			fmtMS(percentile(t.latenciesWithin(&t.floor, first), 0.99))), "—", "info", o.usage)
	addFloor(r, phase, o, true)
	addCPUPerEvent(r, e, phase, o, true)
	r.addCPU(phase+" (backlog)", drainUsage, "")
	r.addCPU(phase, o.usage, "")
	if err := f.close(); err != nil {
		e.say("warning: %v", err)
	}
	if err := rp.Stop(30 * time.Second); err != nil {
		e.say("warning: %v", err)
	}
	return nil
}
