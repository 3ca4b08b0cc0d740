package main

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/celfilter"
)

// filterSinks are the filters the filter phase routes by: one on a
// payload field and the type, one on a nested field.
var filterSinks = []string{
	`payload.amount > 100 && event_type == "order.created"`,
	`has(payload.customer) && payload.customer.region in ["eu", "uk"]`,
}

// phaseFilter measures what sinks[].filter costs (docs/sinks.md,
// "Filters"): -rate events/s for -duration (at most 10 s), each a fresh
// event of about -payload bytes routed by relay.Route.Takes to two sinks
// with a filter, in this process, as the engine's route does. It reports
// the CPU of the process per event and sink (the payload decoded once per
// event, shared by both filters; target ≤ 5 µs) and the p99 of one event's
// routing. The relay's own CPU under load is the steady phases'.
func phaseFilter(ctx context.Context, e *env, r *report) error {
	const phase = "filter"
	routes := make([]relay.Route, len(filterSinks))
	for i, src := range filterSinks {
		f, err := celfilter.Compile(src)
		if err != nil {
			return fmt.Errorf("compile %q: %w", src, err)
		}
		routes[i] = relay.Route{Events: []string{"order.*"}, Filter: f}
	}
	window := min(e.o.duration, 10*time.Second)
	if e.o.quick {
		window = min(window, 3*time.Second)
	}
	typ := "order.created"
	pad := strings.Repeat("x", max(e.o.payloadSize-120, 0))
	regions := []string{"eu", "us", "uk", "apac"}
	interval := time.Duration(float64(time.Second) / e.o.rate)
	e.say("%s: %.0f events/s for %s, %d sinks with a filter", phase, e.o.rate, window, len(routes))

	// The routing runs on this goroutine's own thread, whose CPU clock
	// counts the routing only: not the pacing, nor the rest of the process.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var took []time.Duration
	taken, n, size := 0, 0, 0
	var cpu time.Duration
	proc0 := processCPU()
	start := time.Now()
	for next := start; time.Since(start) < window; next = next.Add(interval) {
		if d := time.Until(next); d > 0 {
			if !relay.Sleep(ctx, d) {
				return ctx.Err()
			}
		}
		payload := fmt.Sprintf(`{"amount": %d, "currency": "EUR", "customer": {"id": "c-%d", "region": %q}, "pad": %q}`, n%200, n, regions[n%len(regions)], pad)
		size = max(size, len(payload))
		ev := &relay.Event{ID: int64(n), EventKey: fmt.Sprint("k", n), EventType: &typ, Payload: []byte(payload)}
		began, cpu0 := time.Now(), threadCPU()
		for i := range routes {
			ok, err := routes[i].Takes(ev)
			if err != nil {
				return fmt.Errorf("event %d: %w", n, err)
			}
			if ok {
				taken++
			}
		}
		cpu += threadCPU() - cpu0
		took = append(took, time.Since(began))
		n++
	}
	proc := processCPU() - proc0
	perPair := cpu / time.Duration(n*len(routes))
	slices.Sort(took)
	p99 := took[len(took)*99/100]
	r.method("filter: the filters are compiled as the configuration does and run through relay.Route.Takes in the benchmark's own process, " +
		"one fresh event (its payload not yet decoded) per tick; CPU is the routing thread's (CLOCK_THREAD_CPUTIME_ID read around each event's routing), divided by events × sinks; the GC's background work is in the process's CPU, reported beside it.")
	r.add(phase, fmt.Sprintf("CPU per event and sink, %d sinks with a filter, %.0f events/s, payloads of up to %d bytes (%d of %d pairs taken)", len(routes), e.o.rate, size, taken, n*len(routes)),
		fmt.Sprintf("%.2f µs", float64(perPair.Nanoseconds())/1000), "≤ 5 µs", passMiss(perPair <= 5*time.Microsecond), cpuUsage{})
	r.add(phase, "one event's routing to both sinks, p99 (wall)", fmt.Sprintf("%.2f µs", float64(p99.Nanoseconds())/1000), "", "", cpuUsage{})
	r.add(phase, "the benchmark process's CPU over the window per event and sink (pacing, GC and its other goroutines included)",
		fmt.Sprintf("%.2f µs", float64((proc/time.Duration(n*len(routes))).Nanoseconds())/1000), "", "", cpuUsage{})
	return nil
}

// threadCPU returns the CPU time the calling thread has used.
func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// processCPU returns the CPU time (user and system) this process has used.
func processCPU() time.Duration {
	var u syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &u); err != nil {
		return 0
	}
	return time.Duration(u.Utime.Nano() + u.Stime.Nano())
}
