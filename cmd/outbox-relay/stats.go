package main

import (
	"context"
	"time"
)

// statsRefresher is refreshStats; a test replaces it to see that the relay
// waits for it.
var statsRefresher = (*relayRun).refreshStats

// refreshStats publishes the table gauges every 10 s, or less often while
// counting takes long (statsPause): counting by status reads every row
// diverted to the claim path, so it never runs per scrape
// (docs/operations.md, "Metrics").
func (r *relayRun) refreshStats(ctx context.Context) {
	for {
		start := time.Now()
		st, err := r.store.Stats(ctx, r.cfg.Source.Slot, time.Duration(r.cfg.Source.SweepAfter))
		if err == nil {
			st.Publish()
		} else if ctx.Err() == nil {
			r.log.Debug().Err(err).Msg("refresh outbox stats")
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(statsPause(time.Since(start))):
		}
	}
}

// statsPause is the wait after a refresh of the table gauges that took
// took: 10 s from its start, and at least 19 times as long as it took, so
// that counting occupies at most a twentieth of one connection. Behind a
// backlog of 200,000 diverted rows a refresh took 1.8 s, every 10 s
// (make bench's slot-recreated, docs/performance.md).
func statsPause(took time.Duration) time.Duration {
	return max(10*time.Second-took, 19*took)
}
