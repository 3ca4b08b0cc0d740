package replication_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// TestReconcileDuringAHandOverKeepsTheOrder: `outbox-relay reconcile` run
// while a new slot's hand-over delivers the rows pending before it must
// not let a streamed event of an aggregate overtake that aggregate's older
// rows (docs/guarantees.md, "Per-aggregate order"). Here the hand-over has
// read its snapshot (aggregate order/A pinned) and fed its first slice
// when reconcile runs; the rows of its second slice are old enough for
// reconcile. A new event of order/A is inserted once the hand-over
// releases the aggregate's pin. Before, reconcile handed the second
// slice's rows to the claim path, the hand-over left them out and
// released the pin, and the new event, streamed into a lane that knew
// nothing of them, was delivered before them (the claim path's ordering
// check holds back only the rows it claims). Now reconcile refuses while
// a hand-over is not recorded.
func TestReconcileDuringAHandOverKeepsTheOrder(t *testing.T) {
	e := newEnv(t)
	// 1,000 fresh rows (the first slice) and 1,000 an hour old (the
	// second), all of order/A.
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id, created_at)
		SELECT 'a-' || g, 'x', 'order', 'A', CASE WHEN g > 1000 THEN now() - interval '1 hour' ELSE now() END
		  FROM generate_series(1, 2000) g`)
	sink := &scriptedSink{}
	claim := &claimRecorder{url: e.url}
	var reconciled sync.Once
	var reconcileErr error
	var reconciledRows int64
	released := make(chan struct{})
	var releaseOnce sync.Once
	// The operator's outbox-relay reconcile, on a pool of its own.
	pool, err := pgxpool.New(context.Background(), e.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	operator := mustStore(t, pool, ledger.DefaultConfig())
	claim.afterFeed = func(ctx context.Context, _ []*relay.Event) {
		reconciled.Do(func() { reconciledRows, reconcileErr = operator.Reconcile(ctx, 30*time.Minute) })
	}
	claim.afterFed = func(aggs []relay.AggregateKey) {
		if slices.Contains(aggs, relay.AggregateKey{Type: "order", ID: "A"}) {
			releaseOnce.Do(func() { close(released) })
		}
	}
	startRelayRigWith(t, e, sink, claim, true)
	select {
	case <-released:
	case <-time.After(30 * time.Second):
		t.Fatal("the hand-over never released order/A")
	}
	e.insert(t, "fresh-A") // e.insert gives it aggregate test/fresh-A
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id) VALUES ('a-new', 'x', 'order', 'A')`)
	if !errors.Is(reconcileErr, ledger.ErrHandOverUnfinished) || reconciledRows != 0 {
		t.Errorf("reconcile during the hand-over: %d rows, %v; want it refused (ledger.ErrHandOverUnfinished)", reconciledRows, reconcileErr)
	}

	waitFor(t, 60*time.Second, "every row of order/A delivered", func() bool {
		sink.mu.Lock()
		defer sink.mu.Unlock()
		return len(sink.delivered) >= 2002
	})
	sink.mu.Lock()
	order := slices.Clone(sink.delivered)
	sink.mu.Unlock()
	// Each key's first delivery, in order: a-1 … a-2000, then a-new.
	rank := func(k string) int {
		if k == "a-new" {
			return 1 << 30
		}
		var n int
		fmt.Sscanf(k, "a-%d", &n)
		return n
	}
	last, seen := "", map[string]bool{}
	for i, k := range order {
		if seen[k] || !strings.HasPrefix(k, "a-") {
			continue
		}
		seen[k] = true
		if last != "" && rank(k) < rank(last) {
			t.Fatalf("order/A: %s delivered (%d of %d) after %s", k, i+1, len(order), last)
		}
		last = k
	}
}
