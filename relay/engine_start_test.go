package relay_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestEngine_RunRetriesLoadingDiverted: a failed read of the diverted
// aggregates when the engine starts (a leadership term beginning just after
// a PostgreSQL restart) is retried, as Restart retries it. Before, Run
// returned the error at once while the source kept running: Submit waited
// for a start that never came, and the leader held the slot without
// delivering anything until it lost the lock.
func TestEngine_RunRetriesLoadingDiverted(t *testing.T) {
	store := newFakeStore()
	store.divertedAggs = []relay.AggregateKey{{Type: "order", ID: "old"}}
	// The first reads fail, as queries do on a pool connection that a
	// PostgreSQL restart has just cut.
	var failures atomic.Int32
	failures.Store(2)
	read := store.diverted
	store.diverted = func(ctx context.Context) ([]relay.AggregateKey, error) {
		if failures.Add(-1) >= 0 {
			return nil, errors.New("read diverted aggregates: conn closed")
		}
		return read(ctx)
	}
	sink := newFakeSink("s", nil)
	e, err := relay.NewEngine(relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: sink}}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- e.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-runDone })

	c := e.Stream()
	submitCtx, stop := context.WithTimeout(ctx, 5*time.Second)
	defer stop()
	if err := c.Submit(submitCtx, []*relay.Event{event(1, "old"), event(2, "new")}); err != nil {
		select {
		case runErr := <-runDone:
			runDone <- runErr // for the cleanup
			t.Fatalf("Submit: %v; Run had returned: %v", err, runErr)
		default:
			t.Fatalf("Submit: %v", err)
		}
	}
	c.Commit(100)
	waitSettledAt(t, c, 100)
	if sent := sink.sent(); len(sent) != 1 || sent[0].Event.ID != 2 {
		t.Fatalf("sent %v, want only event 2: the retried load must divert aggregate old", sent)
	}
}
