package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// The partitions phase (docs/scaling.md): one relay against two, on the
// same total load. A partition is an outbox table with its own ledger,
// checkpoint, publication, slot and relay process; the application spreads
// its events over the tables. Both setups drain -n events inserted while
// their relays were stopped, into JetStream: one partition takes all -n,
// two take -n/2 each, written side by side so that their WAL interleaves
// as an application's would.
//
// What it shows: each walsender decodes every change of its database, the
// other partition's too (pgoutput drops unpublished tables only after
// decoding), so the walsenders' CPU per event in the database is reported
// beside the drain rate.

// partitionTables are the outbox tables of the two-partition setup; the
// first is the default table newDatabase migrates.
var partitionTables = []string{"integration_outbox", "outbox_b"}

// partitionOutcome is one drain of the partitions phase.
type partitionOutcome struct {
	parts    int
	elapsed  time.Duration   // relays started → every event in JetStream
	finished []time.Duration // per partition: relays started → its events in JetStream
	// walsender is each partition's walsender CPU over its life, which
	// spans the drain (it starts with its relay and is read before the
	// relay stops).
	walsender []time.Duration
	usage     cpuUsage
}

// phasePartitions drains -n events with one partition, then with two,
// -drain-runs times each (alternating), and reports the medians.
func phasePartitions(ctx context.Context, e *env, r *report) error {
	const phase = "partitions"
	runs := max(e.o.drainRuns, 1)
	results := map[int][]partitionOutcome{}
	for i := range runs {
		for _, parts := range []int{1, 2} {
			e.say("%s: run %d of %d, %d partition(s)", phase, i+1, runs, parts)
			out, err := e.partitionDrain(ctx, r, parts)
			if err != nil {
				return err
			}
			e.say("%s: %d partition(s): %.0f events/s; walsender CPU %s", phase, parts, float64(e.o.n)/out.elapsed.Seconds(), durations(out.walsender))
			results[parts] = append(results[parts], out)
		}
	}
	n := e.o.n
	r.method("partitions: a partition is an outbox table with its own ledger, checkpoint, publication, slot and `outbox-relay run` process, in the same database. " +
		"Each setup drains the same -n events (one partition: all of them in one table; two: half in each, inserted side by side), inserted while the relays were stopped, into JetStream. " +
		"The walsender CPU is each walsender's own, read from /proc before its relay stops; it decodes every change of the database, published or not.")
	var one float64
	for _, parts := range []int{1, 2} {
		rs := results[parts]
		slices.SortFunc(rs, func(a, b partitionOutcome) int { return cmp.Compare(a.elapsed, b.elapsed) })
		med := rs[len(rs)/2]
		rate := float64(n) / med.elapsed.Seconds()
		all := make([]string, len(rs))
		for i, o := range rs {
			all[i] = thousands(int(float64(n) / o.elapsed.Seconds()))
		}
		var ws time.Duration
		per := make([]string, len(med.walsender))
		for i, w := range med.walsender {
			ws += w
			per[i] = fmt.Sprintf("%.1f µs", float64(w.Microseconds())/float64(n))
		}
		finished := make([]string, len(med.finished))
		for i, f := range med.finished {
			finished[i] = fmt.Sprintf("%.2f s", f.Seconds())
		}
		perGroup := func(g string) float64 {
			return med.usage.groups[g] * med.usage.wall.Seconds() / float64(n) * 1e6
		}
		relayCPU := perGroup("relay")
		value := fmt.Sprintf("median of %d: %s events/s (%.2f s; partitions done after %s; runs, fastest first: %s events/s); "+
			"walsender CPU per event of the database: %s (%s in all, %.1f s of CPU); CPU per event: relays %.0f µs, PostgreSQL %.0f µs, nats-server %.0f µs",
			len(rs), thousands(int(rate)), med.elapsed.Seconds(), strings.Join(finished, ", "), strings.Join(all, ", "),
			strings.Join(per, " + "), fmt.Sprintf("%.1f µs", float64(ws.Microseconds())/float64(n)), ws.Seconds(),
			relayCPU, perGroup("postgres"), perGroup("nats"))
		verdict := "—"
		if parts == 1 {
			one = rate
		} else if one > 0 {
			verdict = fmt.Sprintf("%.2f× one partition's rate", rate/one)
		}
		name := fmt.Sprintf("%s-%d", phase, parts)
		r.add(name, fmt.Sprintf("drain of %s events over %d partition(s) → JetStream", thousands(n), parts), value, "—", verdict, med.usage)
		r.addCPU(name, med.usage, "")
	}
	return nil
}

// durations prints ds in seconds.
func durations(ds []time.Duration) string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = fmt.Sprintf("%.2f s", d.Seconds())
	}
	return strings.Join(out, ", ")
}

// partitionDrain runs one drain with parts partitions on a fresh database.
func (e *env) partitionDrain(ctx context.Context, r *report, parts int) (partitionOutcome, error) {
	out := partitionOutcome{parts: parts}
	db := fmt.Sprintf("bench_partitions_%d", parts)
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return out, err
	}
	defer e.dropDatabase(db)

	setups := make([]relaySetup, parts)
	cfgs := make([]string, parts)
	for i := range parts {
		s := relaySetup{name: fmt.Sprintf("part%d-%c", parts, 'a'+i), url: url}
		if i > 0 {
			s.outbox = partitionTables[i]
		}
		setups[i] = s
		defer e.deleteStream(s.stream())
		if cfgs[i], err = e.writeConfig(s); err != nil {
			return out, err
		}
		if i > 0 {
			if err := migrateConfig(ctx, e.o.relayBin, cfgs[i]); err != nil {
				return out, err
			}
		}
		e.say("%s: creating slot %s", s.name, s.slot())
		if err := e.createSlot(ctx, s, cfgs[i]); err != nil {
			return out, err
		}
	}

	n := e.o.n
	e.say("partitions: inserting %d rows over %d table(s), %d per transaction, with the relays stopped", n, parts, e.o.drainBatch)
	var wg sync.WaitGroup
	errs := make(chan error, parts)
	for i := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			share := n / parts
			if i == parts-1 {
				share = n - share*(parts-1)
			}
			errs <- e.bulkInsertInto(ctx, url, partitionTables[i], fmt.Sprintf("p%d%c-", parts, 'a'+i), share, e.o.drainBatch, max(4/parts, 1))
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return out, err
		}
	}

	if err := e.quiet(ctx, fmt.Sprintf("partitions-%d", parts), r, e.roots(nil)); err != nil {
		return out, err
	}
	roots := e.roots(nil)
	relays := make([]*harness.Relay, parts)
	for i, s := range setups {
		rp, err := e.startRelay(s, cfgs[i])
		if err != nil {
			return out, err
		}
		defer rp.Stop(30 * time.Second)
		relays[i] = rp
		roots[fmt.Sprintf("relay-%c", 'a'+i)] = rp.Pid()
	}
	meter := startCPU(roots)
	start := time.Now()
	out.finished = make([]time.Duration, parts)
	want := make([]uint64, parts)
	for i := range parts {
		want[i] = uint64(n / parts)
		if i == parts-1 {
			want[i] = uint64(n - (n/parts)*(parts-1))
		}
	}
	lastSay := start
	for {
		done := true
		var total uint64
		for i, s := range setups {
			msgs, err := e.streamMsgs(ctx, s.stream())
			if err != nil {
				return out, err
			}
			total += msgs
			if msgs >= want[i] && out.finished[i] == 0 {
				out.finished[i] = time.Since(start)
			}
			if out.finished[i] == 0 {
				done = false
			}
			if relays[i].Exited() {
				return out, relays[i].Failure()
			}
		}
		if done {
			out.elapsed = time.Since(start)
			break
		}
		if time.Since(start) > 10*time.Minute {
			return out, fmt.Errorf("partitions: %d of %d events in JetStream after 10 minutes", total, n)
		}
		if time.Since(lastSay) >= 5*time.Second {
			lastSay = time.Now()
			e.say("partitions-%d: %.0f s: JetStream %d/%d", parts, time.Since(start).Seconds(), total, n)
		}
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	out.usage = meter.stop()
	// The CPU table reports the relays together.
	for g, v := range out.usage.groups {
		if strings.HasPrefix(g, "relay-") {
			out.usage.groups["relay"] += v
		}
	}
	if out.walsender, err = walsenderCPU(ctx, url, setups); err != nil {
		return out, err
	}
	for _, rp := range relays {
		if err := rp.Stop(30 * time.Second); err != nil {
			e.say("warning: %v", err)
		}
	}
	return out, nil
}

// walsenderCPU reads the CPU each setup's walsender has used since it
// started.
func walsenderCPU(ctx context.Context, url string, setups []relaySetup) ([]time.Duration, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	out := make([]time.Duration, len(setups))
	for i, s := range setups {
		var pid *int32
		if err := conn.QueryRow(ctx, `SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1`, s.slot()).Scan(&pid); err != nil {
			return nil, fmt.Errorf("walsender of slot %s: %w", s.slot(), err)
		}
		if pid == nil {
			return nil, fmt.Errorf("slot %s has no walsender at the end of the drain", s.slot())
		}
		cpu, _, ok := readProcCPU(int(*pid))
		if !ok {
			return nil, fmt.Errorf("read the CPU of walsender %d (slot %s)", *pid, s.slot())
		}
		out[i] = cpu
	}
	return out, nil
}

// migrateConfig runs `outbox-relay migrate --config cfg`.
func migrateConfig(ctx context.Context, relayBin, cfg string) error {
	cmd := exec.CommandContext(ctx, relayBin, "migrate", "--config", cfg)
	cmd.Env = append(os.Environ(), "RELAY_LOG_FORMAT=json")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("outbox-relay migrate --config %s: %w\n%s", cfg, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// bulkInsertInto is bulkInsert into another outbox table.
func (e *env) bulkInsertInto(ctx context.Context, url, table, prefix string, n, perStmt, parallel int) error {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.MaxConns = int32(parallel)
	cfg.ConnConfig.RuntimeParams["application_name"] = benchAppName + " load"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	sql := strings.Replace(bulkInsertSQL, "INSERT INTO integration_outbox ", "INSERT INTO "+pgx.Identifier{table}.Sanitize()+" ", 1)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	next := make(chan int)
	go func() {
		defer close(next)
		for from := 0; from < n; from += perStmt {
			select {
			case next <- from:
			case <-ctx.Done():
				return
			}
		}
	}()
	var wg sync.WaitGroup
	errs := make(chan error, parallel)
	for range parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for from := range next {
				to := min(from+perStmt, n) - 1
				if _, err := pool.Exec(ctx, sql, from, to, e.o.aggregates, prefix, e.o.payloadSize); err != nil {
					errs <- fmt.Errorf("insert rows %d-%d into %s: %w", from, to, table, err)
					cancel()
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}
