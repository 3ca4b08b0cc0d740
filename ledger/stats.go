package ledger

import (
	"context"

	"fmt"
	"github.com/jackc/pgx/v5"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Stats is a snapshot of the outbox for metrics and status.
type Stats struct {
	Rows             map[string]int64 // by status; done is an estimate
	OldestPendingAge time.Duration
	// Stuck counts rows the stream owns (pending, not diverted) older
	// than the sweep_after given to Stats.
	Stuck       int64
	SlotExists  bool
	RetainedWAL int64 // bytes the slot retains (current WAL - restart_lsn)
}

// Stats reads the outbox's counts and the slot's retained WAL. It never
// reads the whole table: pending rows are the rows diverted to the claim path
// (their own index) and the pending scan's watch list (rows still the
// stream's, see scan.go); processing, failed, held and discarded rows come
// from the status index; done is the table's estimated size
// (pg_class.reltuples) less the others. Callers refresh on an interval,
// never per scrape.
func (s *Store) Stats(ctx context.Context, slot string, sweepAfter time.Duration) (Stats, error) {
	st := Stats{Rows: map[string]int64{}}
	watch, err := s.scanPending(ctx)
	if err != nil {
		return st, fmt.Errorf("outbox stats: %w", err)
	}
	now := time.Now()
	for _, w := range watch {
		if age := now.Sub(w.due); age > sweepAfter {
			st.Stuck++
		}
	}
	if len(watch) > 0 {
		st.OldestPendingAge = max(now.Sub(watch[0].due), 0)
	}
	var total float64
	var diverted int64
	var divertedOldest float64
	err = s.pool.QueryRow(ctx, s.sql.statsDiverted).Scan(&diverted, &divertedOldest, &total)
	if err != nil {
		return st, fmt.Errorf("outbox stats: %w", err)
	}
	if age := time.Duration(divertedOldest * float64(time.Second)); age > st.OldestPendingAge {
		st.OldestPendingAge = age
	}
	rows, err := s.pool.Query(ctx, s.sql.statsStatuses)
	if err != nil {
		return st, fmt.Errorf("outbox stats: %w", err)
	}
	var status string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&status, &n}, func() error { st.Rows[status] = n; return nil }); err != nil {
		return st, fmt.Errorf("outbox stats: %w", err)
	}
	st.Rows["pending"] = diverted + int64(len(watch))
	st.Rows["done"] = max(int64(total)-st.Rows["pending"]-st.Rows["processing"]-st.Rows["failed"]-st.Rows["held"]-st.Rows["discarded"], 0)
	err = s.pool.QueryRow(ctx, catalog.Get("SlotRetained"), slot).Scan(&st.SlotExists, &st.RetainedWAL)
	if err != nil {
		return st, fmt.Errorf("slot stats: %w", err)
	}
	return st, nil
}

// Publish sets the relay's gauges from st.
func (st Stats) Publish() {
	var pending int64
	for _, status := range []string{"pending", "processing", "done", "failed", "held", "discarded"} {
		relay.RowsGauge.WithLabelValues(status).Set(float64(st.Rows[status]))
	}
	pending = st.Rows["pending"] + st.Rows["processing"]
	relay.PendingRows.Set(float64(pending))
	relay.OldestPendingAge.Set(st.OldestPendingAge.Seconds())
	relay.StuckRows.Set(float64(st.Stuck))
	relay.SlotRetainedWAL.Set(float64(st.RetainedWAL))
}
