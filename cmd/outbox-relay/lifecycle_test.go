package main

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestRun_WorkersEndBeforeThePoolCloses: the relay's workers beside the
// supervisor — here the table gauges, which query the pool — have returned
// when run returns, so none is still querying when the pool closes. Before,
// the stats refresher was cancelled and never waited for. The refresher is
// replaced by one that lingers half a second after its context ends.
func TestRun_WorkersEndBeforeThePoolCloses(t *testing.T) {
	var returned atomic.Bool
	orig := statsRefresher
	statsRefresher = func(r *relayRun, ctx context.Context) {
		<-ctx.Done()
		time.Sleep(500 * time.Millisecond)
		_ = r.pool.Ping(context.Background()) // the pool must still be open
		returned.Store(true)
	}
	t.Cleanup(func() { statsRefresher = orig })
	s := newSetup(t, pgtest.NewDatabase(t))
	stop := s.startInProcess(t, s.configFile(t, ""))
	s.waitStreaming(t)
	stop()
	if !returned.Load() {
		t.Fatal("run returned before the stats refresher did")
	}
}
