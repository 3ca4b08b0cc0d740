package main

import (
	"math"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// tracker records, for the events "<prefix><i>" with 0 <= i < n, when each
// was committed and when it first reached each destination. Times are
// env.now() values; 0 means "not yet".
type tracker struct {
	prefix string
	commit []atomic.Int64
	nats   arrivals
	hook   arrivals
	floor  arrivals // decoded by the bare pglogrepl client
}

// arrivals are the first arrival times of the events at one destination.
type arrivals struct {
	at      []atomic.Int64
	unique  atomic.Int64 // events that arrived at least once
	repeats atomic.Int64 // arrivals after the first
}

func newTracker(prefix string, n int) *tracker {
	return &tracker{
		prefix: prefix,
		commit: make([]atomic.Int64, n),
		nats:   arrivals{at: make([]atomic.Int64, n)},
		hook:   arrivals{at: make([]atomic.Int64, n)},
		floor:  arrivals{at: make([]atomic.Int64, n)},
	}
}

// index parses an event_key of this tracker.
func (t *tracker) index(key string) (int, bool) {
	rest, ok := strings.CutPrefix(key, t.prefix)
	if !ok {
		return 0, false
	}
	i, err := strconv.Atoi(rest)
	if err != nil || i < 0 || i >= len(t.commit) {
		return 0, false
	}
	return i, true
}

// record notes that key arrived at time at and reports whether key is
// the tracker's; keys of other trackers are ignored.
func (a *arrivals) record(t *tracker, key string, at int64) (tracked bool) {
	i, ok := t.index(key)
	if !ok {
		return false
	}
	if a.at[i].CompareAndSwap(0, at) {
		a.unique.Add(1)
	} else {
		a.repeats.Add(1)
	}
	return true
}

// latencies returns arrival − commit in milliseconds for every event that
// was committed and arrived, and how many committed events have not arrived.
func (t *tracker) latencies(a *arrivals) (ms []float64, missing int) {
	for i := range t.commit {
		c := t.commit[i].Load()
		if c == 0 {
			continue
		}
		at := a.at[i].Load()
		if at == 0 {
			missing++
			continue
		}
		ms = append(ms, float64(at-c)/float64(time.Millisecond))
	}
	slices.Sort(ms)
	return ms, missing
}

// latenciesSplit returns, sorted, arrival − commit in milliseconds of the
// events that have arrived, those committed before at and those committed
// at or after it (at on the clock of env.now).
func (t *tracker) latenciesSplit(a *arrivals, at int64) (before, after []float64) {
	for i := range t.commit {
		c, got := t.commit[i].Load(), a.at[i].Load()
		if c == 0 || got == 0 {
			continue
		}
		ms := float64(got-c) / float64(time.Millisecond)
		if c < at {
			before = append(before, ms)
		} else {
			after = append(after, ms)
		}
	}
	slices.Sort(before)
	slices.Sort(after)
	return before, after
}

// latenciesWithin returns, sorted, arrival − commit in milliseconds of the
// events committed within d of the first commit that have arrived.
func (t *tracker) latenciesWithin(a *arrivals, d time.Duration) []float64 {
	var first int64
	for i := range t.commit {
		if c := t.commit[i].Load(); c != 0 && (first == 0 || c < first) {
			first = c
		}
	}
	var ms []float64
	for i := range t.commit {
		c, at := t.commit[i].Load(), a.at[i].Load()
		if c == 0 || at == 0 || c-first > int64(d) {
			continue
		}
		ms = append(ms, float64(at-c)/float64(time.Millisecond))
	}
	slices.Sort(ms)
	return ms
}

// percentile returns the p-th quantile (0 < p <= 1) of sorted values by the
// nearest-rank method, NaN when there are none.
func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	k := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(k, 0), len(sorted)-1)]
}

// series returns, per bucket of commit time, the median and the largest
// arrival − commit latency (ms) of the events committed in it, for spotting
// stalls. Buckets without arrivals are NaN.
func (t *tracker) series(a *arrivals, bucket time.Duration) (p50, worst []float64) {
	var first int64
	for i := range t.commit {
		if c := t.commit[i].Load(); c != 0 && (first == 0 || c < first) {
			first = c
		}
	}
	var groups [][]float64
	for i := range t.commit {
		c, at := t.commit[i].Load(), a.at[i].Load()
		if c == 0 || at == 0 {
			continue
		}
		k := int((c - first) / int64(bucket))
		for len(groups) <= k {
			groups = append(groups, nil)
		}
		groups[k] = append(groups[k], float64(at-c)/float64(time.Millisecond))
	}
	for _, g := range groups {
		slices.Sort(g)
		p50 = append(p50, percentile(g, 0.5))
		if len(g) == 0 {
			worst = append(worst, math.NaN())
		} else {
			worst = append(worst, g[len(g)-1])
		}
	}
	return p50, worst
}
