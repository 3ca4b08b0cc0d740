package replication_test

import (
	"context"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestStreamAllocatesPerTransactionOnlyItsEvent: a session reading and
// decoding a run of single-row transactions allocates, per transaction,
// about what the event keeps (its tuple's copy, the event, its texts):
// not a context watch per message read (pgconn's, three allocations each,
// about three messages per transaction), nor pglogrepl's Begin, Commit and
// per-column objects (docs/performance.md, "Between goroutines").
// TestSingleEventTransactionAllocatesOnlyItsEvent counts the decoder's
// exactly; this one counts the whole process while the session runs.
func TestStreamAllocatesPerTransactionOnlyItsEvent(t *testing.T) {
	const (
		warmUp   = 1000 // events before the count starts
		measured = 4000 // events counted
		perEvent = 6.0  // allocations allowed per event, the consumer's included
	)
	e := newEnv(t)
	var (
		mu             sync.Mutex
		seen, from, to int
		before, done   runtime.MemStats
		finished       = make(chan struct{})
	)
	c := &fakeConsumer{}
	c.submitHook = func(_ context.Context, events []*relay.Event) error {
		mu.Lock()
		defer mu.Unlock()
		prev := seen
		seen += len(events)
		switch {
		case prev < warmUp && seen >= warmUp:
			runtime.ReadMemStats(&before)
			from = seen
		case prev < warmUp+measured && seen >= warmUp+measured:
			runtime.ReadMemStats(&done)
			to = seen
			close(finished)
		}
		return nil
	}
	start(t, e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)
	// One statement from the test's side: the transactions are committed by
	// the server, so that the process allocates for the stream alone.
	mustExec(t, e.conn, `DO $$
		BEGIN
			FOR i IN 1..`+strconv.Itoa(warmUp+measured)+` LOOP
				INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id, payload, created_at, available_at)
				VALUES ('alloc-' || i, 'test.event', 'test', i::text, jsonb_build_object('i', i), now(), now());
				COMMIT;
			END LOOP;
		END $$`)
	select {
	case <-finished:
	case <-time.After(time.Minute):
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("%d of %d events streamed within a minute", seen, warmUp+measured)
	}
	mu.Lock()
	defer mu.Unlock()
	per := float64(done.Mallocs-before.Mallocs) / float64(to-from)
	t.Logf("%.2f allocations per single-event transaction over %d transactions", per, to-from)
	if per > perEvent {
		t.Fatalf("%.2f allocations per single-event transaction, want at most %.0f", per, perEvent)
	}
}
