package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// phaseStandby compares decoding on the primary with decoding on a physical
// standby (source.standby_url, PostgreSQL 16+; docs/standby.md) under the
// same steady load, one relay after the other on the same cluster: the
// standby is a cold copy of the primary (pgtest), made at the start of the
// phase. For each: commit→NATS and commit→webhook p50/p99, PostgreSQL CPU
// per delivered event on the primary (its process tree, and by process:
// the relay's backends, its walsender) and on the standby (its tree), and
// the standby's replay lag (pg_stat_replication.replay_lag, sampled every
// 100 ms) — the cost decoding there adds to the latency. It needs the
// cluster to be PostgreSQL 16+: OUTBOX_RELAY_PG_BINDIR names the binaries
// (docs/performance.md, "decoding on a standby").
func phaseStandby(ctx context.Context, e *env, r *report) error {
	const phase = "standby"
	conn, err := pgx.Connect(ctx, e.cluster.URL("postgres"))
	if err != nil {
		return err
	}
	var version int
	err = conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version)
	conn.Close(ctx)
	if err != nil {
		return err
	}
	if version < 160000 {
		return fmt.Errorf("phase standby: PostgreSQL %d cannot decode on a standby; run it on 16+: OUTBOX_RELAY_PG_BINDIR=$(go run ./cmd/outbox-relay-pg 16) make bench ARGS='-phases standby'", version/10000)
	}
	e.say("%s: making a physical standby from a cold copy of the primary", phase)
	standby, err := e.cluster.StartStandby(ctx, pgtest.StandbyOptions{NoSlotSync: true})
	if err != nil {
		return err
	}
	defer standby.Close()

	type result struct {
		nats, hook         []float64
		primaryCPU         float64 // µs per event, the primary's tree
		standbyCPU         float64 // µs per event, the standby's tree
		byClass            map[string]time.Duration
		lag                []float64 // ms
		sent, nMiss, hMiss int
	}
	results := map[string]result{}
	for _, where := range []string{"primary", "standby"} {
		name := phase + "-on-" + where
		s := relaySetup{name: name, webhook: true}
		db := "bench_" + strings.ReplaceAll(name, "-", "_")
		if where == "standby" {
			s.standbyURL = standby.URL(db)
		}
		cfg, done, err := e.setUpRelay(ctx, db, &s)
		if err != nil {
			return err
		}
		res, err := func() (result, error) {
			defer done()
			rp, err := e.startRelay(s, cfg)
			if err != nil {
				return result{}, err
			}
			defer rp.Stop(30 * time.Second)
			slotURL := s.url
			if where == "standby" {
				slotURL = s.standbyURL
			}
			if err := waitStreamingOn(ctx, slotURL, s.slot(), rp, 90*time.Second); err != nil {
				return result{}, err
			}
			t := newTracker("sb-"+where+"-", int(e.o.rate*e.o.duration.Seconds()))
			e.recv.cur.Store(t)
			defer e.recv.cur.Store(nil)
			sub, err := e.subscribe(s, t)
			if err != nil {
				return result{}, err
			}
			defer sub.Unsubscribe()
			pool, err := e.newLoadPool(ctx, s.url)
			if err != nil {
				return result{}, err
			}
			defer pool.Close()
			roots := e.roots(rp)
			if pid := postmasterOf(standby.Dir()); pid > 0 {
				roots["standby"] = pid
			}
			if err := e.quiet(ctx, name, r, roots); err != nil {
				return result{}, err
			}
			if e.o.warmup > 0 {
				if _, err := e.runLoad(ctx, pool, name+"-warmup-", nil, e.o.rate, e.o.warmup); err != nil {
					return result{}, err
				}
			}
			sconn, err := e.connectBench(ctx, e.cluster.URL("postgres"))
			if err != nil {
				return result{}, err
			}
			defer sconn.Close(context.Background())
			sampler, err := startBackendSampler(ctx, sconn, db)
			if err != nil {
				return result{}, err
			}
			lag := sampleReplayLag(ctx, e, e.cluster.URL("postgres"))
			meter := startCPU(roots)
			e.say("%s: %.0f events/s for %s, one event per transaction, decoding on the %s", name, e.o.rate, e.o.duration, where)
			load, err := e.runLoad(ctx, pool, "", t, e.o.rate, e.o.duration)
			if err != nil {
				return result{}, err
			}
			deadline := time.Now().Add(30 * time.Second)
			for time.Now().Before(deadline) && (t.nats.unique.Load() < int64(load.sent) || t.hook.unique.Load() < int64(load.sent)) {
				time.Sleep(20 * time.Millisecond)
			}
			u := meter.stop()
			byClass := sampler.finish(ctx)
			out := result{sent: load.sent, byClass: byClass, lag: lag()}
			out.nats, out.nMiss = t.latencies(&t.nats)
			out.hook, out.hMiss = t.latencies(&t.hook)
			per := func(cores float64) float64 { return cores * u.wall.Seconds() / float64(max(load.sent, 1)) * 1e6 }
			out.primaryCPU, out.standbyCPU = per(u.groups["postgres"]), per(u.groups["standby"])
			r.addCPU(name, u, "")
			return out, nil
		}()
		if err != nil {
			return err
		}
		results[where] = res
	}
	for _, where := range []string{"primary", "standby"} {
		res := results[where]
		what := "decoding on the " + where
		perEvent := func(d time.Duration) string {
			return fmt.Sprintf("%.0f µs", float64(d.Microseconds())/float64(max(res.sent, 1)))
		}
		r.add(phase, what+": commit→NATS p50 / p99", fmt.Sprintf("%s / %s (%d not delivered)", fmtMS(percentile(res.nats, 0.5)), fmtMS(percentile(res.nats, 0.99)), res.nMiss), "—", "info", cpuUsage{})
		r.add(phase, what+": commit→webhook p50 / p99", fmt.Sprintf("%s / %s (%d not delivered)", fmtMS(percentile(res.hook, 0.5)), fmtMS(percentile(res.hook, 0.99)), res.hMiss), "—", "info", cpuUsage{})
		r.add(phase, what+": PostgreSQL CPU on the primary per event", fmt.Sprintf("%.0f µs (the relay's walsender %s, its backends %s, the application's %s, the server's — checkpointer, WAL writer, the standby's walsender — %s)",
			res.primaryCPU, perEvent(res.byClass[pgWalsender]), perEvent(res.byClass[pgRelay]), perEvent(res.byClass[pgApp]), perEvent(res.byClass[pgServer])), "—", "info", cpuUsage{})
		r.add(phase, what+": PostgreSQL CPU on the standby per event", fmt.Sprintf("%.0f µs", res.standbyCPU), "—", "info", cpuUsage{})
		if len(res.lag) > 0 {
			r.add(phase, what+": the standby's replay lag p50 / p99 / max", fmt.Sprintf("%s / %s / %s (%d samples)", fmtMS(percentile(res.lag, 0.5)), fmtMS(percentile(res.lag, 0.99)), fmtMS(percentile(res.lag, 1)), len(res.lag)), "—", "info", cpuUsage{})
		}
	}
	p, s := results["primary"], results["standby"]
	if p.primaryCPU > 0 {
		r.add(phase, "PostgreSQL CPU on the primary per event, standby ÷ primary", fmt.Sprintf("%.2f× (%.0f µs → %.0f µs)", s.primaryCPU/p.primaryCPU, p.primaryCPU, s.primaryCPU), "< 1", passMiss(s.primaryCPU < p.primaryCPU), cpuUsage{})
	}
	return nil
}

// waitStreamingOn waits until a walsender streams from slot on the server
// at url (the primary or the standby).
func waitStreamingOn(ctx context.Context, url, slot string, r *harness.Relay, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		conn, err := pgx.Connect(ctx, url)
		if err == nil {
			active, qerr := harness.SlotStreaming(ctx, conn, slot)
			conn.Close(context.Background())
			if qerr == nil && active {
				return nil
			}
		}
		if r.Exited() {
			return r.Failure()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the relay does not stream from slot %s within %s", slot, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// sampleReplayLag samples, every 100 ms until the returned function is
// called, the replay lag of the primary's physical standbys
// (pg_stat_replication.replay_lag; 0 while caught up and idle), and
// returns the samples in ms, sorted.
func sampleReplayLag(ctx context.Context, e *env, url string) func() []float64 {
	ctx, cancel := context.WithCancel(ctx)
	var mu sync.Mutex
	var ms []float64
	done := make(chan struct{})
	go func() {
		defer close(done)
		conn, err := e.connectBench(ctx, url)
		if err != nil {
			return
		}
		defer conn.Close(context.Background())
		for {
			var lag float64
			if err := conn.QueryRow(ctx, `SELECT coalesce(max(extract(epoch FROM replay_lag)), 0)::float8 * 1000
			  FROM pg_stat_replication WHERE application_name = 'pgtest_standby'`).Scan(&lag); err == nil {
				mu.Lock()
				ms = append(ms, lag)
				mu.Unlock()
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	return func() []float64 {
		cancel()
		<-done
		mu.Lock()
		defer mu.Unlock()
		slices.Sort(ms)
		return ms
	}
}

// postmasterOf reads the postmaster's pid from a cluster directory.
func postmasterOf(dir string) int {
	b, err := os.ReadFile(filepath.Join(dir, "data", "postmaster.pid"))
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, _ := strconv.Atoi(strings.TrimSpace(line))
	return pid
}
