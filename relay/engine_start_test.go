package relay_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// divertedFailsFirst is a store whose first Diverted calls fail, as queries
// do on a pool connection that a PostgreSQL restart has just cut.
type divertedFailsFirst struct {
	*fakeStore
	failures atomic.Int32
}

func (s *divertedFailsFirst) Diverted(ctx context.Context) ([]relay.AggregateKey, error) {
	if s.failures.Add(-1) >= 0 {
		return nil, errors.New("read diverted aggregates: conn closed")
	}
	return s.fakeStore.Diverted(ctx)
}

// TestEngine_RunRetriesLoadingDiverted: a failed read of the diverted
// aggregates when the engine starts (a leadership term beginning just after
// a PostgreSQL restart) is retried, as Restart retries it. Before, Run
// returned the error at once while the source kept running: Submit waited
// for a start that never came, and the leader held the slot without
// delivering anything until it lost the lock.
func TestEngine_RunRetriesLoadingDiverted(t *testing.T) {
	store := &divertedFailsFirst{fakeStore: newFakeStore()}
	store.failures.Store(2)
	store.diverted = []relay.AggregateKey{{Type: "order", ID: "old"}}
	sink := newFakeSink("s", nil)
	e, err := relay.NewEngine(relay.EngineConfig{Store: store, Routes: []relay.Route{{Sink: sink}},
		Logger: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- e.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-runDone })

	submitCtx, stop := context.WithTimeout(ctx, 5*time.Second)
	defer stop()
	if err := e.Submit(submitCtx, []*relay.Event{event(1, "old"), event(2, "new")}); err != nil {
		select {
		case runErr := <-runDone:
			runDone <- runErr // for the cleanup
			t.Fatalf("Submit: %v; Run had returned: %v", err, runErr)
		default:
			t.Fatalf("Submit: %v", err)
		}
	}
	e.Commit(100)
	waitFor(t, "settled", func() bool { lsn, _ := e.Settled(); return lsn == 100 })
	if sent := sink.sent(); len(sent) != 1 || sent[0].Event.ID != 2 {
		t.Fatalf("sent %v, want only event 2: the retried load must divert aggregate old", sent)
	}
}
