package main

import (
	"fmt"
	"io"
	"runtime"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// print writes the markdown report.
func (res *result) print(w io.Writer, s *stack, args []string) {
	o, p := s.o, s.o.profile
	th := harness.Thousands
	fmt.Fprintf(w, "\n### Chaos run\n\n")
	quiet := "did not quiesce within " + p.quiesce.String()
	if res.quiesced >= 0 {
		quiet = fmt.Sprintf("everything delivered %.1f s after the writers stopped", res.quiesced.Seconds())
	}
	fmt.Fprintf(w, "Command: `outbox-relay-chaos %s` (via `make chaos ARGS=...`): profile %s, seed %d; %.0f s in all, of which load and faults %.0f s; %s.\n\n",
		strings.Join(args, " "), p.name, o.seed, res.took.Seconds(), res.loadTook.Seconds(), quiet)
	fmt.Fprintf(w, "Setup: %d CPUs; %s (fsync on, private cluster); nats-server %s (external process, JetStream file storage); relay %s; "+
		"two relays on one config (leader + standby), webhook timeout %s, backoff [500ms, 1s, 2s, 3s]. Load: %d writers, %.0f events/s, %d aggregates, %.0f%% of transactions with 2–%d rows and %.1f%% with %d–%d; %.1f%% of rows with a NULL status; %.2f%% of single-row transactions with a payload of %d–%d KiB; another table (not published) takes about 2 MB/s of WAL.\n\n",
		runtime.NumCPU(), s.pgVer, s.natsVer, harness.RelayVersion(o.relayBin), o.hookTimeout, p.writers, p.rate, p.aggregates, 100*multiRowShare, maxRowsPerTx, 100*bulkShare, bulkMin, bulkMax,
		100*nullStatusShare, 100*largeShare, s.largeMin>>10, s.largeMax>>10)

	st := &res.load.stats
	fmt.Fprintln(w, "| figure | value |")
	fmt.Fprintln(w, "|---|---|")
	single, multi, bulk := st.txSingle.Load(), st.txMulti.Load(), st.txBulk.Load()
	fmt.Fprintf(w, "| events published (committed) | %s in %s transactions (%s single-row, %s of 2–%d rows, %s of %d–%d rows), %.0f/s |\n",
		th(len(res.events)), th(int(single+multi+bulk)), th(int(single)), th(int(multi)), maxRowsPerTx, th(int(bulk)), bulkMin, bulkMax,
		float64(len(res.events))/res.loadTook.Seconds())
	fmt.Fprintf(w, "| rows with a NULL available_at / scheduled %.0f s (±50%%) ahead | %s / %s |\n",
		scheduledIn.Seconds(), th(int(st.nullAt.Load())), th(int(st.scheduled.Load())))
	fmt.Fprintf(w, "| rows with a NULL status / with a large payload | %s / %s |\n", th(int(st.nullStatus.Load())), th(int(st.large.Load())))
	fmt.Fprintf(w, "| rows the faults wrote or deleted | %s |\n", res.shapeFigures())
	fmt.Fprintf(w, "| writer attempts that failed (outcome resolved by looking for the rows) | %s: %s had committed after all, %s had not (written again); %s retries met the earlier attempt's rows |\n",
		th(int(st.failedAttempts.Load())), th(int(st.foundCommitted.Load())), th(int(st.foundNotCommitted.Load())), th(int(st.uniqueAfterFailure.Load())))
	fmt.Fprintf(w, "| rows by status at the end | %s |\n", res.statusCounts())
	fmt.Fprintf(w, "| faults injected | %s |\n", res.faultCounts())
	fmt.Fprintf(w, "| relay processes | %d starts, %d leadership terms, %d unexpected exits, %d fallbacks to polling, %d rows settled as deleted before their outcome was written |\n",
		res.relayStarts, res.leaderTerms, len(res.unexpected), res.fallbacks, res.settledGone)
	if res.failovers > 0 {
		fmt.Fprintf(w, "| failovers: events delivered as a row of the old primary that the new one lacks (written again by their writer: same key and id, another row id) | %d in %d failovers |\n",
			res.lostInFailover, res.failovers)
	}
	fmt.Fprintf(w, "| webhook | %s |\n", res.hookFigures())
	fmt.Fprintf(w, "| NATS | %s |\n", res.natsFigures())
	m := res.mon
	fmt.Fprintf(w, "| max retained WAL (slot, current − restart_lsn) | %s at %.0f s (bound %s); unacknowledged (current − confirmed_flush_lsn) max %s; pg_wal max %s; %s of WAL written during the run; %d samples, %d s unreadable (PostgreSQL down) |\n",
		mb(m.maxRetained.retained), m.maxRetained.at.Seconds(), mb(o.walBound), mb(m.maxUnacked.unacked), mb(m.maxWALDir.walDirSum),
		mb(m.last.current-m.first.current), m.samples, m.gaps)
	fmt.Fprintf(w, "| duration | %.0f s (load and faults %.0f s) |\n", res.took.Seconds(), res.loadTook.Seconds())

	fmt.Fprintln(w, "\nRecovery, from the moment a fault was healed: to the first event committed afterwards at both sinks, and to every event committed before it at both sinks (backlog drained).")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| fault | what | count | fault lasted | first new event at both sinks (min / max) | backlog drained (min / max) |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	for _, k := range faultKinds {
		var fs []faultRecord
		for _, f := range res.faults {
			if f.kind == k {
				fs = append(fs, f)
			}
		}
		if len(fs) == 0 {
			continue
		}
		lasted := spread(fs, func(f faultRecord) time.Duration { return f.healed - f.at })
		first := spread(fs, func(f faultRecord) time.Duration { return f.firstNew })
		drained := spread(fs, func(f faultRecord) time.Duration { return f.drained })
		fmt.Fprintf(w, "| %s | %s | %d | %s | %s | %s |\n", k, faultWhat[k], len(fs), lasted, first, drained)
	}
	fmt.Fprintln(w, "\n<details><summary>Every fault, in order</summary>")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| # | at | fault | note | first new event at both sinks | backlog drained |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	for i, f := range res.faults {
		note := f.note
		if f.err != nil {
			note = "**error**: " + mdEscape(f.err.Error())
		}
		fmt.Fprintf(w, "| %d | %.1f s | %s | %s | %s | %s |\n", i+1, f.at.Seconds(), f.kind, note, fmtRecovery(f.firstNew), fmtRecovery(f.drained))
	}
	fmt.Fprintln(w, "\n</details>")

	fmt.Fprintln(w, "\n| invariant | checked | result |")
	fmt.Fprintln(w, "|---|---|---|")
	for _, iv := range res.invariants {
		verdict := "pass"
		if !iv.ok() {
			verdict = fmt.Sprintf("**FAIL** (%d)", len(iv.Violations))
		}
		fmt.Fprintf(w, "| %s | %s | %s |\n", iv.Name, mdEscape(iv.Checked), verdict)
	}
	fmt.Fprintln(w)
}

// statusCounts lists the outbox rows by status.
func (res *result) statusCounts() string {
	n := map[string]int{}
	for _, e := range res.events {
		n[e.Status]++
	}
	var parts []string
	for _, st := range []string{"done", "pending", "processing", "held", "failed"} {
		parts = append(parts, fmt.Sprintf("%s %s", st, harness.Thousands(n[st])))
		delete(n, st)
	}
	for st, c := range n {
		parts = append(parts, fmt.Sprintf("%q %s", st, harness.Thousands(c)))
	}
	return strings.Join(parts, ", ")
}

// shapeFigures summarises what handover-delete and long-keys wrote and
// deleted.
func (res *result) shapeFigures() string {
	var deleted, long, beside int
	shortest, longest := 0, 0
	for _, f := range res.faults {
		deleted += len(f.deleted)
		long += len(f.longKeys)
		beside += len(f.beside)
		for _, k := range f.longKeys {
			if shortest == 0 || len(k) < shortest {
				shortest = len(k)
			}
			longest = max(longest, len(k))
		}
	}
	return fmt.Sprintf("handover-delete deleted %d pending rows during new slots' hand-overs; long-keys wrote %d keys of %d–%d bytes beside %d rows with normal keys",
		deleted, long, shortest, longest, beside)
}

// faultCounts lists how many faults of each kind were injected.
func (res *result) faultCounts() string {
	n := map[faultKind]int{}
	for _, f := range res.faults {
		n[f.kind]++
	}
	var parts []string
	for _, k := range faultKinds {
		parts = append(parts, fmt.Sprintf("%s %d", k, n[k]))
	}
	return strings.Join(parts, ", ")
}

// hookFigures summarises the receiver's record.
func (res *result) hookFigures() string {
	keys, okKeys := map[string]bool{}, map[string]bool{}
	var ok, unavailable, held, applied int
	for _, d := range res.hook {
		key := bodyKey(d.Body)
		keys[key] = true
		switch {
		case d.Status >= 200 && d.Status < 300:
			ok++
			okKeys[key] = true
		case d.Status == 0:
			held++
		default:
			unavailable++
		}
		if d.Applied {
			applied++
		}
	}
	th := harness.Thousands
	return fmt.Sprintf("%s requests for %s events: %s × 2xx, %s × 503, %s held past the timeout; repeats %s (%s after a 2xx, absorbed by the webhook-id dedup); %s side effects applied",
		th(len(res.hook)), th(len(keys)), th(ok), th(unavailable), th(held), th(len(res.hook)-len(keys)), th(ok-len(okKeys)), th(applied))
}

// natsFigures summarises the stream and the tap.
func (res *result) natsFigures() string {
	distinct := func(ms []natsMessage) int {
		k := map[string]bool{}
		for _, m := range ms {
			k[bodyKey(m.Body)] = true
		}
		return len(k)
	}
	th := harness.Thousands
	stored, tapped := distinct(res.stored), distinct(res.tapped)
	return fmt.Sprintf("%s messages stored for %s events (%s second copies); the tap saw %s publishes of %s events (%s repeats, the stream's duplicate window dropped them)",
		th(len(res.stored)), th(stored), th(len(res.stored)-stored), th(len(res.tapped)), th(tapped), th(len(res.tapped)-tapped))
}

// spread formats the minimum and maximum of a figure over faults; a
// negative value is "never", which makes the maximum "never" too.
func spread(fs []faultRecord, f func(faultRecord) time.Duration) string {
	lo, hi := time.Duration(-1), time.Duration(0)
	for _, x := range fs {
		v := f(x)
		if v >= 0 && (lo < 0 || v < lo) {
			lo = v
		}
		if v < 0 || hi < 0 {
			hi = -1
		} else {
			hi = max(hi, v)
		}
	}
	if len(fs) == 1 {
		return fmtRecovery(hi)
	}
	return fmtRecovery(lo) + " / " + fmtRecovery(hi)
}

// mdEscape keeps a message from breaking the table.
func mdEscape(s string) string {
	return strings.ReplaceAll(strings.ReplaceAll(s, "|", `\|`), "\n", " ")
}
