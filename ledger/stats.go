package ledger

import (
	"context"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Stats is a snapshot of the outbox for metrics and status.
type Stats struct {
	Rows             map[string]int64 // by status
	OldestPendingAge time.Duration
	// Stuck counts rows the stream owns (pending, not handed off) older
	// than the sweep_after given to Stats.
	Stuck       int64
	SlotExists  bool
	RetainedWAL int64 // bytes the slot retains (current WAL - restart_lsn)
}

// Stats reads the outbox's counts and the slot's retained WAL in one round
// trip. Counting by status scans the table, so callers refresh on an
// interval, never per scrape.
func (s *Store) Stats(ctx context.Context, slot string, sweepAfter time.Duration) (Stats, error) {
	st := Stats{Rows: map[string]int64{}}
	// A pending row the stream delivered (its id is in the delivered
	// record) counts as done.
	rows, err := s.pool.Query(ctx, fmt.Sprintf(`
WITH o AS (
SELECT CASE WHEN o.status = 'pending' AND o.handoff_at IS NULL AND %s THEN 'done' ELSE coalesce(o.status, 'pending') END AS status,
       o.created_at, o.handoff_at
  FROM %s AS o)
SELECT status, count(*),
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0),
       count(*) FILTER (WHERE status = 'pending' AND handoff_at IS NULL AND created_at < now() - $1::interval)
  FROM o GROUP BY 1`, s.tables.recorded("o"), s.outbox), sweepAfter.String())
	if err != nil {
		return st, fmt.Errorf("outbox stats: %w", err)
	}
	for rows.Next() {
		var status string
		var n, stuck int64
		var oldest float64
		if err := rows.Scan(&status, &n, &oldest, &stuck); err != nil {
			return st, fmt.Errorf("outbox stats: %w", err)
		}
		st.Rows[status] += n
		st.Stuck += stuck
		if age := time.Duration(oldest * float64(time.Second)); age > st.OldestPendingAge {
			st.OldestPendingAge = age
		}
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("outbox stats: %w", err)
	}
	err = s.pool.QueryRow(ctx, `SELECT count(*) > 0, coalesce(max(pg_current_wal_lsn() - restart_lsn), 0)::bigint
		FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&st.SlotExists, &st.RetainedWAL)
	if err != nil {
		return st, fmt.Errorf("slot stats: %w", err)
	}
	return st, nil
}

// Publish sets the relay's gauges from st.
func (st Stats) Publish() {
	var pending int64
	for _, status := range []string{"pending", "processing", "done", "failed", "held"} {
		relay.RowsGauge.WithLabelValues(status).Set(float64(st.Rows[status]))
	}
	pending = st.Rows["pending"] + st.Rows["processing"]
	relay.PendingRows.Set(float64(pending))
	relay.OldestPendingAge.Set(st.OldestPendingAge.Seconds())
	relay.StuckRows.Set(float64(st.Stuck))
	relay.SlotRetainedWAL.Set(float64(st.RetainedWAL))
}
