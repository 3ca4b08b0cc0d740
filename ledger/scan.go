package ledger

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// The pending scan: the rows still the stream's (StreamOwned: pending, not
// diverted) — those it is delivering now, and those it will never stream
// (a slot made by someone else while the relay was down) — without reading
// the whole table every few seconds. No index holds just those rows: the
// claim index holds the claim path's pending rows too, a backlog of a
// recreated slot's hand-over among them. The scan walks the outbox once by
// id, in chunks, and keeps the rows it finds the stream's in a watch list
// that it checks again on each step: rows the stream settles leave it
// within moments (their status is written in the settlement), rows nobody
// delivers stay and raise the stuck-rows alarm. Each step reads the ids
// added since the last one and the watch list: its cost follows the write
// rate, not the table's size.
//
// A row whose id was taken by a transaction that commits only after the
// scan passed that id (a transaction open longer than a step) is not seen;
// docs/operations.md says so.

const (
	// scanIDs is how many ids one statement of the scan covers.
	scanIDs = 50_000
	// scanBudget bounds the ids one step reads: a first walk over a long
	// table takes several steps.
	scanBudget = 200_000
	// watchMax bounds the watch list; past it the scan stops walking (and
	// says so) until rows leave it.
	watchMax = 100_000
)

// scanState is the scan's state, shared by Stuck and Stats.
type scanState struct {
	mu       sync.Mutex
	floor    int64 // every id up to floor has been read
	started  bool
	watch    map[int64]watchEntry
	caughtUp bool // the walk has reached the table's newest id once
}

// watchEntry is what the scan knows of a watched row: when it became due,
// and whether it is pending now (or processing: claimed, and back to
// pending if the claim path retries it — the walk never reads its id
// again, so a claimed row stays watched until it is settled).
type watchEntry struct {
	due     time.Time
	pending bool
}

// watched is a row on the watch list.
type watched struct {
	id      int64
	due     time.Time
	pending bool
}

// scanPending advances the scan and returns the watch list: the rows
// pending and not diverted.
func (s *Store) scanPending(ctx context.Context) ([]watched, error) {
	sc := &s.scan
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if sc.watch == nil {
		sc.watch = map[int64]watchEntry{}
	}
	if s.handingOver.Load() > 0 {
		// A new slot's hand-over is delivering every row pending before
		// the slot: whatever the scan watches now, or would read, is on its
		// way, and not stuck (docs/architecture.md, "slot creation"). The
		// scan resumes from its floor afterwards, where those rows read as
		// settled or diverted.
		clear(sc.watch)
		return nil, nil
	}
	if err := s.scanStep(ctx); err != nil {
		return nil, err
	}
	out := make([]watched, 0, len(sc.watch))
	for id, w := range sc.watch {
		if w.pending {
			out = append(out, watched{id, w.due, true})
		}
	}
	slices.SortFunc(out, func(a, b watched) int { return a.due.Compare(b.due) })
	return out, nil
}

func (s *Store) scanStep(ctx context.Context) error {
	sc := &s.scan
	if !sc.started {
		var low pgtype.Int8
		if err := s.pool.QueryRow(ctx, s.sql.scanStart).Scan(&low); err != nil {
			return fmt.Errorf("start the pending scan: %w", err)
		}
		sc.floor = low.Int64 - 1
		sc.started = true
	}
	// The rows on the watch list that are still pending (or claimed).
	if len(sc.watch) > 0 {
		ids := make([]int64, 0, len(sc.watch))
		for id := range sc.watch {
			ids = append(ids, id)
		}
		still := map[int64]watchEntry{}
		for chunk := range chunks(ids) {
			if err := s.collectPending(ctx, s.sql.scanRecheck, still, chunk); err != nil {
				return err
			}
		}
		sc.watch = still
	}
	var top pgtype.Int8
	if err := s.pool.QueryRow(ctx, s.sql.scanTop).Scan(&top); err != nil {
		return fmt.Errorf("pending scan: %w", err)
	}
	for read := int64(0); sc.floor < top.Int64 && read < scanBudget && len(sc.watch) < watchMax; read += scanIDs {
		to := min(sc.floor+scanIDs, top.Int64)
		if err := s.collectPending(ctx, s.sql.scanRange, sc.watch, sc.floor, to); err != nil {
			return err
		}
		sc.floor = to
	}
	sc.caughtUp = sc.caughtUp || sc.floor >= top.Int64
	return nil
}

func (s *Store) collectPending(ctx context.Context, sql string, into map[int64]watchEntry, args ...any) error {
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return fmt.Errorf("pending scan: %w", err)
	}
	var (
		id      int64
		due     time.Time
		pending bool
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &due, &pending}, func() error {
		into[id] = watchEntry{due: due, pending: pending}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pending scan: %w", err)
	}
	return nil
}
