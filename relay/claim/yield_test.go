package claim_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
)

// countingStore counts the claims made through it: full ones, and those
// limited to recent rows.
type countingStore struct {
	*ledger.Store
	full, recent atomic.Int64
}

func (s *countingStore) Claim(ctx context.Context, q relay.ClaimQuery) ([]*relay.Work, error) {
	if q.DueSince.IsZero() {
		s.full.Add(1)
	} else {
		s.recent.Add(1)
	}
	return s.Store.Claim(ctx, q)
}

// reportLag has the engine's stream report a walsender lag every 100 ms
// until the returned stop (idempotent) is called.
func reportLag(r *rig, lag time.Duration) (stop func()) {
	r.Engine.Stream().Sent(lag)
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				r.Engine.Stream().Sent(lag)
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-stopped }) }
}

// startCounting starts r's engine and a claim source on a countingStore.
func startCounting(t *testing.T, r *rig) (*claim.Source, *countingStore) {
	t.Helper()
	store := &countingStore{Store: r.Store}
	r.mustStartOn(t, store)
	return r.Source, store
}

// While the walsender lags, the claim path makes a full claim at most once a
// second, and in between claims only the aggregates with recent rows (the
// fresh events the stream diverted to it); a lag no longer reported (the
// stream caught up, or stopped) lets it claim back to back again
// (docs/architecture.md, "The claim path yields to a lagging stream").
func TestClaimPathYieldsToALaggingStream(t *testing.T) {
	f := MustFixture(t)
	// The backlog: due an hour ago.
	f.MustInsertMany(t, "old-", 2000, 200, true)
	f.MustExec(t, `UPDATE integration_outbox SET available_at = now() - interval '1 hour', created_at = now() - interval '1 hour'`)
	a := newFakeSink("a", nil)
	r := newRig(t, f, options{Routes: routes(a), BatchSize: 50, PollInterval: 50 * time.Millisecond})
	stopLag := reportLag(r, 2*time.Second)
	defer stopLag()
	started := time.Now()
	src, store := startCounting(t, r)

	time.Sleep(1200 * time.Millisecond)
	// Fresh events diverted to the claim path, on aggregates of their own.
	f.MustExec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, handoff_at)
		SELECT 'order.placed', 'order', 'fresh-' || g, 'new-' || g, '{}', now() FROM generate_series(1, 100) AS g`)
	waitFor(t, 5*time.Second, "the recent rows done while the stream lags", func() bool {
		return f.MustInt(t, `SELECT count(*) FROM integration_outbox WHERE event_key LIKE 'new-%' AND status = 'done'`) == 100
	})
	time.Sleep(time.Second)
	// A full claim a second, and one more for the start.
	elapsed := time.Since(started)
	if n := store.full.Load(); n > int64(elapsed/time.Second)+2 {
		t.Errorf("%d full claims in %s while the stream lagged 2 s, want at most one a second", n, elapsed.Round(time.Millisecond))
	}
	if store.recent.Load() == 0 || src.Stats.Yielded.Load() == 0 {
		t.Errorf("%d claims of recent rows, %d counted as yielded", store.recent.Load(), src.Stats.Yielded.Load())
	}
	if done := f.MustInt(t, `SELECT count(*) FROM integration_outbox WHERE event_key LIKE 'old-%' AND status = 'done'`); done > store.full.Load()*50 {
		t.Errorf("%d backlog rows done in %d full claims of 50 while the stream lagged", done, store.full.Load())
	}

	// The stream caught up: the last report ages, and 2,000 rows at one
	// claim of 50 a second would take 40 s.
	stopLag()
	waitFor(t, 15*time.Second, "every row done once the lag is old", func() bool { return f.MustStatusCount(t, "done") == 2100 })
}

// A lag below the threshold does not slow the claim path, nor does any lag
// in poll mode (there is no stream to yield to).
func TestClaimPathIgnoresASmallLagAndPollMode(t *testing.T) {
	for _, tc := range []struct {
		name string
		all  bool
		lag  time.Duration
	}{
		{"replication mode, lag 100ms", false, 100 * time.Millisecond},
		{"poll mode, lag 2s", true, 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := MustFixture(t)
			f.MustInsertMany(t, "y", 1000, 100, !tc.all)
			a := newFakeSink("a", nil)
			r := newRig(t, f, options{Routes: routes(a), All: tc.all, BatchSize: 50, PollInterval: 50 * time.Millisecond})
			stopLag := reportLag(r, tc.lag)
			defer stopLag()
			src, _ := startCounting(t, r)
			// 20 claims: 20 s if it yielded.
			waitFor(t, 10*time.Second, "every row done", func() bool { return f.MustStatusCount(t, "done") == 1000 })
			if n := src.Stats.Yielded.Load(); n != 0 {
				t.Errorf("%d claims yielded", n)
			}
		})
	}
}
