package ledger

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Settle writes s in one transaction and one round trip: at most one
// statement per kind, each taking its rows as arrays.
//
//   - Delivered pairs are inserted as 'delivered'. A pair already delivered
//     is left untouched (a re-streamed duplicate does not abort the batch,
//     which is why this is unnest … ON CONFLICT and not COPY); a 'sending' or
//     'unknown' claim of the same pair becomes delivered.
//   - Hand-offs mark rows for the claim path (handoff_at, available_at — now
//     when zero —, last_error unless empty, attempts += Attempts), only while
//     the row is pending and not yet handed off.
//   - Dead letters set status 'failed' with the error, only while the row is
//     pending. They run after the hand-offs, so a row in both lists (which
//     the engine should not produce) ends failed.
//
// With Config.AsyncCommit the transaction commits with synchronous_commit =
// off: it becomes durable with the next SaveCheckpoint. An empty Settlement
// does nothing. Any error rolls everything back and names the failing kind;
// Settle is safe to repeat with the same or an overlapping Settlement.
func (s *Store) Settle(ctx context.Context, st relay.Settlement) ([]int64, error) {
	if len(st.Delivered) == 0 && len(st.HandOffs) == 0 && len(st.DeadLetters) == 0 {
		return nil, nil
	}
	setCommit := ""
	if s.asyncCommit {
		setCommit = s.sql.setAsyncCommit
	}
	var kinds []string
	queue := func(b *pgx.Batch) {
		if n := len(st.Delivered); n > 0 {
			keys, actions := make([]string, n), make([]string, n)
			for i, d := range st.Delivered {
				keys[i], actions[i] = d.EventKey, d.Action
			}
			b.Queue(s.sql.settleDelivered, keys, actions)
			kinds = append(kinds, fmt.Sprintf("insert %d delivered ledger rows", n))
		}
		if n := len(st.HandOffs); n > 0 {
			ids := make([]int64, n)
			avail := make([]pgtype.Timestamptz, n)
			errs := make([]string, n)
			attempts := make([]int32, n)
			for i, h := range st.HandOffs {
				ids[i], errs[i], attempts[i] = h.ID, h.LastError, int32(h.Attempts)
				avail[i] = pgtype.Timestamptz{Time: h.AvailableAt, Valid: !h.AvailableAt.IsZero()}
			}
			b.Queue(s.sql.settleHandOffs, ids, avail, errs, attempts)
			kinds = append(kinds, fmt.Sprintf("hand off %d rows", n))
		}
		if n := len(st.DeadLetters); n > 0 {
			ids, errs := make([]int64, n), make([]string, n)
			for i, d := range st.DeadLetters {
				ids[i], errs[i] = d.ID, d.LastError
			}
			b.Queue(s.sql.settleDeadLetters, ids, errs)
			kinds = append(kinds, fmt.Sprintf("dead-letter %d rows", n))
		}
	}
	var invisible []int64
	err := s.inTx(ctx, setCommit, queue, func(br pgx.BatchResults) error {
		for _, kind := range kinds {
			if !strings.HasPrefix(kind, "insert") {
				rows, err := br.Query()
				if err != nil {
					return fmt.Errorf("%s: %w", kind, err)
				}
				ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
				if err != nil {
					return fmt.Errorf("%s: %w", kind, err)
				}
				invisible = append(invisible, ids...)
				continue
			}
			if _, err := br.Exec(); err != nil {
				return fmt.Errorf("%s: %w", kind, err)
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("settle: %w", err)
	}
	return invisible, nil
}

// Restreamed returns, for the events' rows that still exist, whether the
// stream still owns the row (status 'pending' and not handed off) and the
// sinks the ledger shows delivered (sorted; nil when none). It runs one query
// per 10,000 ids. It only reads, so it is safe to repeat; an error names the
// chunk's first id and discards the partial result.
func (s *Store) Restreamed(ctx context.Context, events []*relay.Event) (map[int64]relay.RowState, error) {
	ids := make([]int64, len(events))
	for i, e := range events {
		ids[i] = e.ID
	}
	states := make(map[int64]relay.RowState, len(ids))
	for _, chunk := range chunks(ids) {
		rows, err := s.pool.Query(ctx, s.sql.restreamed, chunk)
		if err != nil {
			return nil, fmt.Errorf("read state of re-streamed rows from id %d: %w", chunk[0], err)
		}
		var (
			id    int64
			state relay.RowState
		)
		_, err = pgx.ForEachRow(rows, []any{&id, &state.Owned, &state.Delivered}, func() error {
			states[id] = state
			state.Delivered = nil // the next row scans into a fresh slice
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("read state of re-streamed rows from id %d: %w", chunk[0], err)
		}
	}
	return states, nil
}

// MarkDone sets status 'done' on the rows among ids that are still pending
// and not handed off; others (handed off, held, failed, already done,
// missing) are left alone. It always commits with synchronous_commit = off:
// a lost update only leaves delivered rows pending, which MarkDeliveredDone
// repairs at start. Safe to repeat.
func (s *Store) MarkDone(ctx context.Context, ids []int64) ([]int64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	var invisible []int64
	err := s.inTx(ctx, s.sql.setAsyncCommit, func(b *pgx.Batch) {
		b.Queue(s.sql.markDone, ids)
	}, func(br pgx.BatchResults) error {
		rows, err := br.Query()
		if err != nil {
			return err
		}
		invisible, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("mark %d rows done: %w", len(ids), err)
	}
	return invisible, nil
}

// Diverted returns the distinct aggregates (non-NULL aggregate_type and
// aggregate_id) that have a row handed off to the claim path and not yet
// settled (pending or processing) or a held row: the stream hands their later
// events off too, to keep per-aggregate order. It only reads.
func (s *Store) Diverted(ctx context.Context) ([]relay.AggregateKey, error) {
	rows, err := s.pool.Query(ctx, s.sql.diverted)
	if err != nil {
		return nil, fmt.Errorf("read diverted aggregates: %w", err)
	}
	keys, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (relay.AggregateKey, error) {
		var k relay.AggregateKey
		err := row.Scan(&k.Type, &k.ID)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("read diverted aggregates: %w", err)
	}
	return keys, nil
}
