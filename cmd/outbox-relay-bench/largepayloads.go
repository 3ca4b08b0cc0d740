package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// The large-payloads phase (docs/performance.md, "Memory"): the relay's
// peak RSS and CPU while it delivers rows of large payloads on each path —
// a new slot's hand-over (the rows inserted before the slot exists), the
// stream behind a slow webhook, the claim path (poll mode) — and rows of
// 10 MB, with the Go runtime at its defaults: GOGC=100 and no memory limit,
// whatever the relay binary would set itself. The stream behind the slow
// webhook runs at four byte budgets (delivery.max_inflight_bytes), so
// that the bound "base + budget × k" can be read off.

// largeRelayEnv is the runtime's defaults, given explicitly: a relay that
// sets a GC percentage or a memory limit of its own keeps off when these
// are set.
var largeRelayEnv = []string{"GOGC=100", "GOMEMLIMIT=off"}

// largeCase is one delivery the phase measures.
type largeCase struct {
	name   string
	path   string // handover, stream or claim
	rows   int
	size   int           // payload bytes
	per    int           // rows per inserting transaction
	delay  time.Duration // the webhook's answer takes this long
	budget string        // delivery.max_inflight_bytes; empty: the default
}

func largeCases() []largeCase {
	const kib600, mib10 = 600 << 10, 10 << 20
	// The slow webhook takes the rows far slower than the stream reads
	// them, so that the engine holds its whole budget most of the time.
	const slow = 200 * time.Millisecond
	return []largeCase{
		{name: "handover", path: "handover", rows: 900, size: kib600, per: 10},
		{name: "stream-slow", path: "stream", rows: 900, size: kib600, per: 10, delay: slow},
		{name: "claim", path: "claim", rows: 900, size: kib600, per: 10},
		{name: "stream-10mb", path: "stream", rows: 20, size: mib10, per: 1},
		{name: "handover-10mb", path: "handover", rows: 20, size: mib10, per: 1},
		{name: "stream-slow-32mib", path: "stream", rows: 900, size: kib600, per: 10, delay: slow, budget: "32MiB"},
		{name: "stream-slow-128mib", path: "stream", rows: 900, size: kib600, per: 10, delay: slow, budget: "128MiB"},
		{name: "stream-slow-256mib", path: "stream", rows: 900, size: kib600, per: 10, delay: slow, budget: "256MiB"},
	}
}

// phaseLargePayloads runs every case of largeCases, each on a fresh
// database with a relay of its own and one webhook sink.
func phaseLargePayloads(ctx context.Context, e *env, r *report) error {
	const phase = "large-payloads"
	r.method(phase + ": the relay runs with GOGC=100 and GOMEMLIMIT=off (the Go runtime's defaults) and one webhook sink, on a fresh database per case; " +
		"peak RSS is the larger of VmHWM and the largest VmRSS sampled every 100 ms, CPU the relay's from relay start to the last delivery")
	for _, c := range largeCases() {
		if err := e.largeCase(ctx, r, phase, c); err != nil {
			return fmt.Errorf("%s %s: %w", phase, c.name, err)
		}
	}
	return nil
}

// largeCase measures one case.
func (e *env) largeCase(ctx context.Context, r *report, phase string, c largeCase) error {
	name := phase + "-" + c.name
	db := "bench_" + strings.ReplaceAll(name, "-", "_")
	url, err := e.newDatabase(ctx, db)
	if err != nil {
		return err
	}
	defer e.dropDatabase(db)
	hook, err := newSlowReceiver(c.delay)
	if err != nil {
		return err
	}
	defer hook.close()
	s := relaySetup{name: name, url: url}
	cfg, err := e.writeLargeConfig(s, c, hook.url)
	if err != nil {
		return err
	}
	prefix := c.name + "-"
	switch c.path {
	case "stream":
		e.say("%s: creating slot %s (start the relay, stop it with SIGTERM)", name, s.slot())
		if err := e.createLargeSlot(ctx, s, cfg); err != nil {
			return err
		}
	case "handover", "claim":
	default:
		return fmt.Errorf("unknown path %q", c.path)
	}
	e.say("%s: inserting %d rows of %d KiB (%d per transaction) with the relay stopped", name, c.rows, c.size>>10, c.per)
	if err := e.insertLarge(ctx, url, prefix, c); err != nil {
		return err
	}
	if err := e.quiet(ctx, name, r, e.roots(nil)); err != nil {
		return err
	}
	rp, err := harness.StartRelay(e.o.relayBin, cfg, filepath.Join(e.work, "relay-"+name+".log"), append(largeRelayEnv, e.o.relayEnv...)...)
	if err != nil {
		return err
	}
	defer rp.Stop(30 * time.Second)
	meter := startCPU(e.roots(rp))
	rss := sampleRSS(rp.Pid())
	start := time.Now()
	last, lastAt, lastSay := int64(0), start, start
	for {
		got := hook.count.Load()
		if got >= int64(c.rows) {
			break
		}
		if got > last {
			last, lastAt = got, time.Now()
		}
		if rp.Exited() {
			return rp.Failure()
		}
		if time.Since(lastAt) > 60*time.Second {
			return fmt.Errorf("no delivery for 60 s: %d of %d delivered (log %s)", got, c.rows, rp.LogPath())
		}
		if time.Since(lastSay) >= 5*time.Second {
			lastSay = time.Now()
			e.say("%s: %.0f s: %d/%d delivered", name, time.Since(start).Seconds(), got, c.rows)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	took := time.Since(start)
	usage := meter.stop()
	peak, maxRSS := rss.finish()
	if err := rp.Stop(30 * time.Second); err != nil {
		e.say("warning: %v", err)
	}
	budget := c.budget
	if budget == "" {
		budget = "64MiB (default)"
	}
	what := map[string]string{
		"handover": "a new slot's hand-over (rows inserted before the slot)",
		"stream":   "the stream",
		"claim":    "the claim path (poll mode)",
	}[c.path]
	if c.delay > 0 {
		what += fmt.Sprintf(", webhook answering in %s (8 requests at a time)", c.delay)
	}
	cpu := usage.groups["relay"] * usage.wall.Seconds()
	value := fmt.Sprintf("peak RSS %s (largest VmRSS sample %s); relay CPU %.2f s; delivered in %.1f s", mb(peak), mb(maxRSS), cpu, took.Seconds())
	target, verdict := "—", "—"
	if c.budget == "" && c.rows*c.size > 300<<20 {
		// 900 rows of 600 KiB with the default budget (docs/performance.md).
		target, verdict = "< 300 MB", passMiss(peak < 300<<20)
	}
	r.add(name, fmt.Sprintf("%d rows of %s through %s; max_inflight_bytes %s", c.rows, sizeText(c.size), what, budget), value, target, verdict, usage)
	r.addCPU(name, usage, "")
	e.say("%s: %s", name, value)
	return nil
}

// sizeText writes a payload size in KiB or MiB.
func sizeText(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}

// writeLargeConfig writes the configuration of a case: one webhook sink at
// url, the case's mode and budget, the process-level levers off.
func (e *env) writeLargeConfig(s relaySetup, c largeCase, url string) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "database_url: %q\n", s.url)
	fmt.Fprintf(&b, "data_dir: %q\n", filepath.Join(e.work, "relay-data-"+s.name))
	b.WriteString("source:\n")
	if c.path == "claim" {
		b.WriteString("  mode: poll\n")
	}
	fmt.Fprintf(&b, "  slot: %s\n", s.slot())
	b.WriteString("sinks:\n  - name: hook\n    type: webhook\n")
	fmt.Fprintf(&b, "    url: %q\n", url)
	b.WriteString("    max_body: 32MiB\n")
	if c.budget != "" {
		fmt.Fprintf(&b, "delivery:\n  max_inflight_bytes: %s\n", c.budget)
	}
	b.WriteString("http:\n  listen: 127.0.0.1:0\n")
	b.WriteString("cpu_scheduling: normal\n")
	b.WriteString("shutdown_timeout: 20s\n")
	b.WriteString("log: {level: info, format: json}\n")
	path := filepath.Join(e.work, "relay-"+s.name+".yaml")
	return path, os.WriteFile(path, []byte(b.String()), 0o600)
}

// createLargeSlot starts the relay until it streams from its new slot,
// then stops it: rows inserted afterwards are streamed at the next start.
func (e *env) createLargeSlot(ctx context.Context, s relaySetup, cfg string) error {
	rp, err := harness.StartRelay(e.o.relayBin, cfg, filepath.Join(e.work, "relay-"+s.name+".log"), append(largeRelayEnv, e.o.relayEnv...)...)
	if err != nil {
		return err
	}
	if err := e.waitSlotActive(ctx, s, rp, 60*time.Second); err != nil {
		_ = rp.Stop(5 * time.Second)
		return err
	}
	return rp.Stop(30 * time.Second)
}

// insertLarge inserts c.rows rows of c.size payload bytes, c.per to a
// transaction, generated by the server.
func (e *env) insertLarge(ctx context.Context, url, prefix string, c largeCase) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	for from := 0; from < c.rows; from += c.per {
		to := min(from+c.per, c.rows) - 1
		if _, err := pool.Exec(ctx, bulkInsertSQL, from, to, e.o.aggregates, prefix, c.size); err != nil {
			return fmt.Errorf("insert rows %d-%d: %w", from, to, err)
		}
	}
	return nil
}

// slowReceiver is a webhook destination that answers 204 after delay and
// counts the distinct event keys it received.
type slowReceiver struct {
	srv   *harness.HTTPServer
	url   string
	delay time.Duration
	seen  sync.Map
	count atomic.Int64
}

func newSlowReceiver(delay time.Duration) (*slowReceiver, error) {
	r := &slowReceiver{delay: delay}
	srv, err := harness.ServeHTTP(r, "/hook")
	if err != nil {
		return nil, err
	}
	r.srv, r.url = srv, srv.URL
	return r, nil
}

// ServeHTTP counts the delivery and answers 204 after the delay.
func (r *slowReceiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	var env struct {
		EventKey string `json:"event_key"`
	}
	if err := json.NewDecoder(req.Body).Decode(&env); err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	_, _ = io.Copy(io.Discard, req.Body)
	time.Sleep(r.delay)
	if _, dup := r.seen.LoadOrStore(env.EventKey, true); !dup {
		r.count.Add(1)
	}
	w.WriteHeader(http.StatusNoContent)
}

func (r *slowReceiver) close() { r.srv.Close() }
