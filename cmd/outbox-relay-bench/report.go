package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// report collects the results of every phase, and the values later phases
// compare against.
type report struct {
	rows  []resultRow
	cpu   []cpuRow
	notes []string
	// methods say how a phase measures what its rows show, once each.
	methods []string

	ceiling      float64 // pg_recvlogical rows/s
	drainJS      float64 // relay events/s into JetStream
	relayHookP50 float64 // ms, steady phase
}

// resultRow is one line of the results table.
type resultRow struct {
	phase, metric, value, target, verdict, others string
}

// cpuRow is one line of the CPU table.
type cpuRow struct {
	phase       string
	u           cpuUsage
	reapedLabel string // what the bench's reaped children were, if any
}

// add appends a result; u is the phase's measured window.
func (r *report) add(phase, metric, value, target, verdict string, u cpuUsage) {
	others := "—"
	if u.wall > 0 {
		others = fmt.Sprintf("%.2f cores (%.0f%%)", u.others, 100*u.others/float64(runtime.NumCPU()))
	}
	r.rows = append(r.rows, resultRow{phase, metric, value, target, verdict, others})
}

// method adds a paragraph on how something was measured, once.
func (r *report) method(text string) {
	if !slices.Contains(r.methods, text) {
		r.methods = append(r.methods, text)
	}
}

// addCPU appends a phase's CPU breakdown.
func (r *report) addCPU(phase string, u cpuUsage, reapedLabel string) {
	r.cpu = append(r.cpu, cpuRow{phase, u, reapedLabel})
}

// run sets the machine up, runs the selected phases and prints the report.
func run(ctx context.Context, o options, args []string) error {
	e, err := setUp(ctx, o, os.Stderr)
	if err != nil {
		return err
	}
	defer e.close()
	r := &report{}
	started := time.Now()
	load := loadAvg()
	for _, phase := range append(allPhases, extraPhases...) {
		if !o.wants(phase) {
			continue
		}
		e.say("phase %s", phase)
		phaseStart := time.Now()
		err := phaseFuncs[phase](ctx, e, r)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			e.say("phase %s failed: %v", phase, err)
			msg, _, _ := strings.Cut(err.Error(), "\n")
			r.add(phase, "error", mdEscape(msg), "", "FAILED", cpuUsage{})
		}
		e.say("phase %s took %.0f s", phase, time.Since(phaseStart).Seconds())
	}
	r.print(os.Stdout, e, args, load, time.Since(started))
	var failed []string
	for _, row := range r.rows {
		if row.verdict == "FAILED" {
			failed = append(failed, row.phase)
		}
	}
	if len(failed) > 0 {
		return errors.New("phases failed: " + strings.Join(failed, ", "))
	}
	return nil
}

// print writes the markdown report.
func (r *report) print(w io.Writer, e *env, args []string, load string, took time.Duration) {
	o := e.o
	fmt.Fprintf(w, "\n### Benchmark\n\n")
	fmt.Fprintf(w, "Command: `outbox-relay-bench %s` (via `make bench ARGS=...`), %.0f s in all.\n\n", strings.Join(args, " "), took.Seconds())
	fmt.Fprintf(w, "Machine: %d CPUs (%s), %s RAM; %s (fsync on, private cluster); nats-server %s (external process, JetStream file storage, default sync); %s %s/%s; relay %s. Load average at start: %s.\n\n",
		runtime.NumCPU(), cpuModel(), memTotal(), e.pgVer, strings.TrimPrefix(e.natsVer, "nats-server: "),
		runtime.Version(), runtime.GOOS, runtime.GOARCH, harness.RelayVersion(o.relayBin), load)
	fmt.Fprintf(w, "Layout: %s.\n\n", e.place.describe())
	fmt.Fprintf(w, "Workload: %s aggregates, %d-byte payloads (jsonb), ledger on, one event per transaction under load, %d rows per transaction for the drains; a fresh database per phase.\n\n",
		thousands(o.aggregates), o.payloadSize, o.drainBatch)
	fmt.Fprintln(w, "| phase | metric | value | target | verdict | other processes' CPU |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	for _, row := range r.rows {
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", row.phase, row.metric, row.value, row.target, row.verdict, row.others)
	}
	if len(r.cpu) > 0 {
		fmt.Fprintf(w, "\nCPU during each measured window, in cores (1.00 = one CPU busy; this machine has %d):\n\n", runtime.NumCPU())
		fmt.Fprintln(w, "| phase | window | relay | postgres | nats-server | pg_recvlogical | bench (load, receiver, subscriber, floor client) | kernel (threads, irq) | steal | other processes |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|")
		for _, c := range r.cpu {
			g := c.u.groups
			reaped := "—"
			if c.reapedLabel != "" {
				reaped = fmt.Sprintf("%.2f", g["reaped"])
			}
			fmt.Fprintf(w, "| %s | %.1f s | %.2f | %.2f | %.2f | %s | %.2f | %.2f | %.2f | %.2f |\n",
				c.phase, c.u.wall.Seconds(), g["relay"], g["postgres"], g["nats"], reaped, g["bench"], c.u.kernel, c.u.steal, c.u.others)
		}
	}
	fmt.Fprintln(w, "\nLatencies: commit time is taken in the load generator right after COMMIT returns; NATS arrival is the message reaching a core subscriber of the stream's subjects (≈ the PubAck), webhook arrival the receiver reading the body (before its 2xx). Before each phase:")
	for _, n := range r.notes {
		fmt.Fprintf(w, "- %s\n", n)
	}
	fmt.Fprintln(w)
	for _, m := range r.methods {
		fmt.Fprintf(w, "%s\n\n", m)
	}
}

// passMiss is a verdict.
func passMiss(ok bool) string {
	if ok {
		return "pass"
	}
	return "**MISS**"
}

// fmtMS formats milliseconds.
func fmtMS(v float64) string {
	switch {
	case math.IsNaN(v):
		return "n/a (nothing arrived)"
	case v >= 10000:
		return fmt.Sprintf("%s ms", thousands(int(v)))
	case v >= 100:
		return fmt.Sprintf("%.0f ms", v)
	default:
		return fmt.Sprintf("%.2f ms", v)
	}
}

// mb formats bytes as megabytes (MiB, as RSS limits are usually meant).
func mb(b int64) string { return fmt.Sprintf("%.0f MB", float64(b)/(1<<20)) }

// thousands formats n with comma separators.
func thousands(n int) string { return harness.Thousands(n) }

// mdEscape keeps a message from breaking the table.
func mdEscape(s string) string {
	return strings.ReplaceAll(s, "|", `\|`)
}
