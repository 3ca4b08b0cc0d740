// Command outbox-relay-bench measures outbox-relay on the workload of docs/performance.md
// in one run and prints a markdown table that can be pasted into the README:
// ≥ 1,000 aggregates, 300-byte payloads, the idempotency ledger on, and an
// external NATS server process with JetStream.
//
// It starts everything it needs and removes it afterwards: a throwaway
// PostgreSQL cluster with wal_level=logical (migrations/pgtest, fsync on), a
// nats-server process on a free loopback port (built from the nats-server
// module in go.mod, else the one in PATH; never the machine's own server on
// 4222), and an in-process HTTP receiver that records when each event_key
// arrives. Every phase uses a fresh database, migrated with `outbox-relay
// migrate`, and the relay binary given by --relay, configured through a file.
//
// Phases, in order (select with -phases):
//
//	ceiling     pg_recvlogical (pgoutput, proto_version=1) drains -n rows
//	            inserted after its slot was created: rows/s, the median of
//	            -ceiling-runs drains of the same rows (one slot each).
//	drain-js    the relay drains the same number of rows, inserted after its
//	            slot exists while it is stopped, into JetStream: events/s
//	            (the median of -drain-runs drains, each on fresh rows), the
//	            ratio to the ceiling and the CPU each process spent per event.
//	drain-both  the same into JetStream and the webhook together.
//	floor       a bare pglogrepl client alone under the steady load (for half
//	            of -duration, at most 10 s): commit→decode latency, the
//	            floor for any relay on this machine in this run.
//	steady-js   -rate events/s for -duration, one event per transaction,
//	            into JetStream alone: commit→NATS arrival p50/p95/p99/p99.9
//	            and the relay's CPU per event (target ≤ 190 µs at 1,000/s).
//	steady      the same into both sinks: commit→NATS arrival and
//	            commit→webhook 2xx (CPU target ≤ 250 µs at 1,000/s).
//	steady-after-drain
//	            the relay starts with -backlog events queued (inserted while
//	            it was stopped); the moment the last of them has arrived at
//	            both sinks, -rate events/s for -duration start, while the
//	            relay is still writing the backlog back: the same rows as
//	            steady, the drain's rate, and p99 over the first 5 s.
//	write-back  what the relay writes to the primary per delivered event,
//	            both sinks on, in two windows: a drain of -writeback-n queued
//	            events, then -rate events/s for -writeback-duration. WAL by
//	            kind (outbox UPDATE, ledger, checkpoint, commits, full-page
//	            images, outbox prune/vacuum, other) and by resource manager,
//	            from pg_waldump over the window with the application's INSERT
//	            transactions subtracted;
//	            PostgreSQL CPU by process (the relay's query connections, its
//	            walsender, the application's, the server's), from /proc for
//	            every process of pg_stat_activity; the relay's statements'
//	            execution time by kind (pg_stat_statements, preloaded in the
//	            cluster and tracking this phase's database only); relay CPU.
//	            The table notes say how records are charged and the limits.
//
//	poller      the seed poller (every -poller-interval a FOR UPDATE SKIP
//	            LOCKED claim of 500 rows, POST each, mark done; no NOTIFY)
//	            under the same load for -poller-duration.
//	pollmode    the relay's own poll mode under the same load, when the build
//	            has it (a trial run that exits with code 3 means it has not).
//	rss-queued  peak RSS of the relay draining -queued rows inserted in
//	            10,000-row statements while it was stopped.
//	rss-bigtx   peak RSS of the relay draining one -bigtx-row transaction.
//	filter      sinks[].filter's cost: -rate events/s for -duration (at
//	            most 10 s) routed by relay.Route.Takes to two sinks with a
//	            CEL filter, in the benchmark's process: CPU per event and
//	            sink (target ≤ 5 µs) and one event's routing p99.
//
// One phase runs only when -phases names it:
//
//	partitions  one outbox table and one relay against two tables, each
//	            with its own publication, slot and relay process
//	            (docs/scaling.md), draining the same -n events into
//	            JetStream, -drain-runs times each: the drain rate and each
//	            walsender's CPU per event of the database.
//	standby     (PostgreSQL 16+, OUTBOX_RELAY_PG_BINDIR) the relay decoding
//	            on the primary, then on a physical standby of it
//	            (source.standby_url), each under -rate events/s for
//	            -duration: commit→NATS and commit→webhook p50/p99,
//	            PostgreSQL CPU per event on the primary and on the
//	            standby, and the standby's replay lag (docs/standby.md).
//	floor-pair  two bare pglogrepl clients and no relay under -rate
//	            events/s for -duration, -floor-pair-rounds rounds with new
//	            slots, the first client started before the second (as the
//	            relay is before the floor client): how far apart two
//	            identical clients of one server are at the tail.
//	large-payloads
//	            peak RSS and CPU of the relay (GOGC=100, no memory limit)
//	            delivering 900 rows of 600 KiB through a new slot's
//	            hand-over, the stream behind a slow webhook (at four byte
//	            budgets) and the claim path, and 20 rows of 10 MiB through
//	            the stream and a hand-over (docs/performance.md, "Memory").
//
// Every steady phase (steady-js, steady, steady-after-drain) also runs the bare
// pglogrepl client beside the relay, on its own temporary slot in the same
// database, over the same events in the same window: its p50/p99 are the
// floor under the same load, and the relay's p99 is reported against it
// (target ≤ 2×), with the CPU each process spent per event. Beside rather than alternating,
// because this shared VM changes from one minute to the next; the cost, a
// second walsender and the client's decoding (about 2% of a core at 1,000
// events/s), falls on both.
//
// A naive-peer phase (the public wal-listener v2.11 under the same load)
// is not here: the Go module proxy this machine reaches answers 403 for
// github.com/ihippik/wal-listener/v2, so it cannot be built at bench time.
//
// Before each phase it waits (at most -quiet-wait) until the CPU used by
// processes outside the benchmark, measured from /proc over one second, is
// below -quiet cores, and it reports that share for every phase. It reports,
// it does not assert: the exit status is 0 unless the benchmark itself could
// not run. -quick shrinks every size so that the run takes about three
// minutes.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// options are the command-line flags.
type options struct {
	relayBin          string
	natsServer        string
	n                 int
	backlog           int
	writeBackN        int
	writeBackDuration time.Duration
	ceilingRuns       int
	drainRuns         int
	rate              float64
	duration          time.Duration
	floorPairRounds   int
	warmup            time.Duration
	pollerDuration    time.Duration
	pollerInterval    time.Duration
	queued            int
	bigTx             int
	aggregates        int
	payloadSize       int
	drainBatch        int
	writers           int
	rssWebhook        bool
	quiet             float64
	profileDir        string
	relayEnv          envList
	quietWait         time.Duration
	quick             bool
	phases            string
	keep              bool
	statements        int
	autoExplain       time.Duration
	layout            string
}

// quickValues are the sizes -quick uses for flags not given explicitly.
var quickValues = map[string]string{
	"n":                  "20000",
	"duration":           "10s",
	"warmup":             "1s",
	"poller-duration":    "10s",
	"queued":             "100000",
	"bigtx":              "20000",
	"quiet-wait":         "2s",
	"drain-runs":         "1",
	"backlog":            "20000",
	"writeback-n":        "10000",
	"writeback-duration": "5s",
	"claim-n":            "20000",
}

func main() {
	var o options
	fs := flag.NewFlagSet("outbox-relay-bench", flag.ExitOnError)
	fs.StringVar(&o.relayBin, "relay", "", "path to the outbox-relay binary (default: bin/outbox-relay)")
	fs.StringVar(&o.natsServer, "nats-server", "", "nats-server binary (default: build github.com/nats-io/nats-server/v2 from go.mod, else nats-server in PATH)")
	fs.IntVar(&o.n, "n", 200000, "rows for the drain phases (ceiling, drain-js, drain-both)")
	fs.IntVar(&o.backlog, "backlog", 200000, "events queued before steady-after-drain starts the relay")
	fs.IntVar(&o.writeBackN, "writeback-n", 50000, "events queued for the write-back phase's drain window")
	fs.DurationVar(&o.writeBackDuration, "writeback-duration", 30*time.Second, "the write-back phase's steady window (at -rate)")
	fs.IntVar(&o.ceilingRuns, "ceiling-runs", 3, "pg_recvlogical drains of the same rows (the median is the ceiling)")
	fs.IntVar(&o.drainRuns, "drain-runs", 3, "relay drains per drain phase, each on fresh rows (the median is reported; this shared VM varies by ±30% from one run to the next)")
	fs.Float64Var(&o.rate, "rate", 1000, "steady load in events/s")
	fs.DurationVar(&o.duration, "duration", 60*time.Second, "measured duration of the steady load")
	fs.IntVar(&o.floorPairRounds, "floor-pair-rounds", 3, "rounds of the floor-pair phase")
	fs.DurationVar(&o.warmup, "warmup", 2*time.Second, "unmeasured load before each measured load")
	fs.DurationVar(&o.pollerDuration, "poller-duration", 60*time.Second, "load duration for the seed poller and the relay's poll mode")
	fs.DurationVar(&o.pollerInterval, "poller-interval", 10*time.Second, "the seed poller's interval")
	fs.IntVar(&o.queued, "queued", 1000000, "rows queued (inserted in 10,000-row statements) for the RSS drain")
	fs.IntVar(&o.bigTx, "bigtx", 100000, "rows of the single transaction for the RSS drain")
	fs.IntVar(&o.aggregates, "aggregates", 1000, "distinct aggregate ids")
	fs.IntVar(&o.payloadSize, "payload", 300, "payload size in bytes (jsonb text)")
	fs.IntVar(&o.drainBatch, "drain-batch", 100, "rows per transaction when inserting the drain phases' rows")
	fs.IntVar(&o.writers, "writers", 8, "connections generating the steady load")
	fs.BoolVar(&o.rssWebhook, "rss-webhook", false, "RSS phases deliver to the webhook as well as JetStream (slower)")
	fs.Float64Var(&o.quiet, "quiet", 0.3, "wait before each phase until other processes use less than this many cores")
	fs.DurationVar(&o.quietWait, "quiet-wait", 30*time.Second, "longest wait for a quiet machine before each phase")
	fs.BoolVar(&o.quick, "quick", false, "small sizes, about three minutes (for CI; reports, does not assert)")
	fs.StringVar(&o.phases, "phases", strings.Join(allPhases, ","), "comma-separated phases to run")
	fs.BoolVar(&o.keep, "keep", false, "keep the work directory (logs, configs) after the run")
	fs.Var(&o.relayEnv, "relay-env", "KEY=VALUE added to every relay's environment (repeatable), e.g. GOGC=200 to compare a runtime setting in one run")
	fs.StringVar(&o.profileDir, "profile", "", "write the relay's CPU profile of each steady phase's measured window to this directory (<phase>.cpu.pprof)")
	fs.IntVar(&o.statements, "statements", 0, "print the N statements with the most execution time in each relay database when its phase ends (pg_stat_statements; 0: none)")
	fs.DurationVar(&o.autoExplain, "auto-explain", 0, "log the plans (EXPLAIN ANALYZE) of statements slower than this to postgres.log in the work directory (auto_explain; with -keep; 0: off)")
	fs.StringVar(&o.layout, "layout", layoutDeploy, "where processes run: deploy (the relay on a CPU of its own, PostgreSQL, the load and the sinks on the others) or shared (no placement)")
	claimFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: outbox-relay-bench [flags]\n\nMeasures outbox-relay on the workload of docs/performance.md and prints a markdown table.\n\n")
		fs.PrintDefaults()
	}
	_ = fs.Parse(os.Args[1:])
	if o.quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for name, v := range quickValues {
			if !set[name] {
				_ = fs.Set(name, v)
			}
		}
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "outbox-relay-bench: unexpected arguments %q\n", fs.Args())
		os.Exit(2)
	}
	if err := o.validate(); err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-bench: %v\n", err)
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o, os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-bench: %v\n", err)
		stop()
		os.Exit(1)
	}
}

// envList is a repeatable KEY=VALUE flag.
type envList []string

func (l *envList) String() string { return strings.Join(*l, " ") }

func (l *envList) Set(v string) error {
	if k, _, ok := strings.Cut(v, "="); !ok || k == "" {
		return fmt.Errorf("want KEY=VALUE, got %q", v)
	}
	*l = append(*l, v)
	return nil
}

// validate checks the flags and resolves the relay binary.
func (o *options) validate() error {
	bin, err := harness.RelayBinary(o.relayBin)
	if err != nil {
		return err
	}
	o.relayBin = bin
	switch {
	case o.n <= 0 || o.queued <= 0 || o.bigTx <= 0 || o.backlog <= 0 || o.writeBackN <= 0 || o.writeBackDuration <= 0:
		return fmt.Errorf("-n, -queued, -bigtx, -backlog, -writeback-n and -writeback-duration must be positive")
	case o.rate <= 0 || o.duration <= 0 || o.pollerDuration <= 0 || o.pollerInterval <= 0:
		return fmt.Errorf("-rate, -duration, -poller-duration and -poller-interval must be positive")
	case o.aggregates <= 0 || o.writers <= 0 || o.drainBatch <= 0:
		return fmt.Errorf("-aggregates, -writers and -drain-batch must be positive")
	case o.payloadSize < 40:
		return fmt.Errorf("-payload must be at least 40 bytes")
	case o.layout != layoutDeploy && o.layout != layoutShared:
		return fmt.Errorf("-layout: %q is not one of %s, %s", o.layout, layoutDeploy, layoutShared)
	}
	for _, p := range strings.Split(o.phases, ",") {
		if !isPhase(strings.TrimSpace(p)) {
			return fmt.Errorf("-phases: unknown phase %q (phases: %s)", p, strings.Join(allPhases, ", "))
		}
	}
	return nil
}

// wants reports whether phase was selected with -phases.
func (o *options) wants(phase string) bool {
	for _, p := range strings.Split(o.phases, ",") {
		if strings.TrimSpace(p) == phase {
			return true
		}
	}
	return false
}
