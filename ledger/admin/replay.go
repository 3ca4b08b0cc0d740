package admin

import (
	"context"
	"fmt"
)

// ReplayStatuses are the statuses replay takes: every settled row. Pending
// and processing rows are on their way already and are never touched.
var ReplayStatuses = []string{"done", "failed", "held", Discarded}

// InFlightStatuses are the statuses of rows on their way: a replay leaves
// them alone, and says how many matched.
var InFlightStatuses = []string{"pending", "processing"}

// Replay makes the settled rows among ids (done, failed, held, discarded)
// deliverable again and counts the replay, in one statement (one transaction): status
// pending, attempts 0, available_at and handoff_at now, last_error,
// processed_at and the claim cleared, replays incremented. Every ledger row
// of the chosen sinks (nil: every sink) is deleted, delivered or not, so the
// claim path delivers to those sinks again; the other sinks keep their
// delivered rows and are skipped. Sinks pass replays on as Delivery.Replay
// (NATS publishes with Msg-Id "<event_key>~r<n>", so its duplicate window
// does not swallow the replay). Pending and processing rows are on their way
// and are not touched. Pass at most a few thousand ids (BatchSize). Calling
// Replay twice replays twice.
func Replay(ctx context.Context, db DB, t Tables, ids []int64, sinks []string) (Changed, error) {
	var c Changed
	err := db.QueryRow(ctx, t.sql("Replay"), ids, nilIfEmpty(sinks)).Scan(&c.Rows, &c.LedgerRows)
	if err != nil {
		return Changed{}, fmt.Errorf("replay %d rows: %w", len(ids), err)
	}
	return c, nil
}
