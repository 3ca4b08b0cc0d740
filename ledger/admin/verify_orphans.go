package admin

import (
	"context"
	"fmt"
	"time"
)

// OrphanWalk looks for orphaned ledger rows: rows whose outbox row is gone
// although retention could not have removed it yet. Retention deletes an
// event's ledger rows in the statement that deletes its row, so a ledger
// row left without its row means the row was deleted by something else;
// only rows delivered (or claimed) since Since, and, with retention on,
// since retention.done_after ago, are judged.
//
// The ledger has no index on its times, so finding the rows written since a
// moment reads all of it, by key, a slice per statement, as retention does
// (docs/operations.md, "verify"). The walk's cursor persists across Verify
// calls: with a Budget, each call reads at most that many ledger rows and
// the next one carries on, so that the continuous verify's cost per pass is
// bounded; a report then shows the orphans of the last whole walk, or of
// the walk under way when it has found more. An OrphanWalk is used by one
// Verify call at a time.
type OrphanWalk struct {
	// Since judges only ledger rows delivered or claimed at or after it;
	// zero judges every row retention could not have removed.
	Since time.Time
	// Budget bounds the ledger rows one Verify call reads; 0 walks the
	// whole ledger in one call.
	Budget int

	started     bool // the cursor is set
	key, action string
	cur, last   *orphanCycle
}

// orphanCycle is what one walk over the whole ledger found.
type orphanCycle struct {
	count map[string]int64 // by sink
	first map[string][]Gap
	read  int64 // ledger rows read
}

func newOrphanCycle() *orphanCycle {
	return &orphanCycle{count: map[string]int64{}, first: map[string][]Gap{}}
}

func (c *orphanCycle) total() int64 {
	var n int64
	for _, k := range c.count {
		n += k
	}
	return n
}

// walk reads the ledger for v's report.
func (w *OrphanWalk) walk(ctx context.Context, v *verifier) error {
	cutoff := w.Since
	if d := v.o.RetentionDoneAfter; d > 0 {
		if c := v.r.AsOf.Add(-d); c.After(cutoff) {
			cutoff = c
		}
	}
	v.r.sql.orphansSince = cutoff
	if w.cur == nil {
		w.cur = newOrphanCycle()
	}
	var sink any
	if v.o.Sink != "" {
		sink = v.o.Sink
	}
	whole := false
	for read := 0; w.Budget <= 0 || read < w.Budget; read += v.o.Slice {
		began := time.Now()
		sql := v.q.orphansNext
		if !w.started {
			sql, w.key, w.action = v.q.orphansFirst, "", ""
		}
		rows, err := v.db.Query(ctx, sql, w.key, w.action, v.o.Slice, cutoff, sink)
		if err != nil {
			return fmt.Errorf("verify: read the ledger after (%q, %q): %w", w.key, w.action, err)
		}
		var (
			key, action string
			at          *time.Time
			cursor      bool
			moved       bool
		)
		for rows.Next() {
			if err := rows.Scan(&key, &action, &at, &cursor); err != nil {
				rows.Close()
				return fmt.Errorf("verify: read the ledger: %w", err)
			}
			if cursor {
				w.key, w.action, moved = key, action, true
				continue
			}
			w.cur.count[action]++
			if v.r.listed < 0 || len(w.cur.first[action]) < v.r.listed {
				detail := "no outbox row with this key"
				if at != nil {
					detail += ", ledger row of " + at.UTC().Format(time.RFC3339)
				}
				w.cur.first[action] = append(w.cur.first[action], Gap{EventKey: key, Detail: detail})
			}
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("verify: read the ledger: %w", err)
		}
		if !moved { // past the last key: the walk is whole
			w.last, w.cur, w.started, whole = w.cur, newOrphanCycle(), false, true
			break
		}
		w.started = true
		w.cur.read += int64(v.o.Slice)
		if err := v.pause(ctx, time.Since(began)); err != nil {
			return err
		}
	}

	shown := w.last
	if !whole {
		if shown == nil || w.cur.total() > shown.total() {
			shown = w.cur
		}
		v.r.Notes = append(v.r.Notes, fmt.Sprintf("orphaned ledger rows: the walk over the ledger is part-way (about %d rows read of it); the count is the larger of the last whole walk's and this one's so far", w.cur.read))
	}
	if shown == nil {
		return nil
	}
	for sink, n := range shown.count {
		v.r.addGroup(GapOrphaned, sink, n, shown.first[sink])
	}
	return nil
}
