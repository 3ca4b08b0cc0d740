package replication

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/relay"
)

// handOver is a new slot's hand-over, which the session finishes while it
// streams (docs/architecture.md, "slot creation").
type handOver struct {
	rows       relay.HandOverRows
	consistent relay.LSN
	foreign    bool // the slot it replaces had no hand-over record

	// Set by deliverHandOver before it closes early: the aggregates whose every row
	// NewestUnblocked has fed (their streamed events may follow).
	earlyAggs map[relay.AggregateKey]bool
	early     chan struct{}

	// Set by deliverHandOver before it closes pinned.
	release func([]relay.AggregateKey) // ends the stream's pin on aggregates of aggs
	// pinned is closed once the rows' aggregates are pinned: the decoder
	// gives the consumer nothing before (an event of such an aggregate
	// must not overtake its rows).
	pinned chan struct{}
}

// close lets the hand-over go. The session calls it once its workers
// (deliverHandOver) have returned.
func (h *handOver) close() { h.rows.Close() }

// handOverGate is the consumer the decoder feeds while a new slot's rows are read
// (docs/architecture.md, "Slot creation"): the stream starts before the
// read ends, and an event must not reach the engine before the pin of its
// aggregate, if that aggregate has rows in the snapshot. The gate asks the
// snapshot about each transaction's aggregates it has not seen (one round
// trip, through the order index): a transaction with none there, or whose
// aggregates' rows NewestUnblocked has all fed, goes on at once; the first with
// another waits for the pin, and everything after it follows in stream
// order. Once the pin is set every event goes on.
type handOverGate struct {
	relay.Consumer
	h      *handOver
	clear  map[relay.AggregateKey]bool // aggregates without rows in the snapshot
	ask    []relay.AggregateKey
	passed bool // the pin is set
}

// Submit implements relay.Consumer.
func (g *handOverGate) Submit(ctx context.Context, events []*relay.Event) error {
	if !g.passed {
		if err := g.wait(ctx, events); err != nil {
			return err
		}
	}
	return g.Consumer.Submit(ctx, events)
}

// wait returns once events may go to the engine.
func (g *handOverGate) wait(ctx context.Context, events []*relay.Event) error {
	select {
	case <-g.h.pinned:
		g.passed = true
		return nil
	default:
	}
	g.ask = g.ask[:0]
	for _, ev := range events {
		if !ev.Ordered() {
			continue
		}
		if a := ev.AggregateKey(); !g.clear[a] && !slices.Contains(g.ask, a) {
			g.ask = append(g.ask, a)
		}
	}
	if len(g.ask) == 0 {
		return nil
	}
	pending, err := g.h.rows.Pending(ctx, g.ask)
	for early := g.h.early; ; {
		if err == nil && !g.waitsFor(pending) {
			for _, a := range g.ask {
				g.clear[a] = true
			}
			return nil
		}
		// An aggregate with rows in the snapshot not fed yet, or no
		// answer: wait for the pin (a failed read ends the session), or
		// for NewestUnblocked's rows.
		select {
		case <-g.h.pinned:
			g.passed = true
			return nil
		case <-early:
			early = nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// waitsFor reports whether an aggregate of pending has rows not fed yet.
func (g *handOverGate) waitsFor(pending []relay.AggregateKey) bool {
	fed := false
	select {
	case <-g.h.early:
		fed = true
	default:
	}
	for _, a := range pending {
		if !fed || !g.h.earlyAggs[a] {
			return true
		}
	}
	return false
}

// deliverHandOver reads the hand-over's rows in the slot's snapshot, pins their
// aggregates, and delivers them through the engine, beside the stream
// (docs/architecture.md, "Slot creation"). It returns nil when ctx ends
// first (the session ends for another reason; the slot, without its
// hand-over record, is made again by the next one) and an error that ends
// the session when the read or the delivery fails.
func (s *Source) deliverHandOver(ctx context.Context, h *handOver) error {
	// The rows committed just before the slot, of aggregates without a
	// backlog, go first: their read comes before the whole read (beside
	// it, under make bench's load, it took twice as long), their delivery
	// beside it.
	began := time.Now()
	events, earlyAggs, err := h.rows.NewestUnblocked(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("deliver the newest rows pending at slot creation: %w", err)
	}
	// The read of every row's aggregate runs beside NewestUnblocked's delivery. It
	// is bounded: it holds the stream's events of the snapshot's
	// aggregates, and it can wait behind a lock that waits for the
	// hand-over's own transactions (a DDL on the outbox table), which
	// PostgreSQL does not see as a deadlock.
	read, _ := relay.NewGroup(ctx)
	defer read.Stop()
	var allAggs []relay.AggregateKey
	read.GoTask("read the rows pending at slot creation", func(ctx context.Context) error {
		readCtx, cancel := context.WithTimeout(ctx, s.cfg.StallAfter)
		defer cancel()
		var err error
		allAggs, err = h.rows.Aggregates(readCtx)
		if err != nil && ctx.Err() == nil && readCtx.Err() != nil {
			return fmt.Errorf("not done after %s (a lock on the outbox table?): %w", s.cfg.StallAfter, err)
		}
		return err
	})
	if err := s.cfg.Consumer.HandOver(ctx, events); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("deliver the newest rows pending at slot creation: %w", err)
	}
	if len(events) > 0 {
		s.log.Info().Str("consistent_point", h.consistent.String()).Int("rows", len(events)).Int("aggregates", len(earlyAggs)).Dur("took", time.Since(began)).
			Msg("fed first the newest rows pending in the new slot's snapshot whose aggregates have no older row there")
	}
	h.earlyAggs = make(map[relay.AggregateKey]bool, len(earlyAggs))
	for _, a := range earlyAggs {
		h.earlyAggs[a] = true
	}
	close(h.early)
	// The read runs under ctx: the session's end ends it.
	err = read.Wait()
	if ctx.Err() != nil {
		return nil
	}
	if err != nil {
		return err
	}
	// NewestUnblocked's aggregates have no row left to deliver: not pinned.
	aggs := slices.DeleteFunc(slices.Clone(allAggs), func(a relay.AggregateKey) bool { return h.earlyAggs[a] })
	count := h.rows.Len()
	h.release = s.cfg.Consumer.Divert(aggs)
	close(h.pinned)
	s.log.Info().Str("consistent_point", h.consistent.String()).Int("rows", count).Int("aggregates", len(aggs)).
		Msg("read the rows pending in the new slot's snapshot: each aggregate's are delivered before its new events")
	if h.foreign && count > 0 {
		s.log.Warn().Int("rows", count).Int("aggregates", len(allAggs)).Dur("expected_drain", relay.HandOverDrainEstimate(int64(count))).
			Int("at_rows_per_second", relay.HandOverRowsPerSecond).Msg("the slot found without its hand-over record was recreated: the rows pending before it are delivered now, each aggregate's before its new events, beside the stream")
	}
	// An aggregate leaves the pin as soon as its last row is queued.
	n, err := h.rows.Deliver(ctx, s.cfg.Slot, h.consistent, s.cfg.Consumer.HandOver, h.release, s.cfg.Consumer.HandOverSettled)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		// Without the record the next session drops the slot and hands
		// over what is pending then.
		return fmt.Errorf("deliver the rows pending at slot creation: %w", err)
	}
	h.release(aggs)
	s.log.Info().Str("consistent_point", h.consistent.String()).Int64("rows_delivered", n).Int("rows_first", len(events)).
		Int("aggregates", len(allAggs)).Msg("hand-over done: the rows pending in the new slot's snapshot are settled")
	return nil
}

func (s *Source) dropAfterFailedHandOver(rconn *pgconn.PgConn) {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	err := pglogrepl.DropReplicationSlot(ctx, rconn, s.cfg.Slot, pglogrepl.DropReplicationSlotOptions{})
	if err == nil {
		return
	}
	// The replication connection may be what failed; try an ordinary one.
	conn, cerr := pgx.ConnectConfig(ctx, s.queryConfig)
	if cerr == nil {
		defer closeConn(conn)
		_, err = conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", s.cfg.Slot)
	}
	if err != nil {
		s.log.Error().Err(err).Msg("could not drop the replication slot after a failed hand-over: rows pending at its creation " +
			"will not be streamed; they raise the sweep_after alarm, and outbox-relay reconcile diverts them to the claim path")
	}
}
