package claim_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// legacyClaim is the seed poller's claim, verbatim.
const legacyClaim = `UPDATE integration_outbox SET status='processing', locked_at=now(), locked_by='legacy'
WHERE id IN (SELECT id FROM integration_outbox WHERE status='pending' AND available_at <= now()
             ORDER BY created_at LIMIT 20 FOR UPDATE SKIP LOCKED)
RETURNING id, event_key`

// Two relays (each its own engine and claim source) in poll mode beside a
// legacy seed-SQL poller on one table, while rows keep arriving: every
// event is delivered by exactly one of {the relays, the legacy poller}, the
// relays deliver it once per sink, and none is lost.
func TestTwoClaimersBesideLegacyPoller(t *testing.T) {
	f := MustFixture(t)
	const batches, perBatch = 30, 100

	ctx, stopLegacy := context.WithCancel(context.Background())
	var (
		legacyMu sync.Mutex
		legacy   = map[string]int{}
		wg       sync.WaitGroup
	)
	wg.Go(func() {
		for ctx.Err() == nil {
			rows, err := f.pool.Query(ctx, legacyClaim)
			if err != nil {
				if ctx.Err() == nil {
					t.Errorf("legacy claim: %v", err)
				}
				return
			}
			var ids []int64
			var (
				id  int64
				key string
			)
			_, err = pgx.ForEachRow(rows, []any{&id, &key}, func() error {
				ids = append(ids, id)
				legacyMu.Lock()
				legacy[key]++
				legacyMu.Unlock()
				return nil
			})
			if err != nil {
				if ctx.Err() == nil {
					t.Errorf("legacy claim: %v", err)
				}
				return
			}
			if len(ids) == 0 {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			time.Sleep(2 * time.Millisecond) // "delivering"
			if _, err := f.pool.Exec(context.Background(), `UPDATE integration_outbox SET status='done' WHERE id = ANY($1)`, ids); err != nil {
				t.Errorf("legacy done: %v", err)
				return
			}
		}
	})
	defer func() { stopLegacy(); wg.Wait() }()

	var claimers []*rig
	var sinks []*fakeSink
	for range 2 {
		a, b := newFakeSink("a", nil), newFakeSink("b", nil)
		sinks = append(sinks, a, b)
		claimers = append(claimers, MustStart(t, f, options{Routes: routes(a, b), All: true,
			PollInterval: 20 * time.Millisecond, BatchSize: 50}))
	}
	for i := range batches {
		f.MustInsertMany(t, fmt.Sprintf("b%02d", i), perBatch, 50, false)
		time.Sleep(20 * time.Millisecond)
	}
	waitFor(t, 60*time.Second, "every row done", func() bool { return f.MustStatusCount(t, "done") == batches*perBatch })
	stopLegacy()
	wg.Wait()

	relay := map[string]map[string]int{"a": {}, "b": {}}
	for _, s := range sinks {
		for key, n := range s.Delivered() {
			relay[s.name][key] += n
		}
	}
	legacyMu.Lock()
	defer legacyMu.Unlock()
	keys := f.MustRows(t)
	for key := range keys {
		switch l, a, b := legacy[key], relay["a"][key], relay["b"][key]; {
		case l == 1 && a == 0 && b == 0:
		case l == 0 && a == 1 && b == 1:
		default:
			t.Errorf("%s: legacy delivered it %d times, relay sink a %d, sink b %d; want exactly one path, once per sink", key, l, a, b)
		}
	}
	t.Logf("%d events: legacy poller delivered %d, claimer 1 claimed %d, claimer 2 claimed %d",
		len(keys), len(legacy), claimers[0].Stats.Claimed.Load(), claimers[1].Stats.Claimed.Load())
	if len(legacy) == 0 || claimers[0].Stats.Claimed.Load() == 0 || claimers[1].Stats.Claimed.Load() == 0 {
		t.Error("one of the three pollers took nothing; the test proves little")
	}
}
