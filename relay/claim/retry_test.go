package claim_test

import (
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Transient errors: every retry waits its backoff (plus at most 10% jitter,
// one poll interval and scheduling slack), the attempt header counts up,
// and everything is delivered in the end.
func TestRetryGapsFollowBackoff(t *testing.T) {
	f := MustFixture(t)
	const rows = 20
	f.MustInsertMany(t, "evt", rows, rows, true)
	backoff := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second}
	poll200 := 200 * time.Millisecond

	var mu sync.Mutex
	failures := map[string]int{}
	a := newFakeSink("a", func(d *relay.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		if failures[d.Event.EventKey] < len(backoff) {
			failures[d.Event.EventKey]++
			return relay.TransientError(errors.New("HTTP 503"), 0)
		}
		return nil
	})
	c := MustStart(t, f, options{Routes: routes(a), PollInterval: poll200, Backoff: backoff})
	waitFor(t, 30*time.Second, "every row done", func() bool { return f.MustStatusCount(t, "done") == rows })

	perKey := map[string][]call{}
	for _, c := range a.Calls() {
		perKey[c.Key] = append(perKey[c.Key], c)
	}
	var worst [3]time.Duration
	for key, calls := range perKey {
		slices.SortFunc(calls, func(x, y call) int { return x.At.Compare(y.At) })
		if len(calls) != len(backoff)+1 {
			t.Errorf("%s: %d sends, want %d", key, len(calls), len(backoff)+1)
			continue
		}
		for i, b := range backoff {
			gap := calls[i+1].At.Sub(calls[i].At)
			upper := b + b/10 + poll200 + 500*time.Millisecond
			if gap < b || gap > upper {
				t.Errorf("%s: retry %d after %s, want within [%s, %s]", key, i+1, gap, b, upper)
			}
			worst[i] = max(worst[i], gap)
			if calls[i+1].Attempt != i+2 {
				t.Errorf("%s: send %d carried attempt %d", key, i+2, calls[i+1].Attempt)
			}
		}
	}
	t.Logf("longest gaps for backoff %v: %v (bound: b + 10%% + %s + 0.5s)", backoff, worst, poll200)
	for key, r := range f.MustRows(t) {
		if r.Attempts != len(backoff) {
			t.Errorf("%s: attempts %d, want %d", key, r.Attempts, len(backoff))
		}
	}
	if got := c.Engine.Stats.Retried.Load(); got != rows*int64(len(backoff)) {
		t.Errorf("Engine.Stats.Retried = %d, want %d", got, rows*len(backoff))
	}
}

// A sink that is down opens its circuit: rows wait for it without counting
// attempts and are not sent while it is open (Retry-After when given, else
// 1 s, then 2 s).
func TestSinkDownDoesNotCountAttempts(t *testing.T) {
	for _, tc := range []struct {
		name       string
		retryAfter time.Duration
		downFor    time.Duration
		wantGaps   []time.Duration // between waves of sends
	}{
		{name: "retry-after", retryAfter: 700 * time.Millisecond, downFor: 1200 * time.Millisecond,
			wantGaps: []time.Duration{700 * time.Millisecond, 700 * time.Millisecond}},
		{name: "doubling", downFor: 2500 * time.Millisecond,
			wantGaps: []time.Duration{time.Second, 2 * time.Second}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := MustFixture(t)
			const rows = 10
			f.MustInsertMany(t, "evt", rows, 0, true)
			var (
				once  sync.Once
				start time.Time
			)
			a := newFakeSink("a", func(*relay.Delivery) error {
				once.Do(func() { start = time.Now() })
				if time.Since(start) < tc.downFor {
					return relay.SinkDownError(errors.New("HTTP 401: check the credentials"), tc.retryAfter)
				}
				return nil
			})
			MustStart(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond})
			waitFor(t, 20*time.Second, "every row done", func() bool { return f.MustStatusCount(t, "done") == rows })

			for key, r := range f.MustRows(t) {
				if r.Attempts != 0 {
					t.Errorf("%s: attempts %d, want 0 (sink-level failures do not count)", key, r.Attempts)
				}
			}
			calls := a.Calls()
			slices.SortFunc(calls, func(x, y call) int { return x.At.Compare(y.At) })
			var waves []time.Time
			for i, c := range calls {
				if c.Attempt != 1 {
					t.Errorf("%s sent with attempt %d, want 1", c.Key, c.Attempt)
				}
				if i == 0 || c.At.Sub(calls[i-1].At) > 300*time.Millisecond {
					waves = append(waves, c.At)
				}
			}
			if len(waves) != len(tc.wantGaps)+1 {
				t.Fatalf("%d waves of sends at %v, want %d", len(waves), waves, len(tc.wantGaps)+1)
			}
			for i, want := range tc.wantGaps {
				gap := waves[i+1].Sub(waves[i])
				if gap < want-5*time.Millisecond || gap > want+600*time.Millisecond {
					t.Errorf("wave %d came %s after the previous one, want ≈ %s (the circuit)", i+2, gap, want)
				}
				t.Logf("wave %d: %s after wave %d (circuit %s)", i+2, gap.Round(time.Millisecond), i+1, want)
			}
			if got := len(calls); got > rows*len(waves) {
				t.Errorf("%d sends, want at most %d (each row at most once per wave)", got, rows*len(waves))
			}
			for key, n := range a.Delivered() {
				if n != 1 {
					t.Errorf("%s delivered %d times", key, n)
				}
			}
		})
	}
}

// The Attempt of a row taken from the stream continues its count.
func TestAttemptContinuesTheRowsCount(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t, event{Key: "k", Diverted: true})
	f.MustExec(t, `UPDATE integration_outbox SET attempts = 2`)
	a := newFakeSink("a", nil)
	MustStart(t, f, options{Routes: routes(a), PollInterval: 50 * time.Millisecond})
	waitFor(t, 10*time.Second, "row done", func() bool { return f.MustRow(t, "k").Status == "done" })
	if calls := a.Calls(); len(calls) != 1 || calls[0].Attempt != 3 {
		t.Errorf("calls %+v, want one with attempt 3", calls)
	}
}
