package main

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// allPhases are the phases in the order they run.
var allPhases = []string{"ceiling", "drain-js", "drain-both", "drain-both-batched", "floor", "steady-js", "steady", "steady-after-drain", "write-back", "poller", "pollmode", "rss-queued", "rss-bigtx", "drain-claim", "slot-recreated", "verify", "payload-sizes", "filter"}

// extraPhases run only when -phases names them.
var extraPhases = []string{"partitions", "standby", "floor-pair", "large-payloads"}

func isPhase(p string) bool {
	for _, q := range append(allPhases, extraPhases...) {
		if p == q {
			return true
		}
	}
	return false
}

// phaseFuncs maps each phase to its function.
var phaseFuncs = map[string]func(context.Context, *env, *report) error{
	"ceiling":            phaseCeiling,
	"drain-js":           func(ctx context.Context, e *env, r *report) error { return phaseDrain(ctx, e, r, false) },
	"drain-both":         func(ctx context.Context, e *env, r *report) error { return phaseDrain(ctx, e, r, true) },
	"drain-both-batched": phaseDrainBothBatched,
	"floor":              phaseFloor,
	"steady-js":          func(ctx context.Context, e *env, r *report) error { return phaseSteady(ctx, e, r, false) },
	"steady":             func(ctx context.Context, e *env, r *report) error { return phaseSteady(ctx, e, r, true) },
	"steady-after-drain": phaseSteadyAfterDrain,
	"write-back":         phaseWriteBack,
	"poller":             phasePoller,
	"pollmode":           phasePollMode,
	"rss-queued":         func(ctx context.Context, e *env, r *report) error { return phaseRSS(ctx, e, r, false) },
	"rss-bigtx":          func(ctx context.Context, e *env, r *report) error { return phaseRSS(ctx, e, r, true) },
	"partitions":         phasePartitions,
	"standby":            phaseStandby,
	"floor-pair":         phaseFloorPair,     // floor.go
	"drain-claim":        phaseDrainClaim,    // claim.go
	"slot-recreated":     phaseSlotRecreated, // claim.go
	"verify":             phaseVerify,        // verify.go
	"payload-sizes":      phasePayloadSizes,  // payloads.go
	"large-payloads":     phaseLargePayloads, // largepayloads.go
	"filter":             phaseFilter,        // filter.go
}

// quiet waits for a quiet machine before a measured window and says so.
func (e *env) quiet(ctx context.Context, phase string, r *report, roots cpuGroups) error {
	others, waited, err := waitQuiet(ctx, roots, e.o.quiet, e.o.quietWait)
	if err != nil {
		return err
	}
	note := fmt.Sprintf("%s: waited %.0f s for a quiet machine; other processes then used %.2f cores", phase, waited.Seconds(), others)
	if others >= e.o.quiet {
		note += fmt.Sprintf(" (above the %.2f threshold: measured anyway)", e.o.quiet)
	}
	e.say("%s", note)
	r.notes = append(r.notes, note)
	return nil
}

// counter counts the bytes written to it.
type counter struct{ n atomic.Int64 }

func (c *counter) Write(p []byte) (int, error) { c.n.Add(int64(len(p))); return len(p), nil }

// ceilingRun is one pg_recvlogical drain.
type ceilingRun struct {
	elapsed time.Duration
	out     int64 // bytes pg_recvlogical wrote
	usage   cpuUsage
}

// phaseCeiling times pg_recvlogical draining -n rows through pgoutput,
// -ceiling-runs times: one slot per run, all created before the rows are
// inserted, so every run decodes the same WAL. It reports the median run.
func phaseCeiling(ctx context.Context, e *env, r *report) error {
	const phase, db = "ceiling", "bench_ceiling"
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return err
	}
	defer e.dropDatabase(db)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	runs := max(e.o.ceilingRuns, 1)
	slot := func(i int) string { return fmt.Sprintf("bench_ceiling_%d", i) }
	for i := range runs {
		if _, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot(i)); err != nil {
			return err
		}
	}
	n := e.o.n
	e.say("%s: inserting %d rows (%d per transaction) after creating %d slots", phase, n, e.o.drainBatch, runs)
	if err := e.bulkInsert(ctx, url, "ce-", n, e.o.drainBatch, 4); err != nil {
		return err
	}
	var endLSN string
	var walBytes int64
	if err := conn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
		FROM pg_replication_slots WHERE slot_name = $1`, slot(0)).Scan(&endLSN, &walBytes); err != nil {
		return err
	}
	var results []ceilingRun
	for i := range runs {
		if err := e.quiet(ctx, fmt.Sprintf("%s run %d", phase, i+1), r, e.roots(nil)); err != nil {
			return err
		}
		e.say("%s: pg_recvlogical --slot %s --start --endpos %s (%.1f MB of WAL)", phase, slot(i), endLSN, float64(walBytes)/1e6)
		c, err := e.recvlogical(ctx, url, slot(i), endLSN)
		if err != nil {
			return err
		}
		e.say("%s: run %d: %.0f rows/s", phase, i+1, float64(n)/c.elapsed.Seconds())
		results = append(results, c)
	}
	slices.SortFunc(results, func(a, b ceilingRun) int { return cmp.Compare(a.elapsed, b.elapsed) })
	med := results[len(results)/2]
	rate := float64(n) / med.elapsed.Seconds()
	r.ceiling = rate
	all := make([]string, len(results))
	for i, c := range results {
		all[i] = thousands(int(float64(n) / c.elapsed.Seconds()))
	}
	r.add(phase, fmt.Sprintf("pg_recvlogical drain of %s rows (pgoutput), median of %d", thousands(n), runs),
		fmt.Sprintf("%s rows/s (%.2f s; %.0f MB/s of WAL, %.1f MB output; runs, fastest first: %s rows/s); CPU per row: PostgreSQL (the walsender) %.1f µs, pg_recvlogical %.1f µs",
			thousands(int(rate)), med.elapsed.Seconds(), float64(walBytes)/1e6/med.elapsed.Seconds(), float64(med.out)/1e6, strings.Join(all, ", "),
			med.usage.groups["postgres"]*med.usage.wall.Seconds()/float64(n)*1e6, med.usage.groups["reaped"]*med.usage.wall.Seconds()/float64(n)*1e6),
		"reference ~87,000 rows/s", "ceiling", med.usage)
	r.addCPU(phase, med.usage, "pg_recvlogical")
	return nil
}

// recvlogical runs pg_recvlogical on slot until it reaches endLSN.
func (e *env) recvlogical(ctx context.Context, url, slot, endLSN string) (ceilingRun, error) {
	var c ceilingRun
	rctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	argv := e.place.command(filepath.Join(e.bin, "pg_recvlogical"),
		"--dbname", url, "--slot", slot, "--start", "--endpos", endLSN, "--no-loop",
		"-o", "proto_version=1", "-o", "publication_names=outbox_relay", "-f", "-")
	cmd := exec.CommandContext(rctx, argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: serverCredential(), Pdeathsig: syscall.SIGKILL}
	var out counter
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	meter := startCPU(e.roots(nil))
	start := time.Now()
	if err := cmd.Run(); err != nil {
		return c, fmt.Errorf("pg_recvlogical: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	c.elapsed = time.Since(start)
	c.usage = meter.stop()
	c.out = out.n.Load()
	return c, nil
}

// drainOutcome is what a relay drain measured.
type drainOutcome struct {
	elapsed time.Duration // relay start → every event delivered
	first   time.Duration // relay start → the first event delivered
	usage   cpuUsage
	peak    int64 // bytes: max(VmHWM, sampled VmRSS)
	maxRSS  int64
}

// drain creates the relay's slot, inserts n rows with the relay stopped (per
// rows per statement, from parallel connections), starts it and waits until
// all n are delivered, sampling its CPU and RSS.
func (e *env) drain(ctx context.Context, r *report, s relaySetup, n, per, parallel int) (drainOutcome, error) {
	var d drainOutcome
	cfg, err := e.writeConfig(s)
	if err != nil {
		return d, err
	}
	e.say("%s: creating slot %s (start the relay, stop it with SIGTERM)", s.name, s.slot())
	if err := e.createSlot(ctx, s, cfg); err != nil {
		return d, err
	}
	t := newTracker(s.name+"-", n)
	e.recv.cur.Store(t)
	defer e.recv.cur.Store(nil)
	e.say("%s: inserting %d rows (%d per transaction) with the relay stopped", s.name, n, per)
	if err := e.bulkInsert(ctx, s.url, t.prefix, n, per, parallel); err != nil {
		return d, err
	}
	if err := e.quiet(ctx, s.name, r, e.roots(nil)); err != nil {
		return d, err
	}
	e.say("%s: starting the relay and timing the drain", s.name)
	rp, err := e.startRelay(s, cfg)
	if err != nil {
		return d, err
	}
	defer rp.Stop(30 * time.Second)
	meter := startCPU(e.roots(rp))
	rss := sampleRSS(rp.Pid())
	start := time.Now()
	lastProgress, lastCount := start, uint64(0)
	lastSay := start
	for {
		msgs, err := e.streamMsgs(ctx, s.stream())
		if err != nil {
			return d, err
		}
		hooks := uint64(t.hook.unique.Load())
		progress := msgs
		if s.webhook {
			progress += hooks
		}
		if d.first == 0 && progress > 0 {
			d.first = time.Since(start)
		}
		if msgs >= uint64(n) && (!s.webhook || hooks >= uint64(n)) {
			d.elapsed = time.Since(start)
			break
		}
		if progress > lastCount {
			lastProgress, lastCount = time.Now(), progress
		}
		if rp.Exited() {
			return d, rp.Failure()
		}
		if time.Since(lastProgress) > 60*time.Second {
			return d, fmt.Errorf("no progress for 60 s: JetStream holds %d of %d, webhook got %d (log %s)", msgs, n, hooks, rp.LogPath())
		}
		if time.Since(lastSay) >= 5*time.Second {
			lastSay = time.Now()
			e.say("%s: %.0f s: JetStream %d/%d, webhook %d", s.name, time.Since(start).Seconds(), msgs, n, hooks)
		}
		select {
		case <-ctx.Done():
			return d, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	d.usage = meter.stop()
	d.peak, d.maxRSS = rss.finish()
	if err := rp.Stop(30 * time.Second); err != nil {
		e.say("warning: %v", err)
	}
	return d, nil
}

// phaseDrain times the relay draining -n rows into JetStream (and the
// webhook), -drain-runs times on fresh rows, and reports the median run.
func phaseDrain(ctx context.Context, e *env, r *report, webhook bool) error {
	s := relaySetup{name: "drain-js", webhook: webhook}
	what, target, floor := "JetStream", "≥ 40% of the ceiling", 0.40
	if webhook {
		s.name, what, target, floor = "drain-both", "JetStream + webhook", "— (CPU caps both sinks near 20,000/s here)", 0
	}
	rate, err := drainPhase(ctx, e, r, s, what, target, floor)
	if err == nil && !webhook {
		r.drainJS = rate
	}
	return err
}

// phaseDrainBothBatched times the drain into JetStream and a webhook that
// takes batches of up to 100 events (sinks[].batch.max_events), the
// layout a high-volume receiver uses.
func phaseDrainBothBatched(ctx context.Context, e *env, r *report) error {
	s := relaySetup{name: "drain-both-batched", webhook: true, batch: 100}
	_, err := drainPhase(ctx, e, r, s, "JetStream + webhook in batches of up to 100", "≥ 30% of the ceiling", 0.30)
	return err
}

// drainPhase runs -drain-runs drains of s on fresh rows, reports the
// median run against the ceiling (floor: the target's share of it; 0: no
// target) and returns its rate.
func drainPhase(ctx context.Context, e *env, r *report, s relaySetup, what, target string, floor float64) (float64, error) {
	name := s.name
	db := "bench_" + strings.ReplaceAll(name, "-", "_")
	runs := max(e.o.drainRuns, 1)
	var results []drainOutcome
	for i := range runs {
		if runs > 1 {
			e.say("%s: run %d of %d", name, i+1, runs)
		}
		d, err := e.drainOnce(ctx, r, db, s)
		if err != nil {
			return 0, err
		}
		results = append(results, d)
	}
	slices.SortFunc(results, func(a, b drainOutcome) int { return cmp.Compare(a.elapsed, b.elapsed) })
	d := results[len(results)/2]
	rate := float64(e.o.n) / d.elapsed.Seconds()
	steady := float64(e.o.n) / (d.elapsed - d.first).Seconds()
	value := fmt.Sprintf("%s events/s (%.2f s from start; first delivery after %.2f s, then %s/s); peak RSS %s; %s",
		thousands(int(rate)), d.elapsed.Seconds(), d.first.Seconds(), thousands(int(steady)), mb(d.peak), cpuPerEvent(d.usage, e.o.n))
	if runs > 1 {
		all := make([]string, len(results))
		for i, o := range results {
			all[i] = thousands(int(float64(e.o.n) / o.elapsed.Seconds()))
		}
		value = fmt.Sprintf("median of %d: %s; runs, fastest first: %s events/s", runs, value, strings.Join(all, ", "))
	}
	verdict := "n/a (no ceiling)"
	if r.ceiling > 0 {
		ratio := rate / r.ceiling
		verdict = fmt.Sprintf("%.0f%% of ceiling", 100*ratio)
		if floor > 0 {
			verdict += " " + passMiss(ratio >= floor)
		}
	}
	r.add(name, fmt.Sprintf("relay drain of %s rows → %s", thousands(e.o.n), what), value, target, verdict, d.usage)
	r.addCPU(name, d.usage, "")
	return rate, nil
}

// drainOnce runs one drain of s on a fresh database db and stream.
func (e *env) drainOnce(ctx context.Context, r *report, db string, s relaySetup) (drainOutcome, error) {
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return drainOutcome{}, err
	}
	defer e.dropDatabase(db)
	s.url = url
	defer e.deleteStream(s.stream())
	return e.drain(ctx, r, s, e.o.n, e.o.drainBatch, 4)
}

// cpuPerEvent says how much CPU each process tree spent per event over a
// window in which n events were processed, and the rate that would use up
// every core of the machine at that cost: the CPU floor of a drain.
func cpuPerEvent(u cpuUsage, n int) string {
	if n <= 0 || u.wall <= 0 {
		return "CPU per event unknown"
	}
	per := func(cores float64) float64 { return cores * u.wall.Seconds() / float64(n) * 1e6 }
	relay, pg, nats := per(u.groups["relay"]), per(u.groups["postgres"]), per(u.groups["nats"])
	total := relay + pg + nats
	return fmt.Sprintf("CPU per event: relay %.0f µs, PostgreSQL %.0f µs, nats-server %.0f µs; %.0f µs in all, so %d cores cap this at %s events/s",
		relay, pg, nats, total, runtime.NumCPU(), thousands(int(float64(runtime.NumCPU())/total*1e6)))
}

// loadOutcome is what a paced load measured.
type loadOutcome struct {
	load                                   loadResult
	nats, hook, floor                      []float64 // sorted latencies, ms
	natsMissing, hookMissing, floorMissing int
	usage                                  cpuUsage
	peak                                   int64
}

// loadPlan describes a paced load to measure.
type loadPlan struct {
	name     string
	url      string
	t        *tracker
	relay    *harness.Relay // nil: no relay (the seed poller)
	nats     bool           // wait for and report t.nats arrivals
	hook     bool           // wait for and report webhook arrivals
	floor    bool           // wait for and report the bare client's decodes
	warmup   bool
	onStart  func() // called right before the measured load
	duration time.Duration
	settle   time.Duration // how long to wait for the last deliveries
}

// measureLoad runs a warm-up (unmeasured) and then the measured load, waits
// for the deliveries and computes the latencies.
func (e *env) measureLoad(ctx context.Context, r *report, p loadPlan) (loadOutcome, error) {
	pool, err := e.newLoadPool(ctx, p.url)
	if err != nil {
		return loadOutcome{}, err
	}
	defer pool.Close()
	if err := e.quiet(ctx, p.name, r, e.roots(p.relay)); err != nil {
		return loadOutcome{}, err
	}
	if p.warmup && e.o.warmup > 0 {
		e.say("%s: warm-up, %.0f events/s for %s", p.name, e.o.rate, e.o.warmup)
		if _, err := e.runLoad(ctx, pool, p.name+"-warmup-", nil, e.o.rate, e.o.warmup); err != nil {
			return loadOutcome{}, err
		}
	}
	return e.loadWindow(ctx, pool, p)
}

// loadWindow runs the measured load on pool at once (no quiet wait, no
// warm-up), waits for the deliveries and computes the latencies.
func (e *env) loadWindow(ctx context.Context, pool *pgxpool.Pool, p loadPlan) (loadOutcome, error) {
	var out loadOutcome
	var rss *rssSampler
	if p.relay != nil {
		rss = sampleRSS(p.relay.Pid())
	}
	e.say("%s: %.0f events/s for %s, one event per transaction", p.name, e.o.rate, p.duration)
	if p.onStart != nil {
		p.onStart()
	}
	meter := startCPU(e.roots(p.relay))
	var err error
	out.load, err = e.runLoad(ctx, pool, "", p.t, e.o.rate, p.duration)
	if err != nil {
		return out, err
	}
	deadline := time.Now().Add(p.settle)
	want := int64(out.load.sent)
	for time.Now().Before(deadline) {
		if (!p.hook || p.t.hook.unique.Load() >= want) && (!p.nats || p.t.nats.unique.Load() >= want) && (!p.floor || p.t.floor.unique.Load() >= want) {
			break
		}
		if p.relay != nil && p.relay.Exited() {
			return out, p.relay.Failure()
		}
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	out.usage = meter.stop()
	if rss != nil {
		out.peak, _ = rss.finish()
	}
	if p.hook {
		out.hook, out.hookMissing = p.t.latencies(&p.t.hook)
	}
	if p.nats {
		out.nats, out.natsMissing = p.t.latencies(&p.t.nats)
	}
	if p.floor {
		out.floor, out.floorMissing = p.t.latencies(&p.t.floor)
	}
	return out, nil
}

// loadSummary says what the load committed and what arrived where: the
// webhook's arrivals when hook, JetStream's when nats.
func loadSummary(e *env, o loadOutcome, hook, nats bool) string {
	c := o.load.commitMS
	s := fmt.Sprintf("%s events/s × %.0f s: %s committed (%s/s achieved, at most %s behind schedule; INSERT+COMMIT p50 %s, p99 %s, max %s); arrived:",
		thousands(int(e.o.rate)), o.load.elapsed.Seconds(), thousands(o.load.sent), thousands(int(o.load.rate())),
		o.load.maxBehind.Round(time.Millisecond), fmtMS(percentile(c, 0.5)), fmtMS(percentile(c, 0.99)), fmtMS(percentile(c, 1)))
	if hook {
		s += " webhook " + thousands(len(o.hook))
	}
	if nats {
		if hook {
			s += ","
		}
		s += " NATS " + thousands(len(o.nats))
	}
	if o.peak > 0 {
		s += "; relay peak RSS " + mb(o.peak)
	}
	return s
}

// addLatencies adds p50/p95/p99/p99.9 rows for one destination.
func addLatencies(r *report, phase, what string, ms []float64, missing int, u cpuUsage, targets bool) {
	for _, q := range []struct {
		label  string
		p      float64
		target float64 // 0: none
	}{{"p50", 0.50, 3}, {"p95", 0.95, 0}, {"p99", 0.99, 10}, {"p99.9", 0.999, 25}} {
		v := percentile(ms, q.p)
		target, verdict := "—", "info"
		if targets && q.target > 0 {
			target = fmt.Sprintf("< %.0f ms", q.target)
			verdict = passMiss(v < q.target && missing == 0)
		}
		r.add(phase, what+" "+q.label, fmtMS(v), target, verdict, u)
	}
	if missing > 0 {
		r.add(phase, what+": not delivered by the end", thousands(missing), "0", passMiss(false), u)
	}
}

// addFloor adds the bare pglogrepl client's latency over the same events
// in the same window, and the relay's p99 against it.
func addFloor(r *report, phase string, o loadOutcome, hook bool) {
	r.method(floorMethod)
	fp50, fp99 := percentile(o.floor, 0.5), percentile(o.floor, 0.99)
	value := fmt.Sprintf("%s / %s / %s (%s of %s decoded)", fmtMS(fp50), fmtMS(fp99), fmtMS(percentile(o.floor, 0.999)),
		thousands(len(o.floor)), thousands(len(o.floor)+o.floorMissing))
	r.add(phase, "floor: bare pglogrepl client beside the relay (own slot, same events) commit→decode p50 / p99 / p99.9", value, "—", "floor", o.usage)
	for _, d := range []struct {
		what string
		ms   []float64
	}{{"NATS", o.nats}, {"webhook", o.hook}} {
		if d.what == "webhook" && !hook {
			continue
		}
		ratio := percentile(d.ms, 0.99) / fp99
		r.add(phase, "p99 ÷ floor p99, "+d.what, fmt.Sprintf("%.1f×", ratio), "≤ 2×", passMiss(ratio <= 2), o.usage)
	}
}

// floorMethod says why the floor runs beside the relay.
const floorMethod = "Floor in the steady phases: a bare pglogrepl client (pgoutput, no sinks, no ledger) runs beside the relay on a temporary slot of its own in the same database " +
	"and records when it decodes each of the same events, in the same window. On this shared VM the machine changes from one minute to the next, so a floor " +
	"measured in another window (the floor phase) compares two different machines; beside the relay it sees the same load, the same checkpoints and the same " +
	"neighbours. The price is a second walsender decoding the same WAL and the client's own decoding (the ceiling phase puts the walsender at about 12 µs of " +
	"CPU per row: about 2% of a core at 1,000 events/s, plus the client), which the relay shares. The ratio rows compare the relay's p99 with this floor's."

// addCPUPerEvent adds the CPU each process tree spent per event of a
// steady window; the relay's against its target at 1,000 events/s:
// 190 µs with JetStream alone, 250 µs with both sinks (docs/performance.md).
func addCPUPerEvent(r *report, e *env, phase string, o loadOutcome, hook bool) {
	n := o.load.sent
	if n <= 0 || o.usage.wall <= 0 {
		return
	}
	per := func(cores float64) float64 { return cores * o.usage.wall.Seconds() / float64(n) * 1e6 }
	relay := per(o.usage.groups["relay"])
	limit := 190.0
	if hook {
		limit = 250
	}
	target, verdict := fmt.Sprintf("≤ %.0f µs at 1,000 events/s", limit), passMiss(relay <= limit)
	if e.o.rate != 1000 {
		verdict = "info (target is for 1,000 events/s)"
	}
	r.add(phase, "CPU per event: relay", fmt.Sprintf("%.0f µs (PostgreSQL %.0f µs, nats-server %.0f µs, the benchmark's load, receiver, subscriber and floor client %.0f µs)",
		relay, per(o.usage.groups["postgres"]), per(o.usage.groups["nats"]), per(o.usage.groups["bench"])), target, verdict, o.usage)
}

// phaseSteady measures commit→delivery latency and the CPU per event at
// -rate events/s: steady-js with JetStream alone, steady with both sinks.
func phaseSteady(ctx context.Context, e *env, r *report, hook bool) error {
	phase, db, sinks := "steady-js", "bench_steady_js", "JetStream"
	if hook {
		phase, db, sinks = "steady", "bench_steady", "JetStream + webhook"
	}
	s := relaySetup{name: phase, webhook: hook}
	cfg, done, err := e.setUpRelay(ctx, db, &s)
	if err != nil {
		return err
	}
	defer done()
	url := s.url
	rp, err := e.startRelay(s, cfg)
	if err != nil {
		return err
	}
	defer rp.Stop(30 * time.Second)
	if err := e.waitSlotActive(ctx, s, rp, 60*time.Second); err != nil {
		return err
	}
	t := newTracker("st-", int(e.o.rate*e.o.duration.Seconds()))
	e.recv.cur.Store(t)
	defer e.recv.cur.Store(nil)
	sub, err := e.subscribe(s, t)
	if err != nil {
		return err
	}
	defer sub.Unsubscribe()
	f, err := e.startFloor(ctx, url, "bench_floor_steady", t, &t.floor)
	if err != nil {
		return err
	}
	defer f.close()
	// The relay's decode_latency_seconds (PostgreSQL's commit timestamp →
	// the event decoded in the engine, before any sink), scraped around the
	// measured load, tells what the database and the walsender add to the
	// tail from what the relay and the sinks add.
	metrics := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.httpPort)
	var before, senderBefore histogram
	waitProfile := func() {}
	defer func() { waitProfile() }()
	o, err := e.measureLoad(ctx, r, loadPlan{name: phase, url: url, t: t, relay: rp, nats: true, hook: hook, floor: true, warmup: true,
		duration: e.o.duration, settle: 30 * time.Second, onStart: func() {
			waitProfile = e.profileCPU(s.httpPort, phase, e.o.duration)
			var err error
			if before, err = scrapeHistogram(ctx, metrics, decodeLatency); err != nil {
				e.say("warning: %v", err)
			}
			if senderBefore, err = scrapeHistogram(ctx, metrics, walSenderLag); err != nil {
				e.say("warning: %v", err)
			}
		}})
	if err != nil {
		return err
	}
	e.saySeries(phase, t)
	r.add(phase, "load (relay: replication, "+sinks+")", loadSummary(e, o, hook, true), "", "info", o.usage)
	addLatencies(r, phase, "commit→NATS arrival", o.nats, o.natsMissing, o.usage, true)
	if hook {
		addLatencies(r, phase, "commit→webhook 2xx", o.hook, o.hookMissing, o.usage, true)
	}
	addFloor(r, phase, o, hook)
	addCPUPerEvent(r, e, phase, o, hook)
	after, err := scrapeHistogram(ctx, metrics, decodeLatency)
	senderAfter, err2 := scrapeHistogram(ctx, metrics, walSenderLag)
	if err != nil || err2 != nil || before == nil || senderBefore == nil {
		e.say("warning: decode latency not measured: %v %v", err, err2)
	} else {
		r.add(phase, "where the tail comes from: events over 10 ms / over 25 ms", tailSources(senderAfter.since(senderBefore), after.since(before), o.nats, &f.sent), "", "info", o.usage)
	}
	r.addCPU(phase, o.usage, "")
	if hook {
		r.relayHookP50 = percentile(o.hook, 0.5)
	}
	if err := f.close(); err != nil {
		e.say("warning: %v", err)
	}
	if err := rp.Stop(30 * time.Second); err != nil {
		e.say("warning: %v", err)
	}
	return nil
}

// The relay's histograms of commit → decoded in the engine and commit →
// sent by the walsender.
const (
	decodeLatency = "outbox_relay_decode_latency_seconds"
	walSenderLag  = "outbox_relay_walsender_lag_seconds"
)

// tailSources says how many transactions the walsender sent late (sent),
// how many events were late when the relay had decoded them (decoded), and
// how many were late at NATS (natsMS, sorted latencies in ms): which stage
// the tail comes from; and how many the floor client's own walsender sent
// late (floor), for the same load. One event per transaction, as the
// steady load writes.
func tailSources(sent, decoded histogram, natsMS []float64, floor *sendLag) string {
	late := func(ms float64) int {
		i, _ := slices.BinarySearch(natsMS, ms)
		return len(natsMS) - i
	}
	s10, sTotal := sent.over(0.01)
	s25, _ := sent.over(0.025)
	d10, dTotal := decoded.over(0.01)
	d25, _ := decoded.over(0.025)
	return fmt.Sprintf("sent by the walsender (PostgreSQL's commit timestamp → its send time): %s / %s of %s; "+
		"decoded in the relay (commit timestamp → engine, before any sink): %s / %s of %s; at NATS: %s / %s of %s; "+
		"the floor client's walsender, for comparison: %s / %s of %s",
		thousands(int(s10)), thousands(int(s25)), thousands(int(sTotal)),
		thousands(int(d10)), thousands(int(d25)), thousands(int(dTotal)), thousands(late(10)), thousands(late(25)), thousands(len(natsMS)),
		thousands(int(floor.over10.Load())), thousands(int(floor.over25.Load())), thousands(int(floor.total.Load())))
}

// phasePoller measures the seed poller under the same load.
func phasePoller(ctx context.Context, e *env, r *report) error {
	const phase, db = "poller", "bench_poller"
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return err
	}
	defer e.dropDatabase(db)
	t := newTracker("pl-", int(e.o.rate*e.o.pollerDuration.Seconds()))
	e.recv.cur.Store(t)
	defer e.recv.cur.Store(nil)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	p := &poller{pool: pool, url: e.recv.url, interval: e.o.pollerInterval, client: &http.Client{Timeout: 10 * time.Second}}
	pctx, stop := context.WithCancel(ctx)
	defer stop()
	perr := make(chan error, 1)
	o, err := e.measureLoad(ctx, r, loadPlan{name: phase, url: url, t: t, hook: true,
		onStart:  func() { go func() { perr <- p.run(pctx) }() },
		duration: e.o.pollerDuration, settle: e.o.pollerInterval + 60*time.Second})
	stop()
	if err != nil {
		return err
	}
	if err := <-perr; err != nil {
		return fmt.Errorf("seed poller: %w", err)
	}
	r.add(phase, fmt.Sprintf("load (seed poller: every %s, SKIP LOCKED claims of 500, no NOTIFY)", e.o.pollerInterval),
		loadSummary(e, o, true, false), "", "info", o.usage)
	p50, p99 := percentile(o.hook, 0.5), percentile(o.hook, 0.99)
	r.add(phase, "commit→webhook 2xx p50", fmtMS(p50), "reference: 10–20 s for a 10 s poller", "info", o.usage)
	r.add(phase, "commit→webhook 2xx p99", fmtMS(p99), "", "info", o.usage)
	if o.hookMissing > 0 {
		r.add(phase, "not delivered by the end", thousands(o.hookMissing), "0", "info", o.usage)
	}
	if r.relayHookP50 > 0 {
		ratio := p50 / r.relayHookP50
		r.add(phase, "poller p50 / relay p50 (webhook)", fmt.Sprintf("%s×", thousands(int(ratio))), "≥ 1,000×", passMiss(ratio >= 1000), o.usage)
	} else {
		r.add(phase, "poller p50 / relay p50 (webhook)", "n/a (steady phase did not run)", "≥ 1,000×", "n/a", o.usage)
	}
	r.addCPU(phase, o.usage, "")
	return nil
}

// phasePollMode measures the relay's own poll mode when this build has it.
func phasePollMode(ctx context.Context, e *env, r *report) error {
	const phase, db = "pollmode", "bench_pollmode"
	s := relaySetup{name: phase, webhook: true, mode: "poll"}
	cfg, done, err := e.setUpRelay(ctx, db, &s)
	if err != nil {
		return err
	}
	defer done()
	url := s.url
	rp, err := e.startRelay(s, cfg)
	if err != nil {
		return err
	}
	defer rp.Stop(30 * time.Second)
	select {
	case <-rp.Done():
		if rp.ExitCode() == 3 {
			r.add(phase, "relay `source.mode: poll`", "poll mode: not available in this build", "—", "n/a", cpuUsage{})
			return nil
		}
		return rp.Failure()
	case <-time.After(3 * time.Second):
	case <-ctx.Done():
		return ctx.Err()
	}
	t := newTracker("pm-", int(e.o.rate*e.o.pollerDuration.Seconds()))
	e.recv.cur.Store(t)
	defer e.recv.cur.Store(nil)
	sub, err := e.subscribe(s, t)
	if err != nil {
		return err
	}
	defer sub.Unsubscribe()
	o, err := e.measureLoad(ctx, r, loadPlan{name: phase, url: url, t: t, relay: rp, nats: true, hook: true, warmup: true,
		duration: e.o.pollerDuration, settle: 60 * time.Second})
	if err != nil {
		return err
	}
	e.saySeries(phase, t)
	r.add(phase, "load (relay `source.mode: poll`, defaults, JetStream + webhook)", loadSummary(e, o, true, true), "", "info", o.usage)
	addLatencies(r, phase, "commit→NATS arrival", o.nats, o.natsMissing, o.usage, false)
	addLatencies(r, phase, "commit→webhook 2xx", o.hook, o.hookMissing, o.usage, false)
	r.addCPU(phase, o.usage, "")
	return nil
}

// phaseRSS measures the relay's peak RSS draining -queued rows (10,000 per
// statement) or one -bigtx-row transaction.
func phaseRSS(ctx context.Context, e *env, r *report, bigTx bool) error {
	name, n, per, parallel := "rss-queued", e.o.queued, 10000, 2
	what := fmt.Sprintf("peak RSS draining %s queued events (10,000-row statements)", thousands(n))
	if bigTx {
		name, n, per, parallel = "rss-bigtx", e.o.bigTx, e.o.bigTx, 1
		what = fmt.Sprintf("peak RSS draining one %s-row transaction", thousands(n))
	}
	db := "bench_" + strings.ReplaceAll(name, "-", "_")
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return err
	}
	defer e.dropDatabase(db)
	s := relaySetup{name: name, url: url, webhook: e.o.rssWebhook}
	defer e.deleteStream(s.stream())
	d, err := e.drain(ctx, r, s, n, per, parallel)
	if err != nil {
		return err
	}
	sinks := "JetStream"
	if s.webhook {
		sinks += " + webhook"
	}
	spec := 1000000
	if bigTx {
		spec = 100000
	}
	verdict := passMiss(d.peak < 150<<20)
	if n < spec {
		verdict += fmt.Sprintf(" (at %s, not %s)", thousands(n), thousands(spec))
	}
	r.add(name, what+" → "+sinks,
		fmt.Sprintf("%s (VmHWM; largest VmRSS sample %s); drained in %.1f s, %s events/s", mb(d.peak), mb(d.maxRSS), d.elapsed.Seconds(), thousands(int(float64(n)/d.elapsed.Seconds()))),
		"< 150 MB", verdict, d.usage)
	r.addCPU(name, d.usage, "")
	return nil
}

// saySeries prints the latency of each second of the load, to tell a steady
// latency from stalls.
func (e *env) saySeries(phase string, t *tracker) {
	for _, d := range []struct {
		name string
		a    *arrivals
	}{{"NATS", &t.nats}, {"webhook", &t.hook}} {
		p50, worst := t.series(d.a, time.Second)
		var b strings.Builder
		for i := range p50 {
			fmt.Fprintf(&b, " %.1f/%.0f", p50[i], worst[i])
		}
		e.say("%s: commit→%s by second of the load, p50/max ms:%s", phase, d.name, b.String())
	}
}
