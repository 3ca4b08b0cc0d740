package ledger

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// streamStatements are the stream path's SQL texts (sql/stream.sql,
// sql/ledger.sql).
type streamStatements struct {
	// deliveredNew inserts delivered pairs with no delivered row yet
	// (plain INSERT); delivered upserts them (ON CONFLICT), for pairs this
	// relay claimed and when deliveredNew meets another row of a pair.
	deliveredNew string
	delivered    string
	done         string
	divert       string
	deadLetter   string
	held         string
	unknown      string
	release      string
	restreamed   string
	ledgerOf     string
	gone         string
	claimPairs   string
	diverted     string
}

// ledgerEntry is a pair as the ledger shows it.
type ledgerEntry struct {
	state string
	owner string
}

// readLedger reads the ledger's pairs of keys.
func readLedger(ctx context.Context, q querier, sql string, keys []string) (map[relay.LedgerKey]ledgerEntry, error) {
	known := map[relay.LedgerKey]ledgerEntry{}
	rows, err := q.Query(ctx, sql, keys)
	if err != nil {
		return nil, fmt.Errorf("read the ledger: %w", err)
	}
	var (
		k     relay.LedgerKey
		state string
		owner pgtype.Text
	)
	_, err = pgx.ForEachRow(rows, []any{&k.EventKey, &k.Action, &state, &owner}, func() error {
		known[k] = ledgerEntry{state: state, owner: owner.String}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the ledger: %w", err)
	}
	return known, nil
}

// PrepareStream implements relay.StreamStore.
func (s *Store) PrepareStream(ctx context.Context, works []*relay.Work, restreamed bool, owner string) error {
	if restreamed {
		if err := s.restreamed(ctx, works); err != nil {
			return err
		}
	}
	var keys, actions []string
	var claiming []*relay.Pair
	var claimingEvents []*relay.Event
	for _, w := range works {
		if w.Skip {
			continue
		}
		for _, p := range w.Pairs {
			if p.Hold && p.State == relay.PairSend && !p.Claimed {
				keys, actions = append(keys, w.Event.EventKey), append(actions, p.Sink)
				claiming, claimingEvents = append(claiming, p), append(claimingEvents, w.Event)
			}
		}
	}
	if len(keys) == 0 {
		return nil
	}
	claimed := map[relay.LedgerKey]bool{}
	guard, guarded := s.originGuard()
	err := s.inTx(ctx, s.sql.setSynchronousCommit, func(b *pgx.Batch) {
		if guarded {
			b.Queue(guard.sql)
		}
		b.Queue(s.sql.stream.claimPairs, keys, actions, owner)
	}, func(br pgx.BatchResults) error {
		// The claims are written like the stream's outcomes: on the
		// server its events came from only.
		if guarded {
			if err := guard.check(br.QueryRow()); err != nil {
				return fmt.Errorf("%s: %w", guard.kind, err)
			}
		}
		rows, err := br.Query()
		if err != nil {
			return err
		}
		var k relay.LedgerKey
		_, err = pgx.ForEachRow(rows, []any{&k.EventKey, &k.Action}, func() error {
			claimed[k] = true
			return nil
		})
		return err
	})
	if err != nil {
		return fmt.Errorf("claim %d pairs before sending: %w", len(keys), rowDataError(err))
	}
	var refused []string
	for i, p := range claiming {
		if claimed[relay.LedgerKey{EventKey: claimingEvents[i].EventKey, Action: p.Sink}] {
			p.Claimed = true
		} else {
			refused = append(refused, claimingEvents[i].EventKey)
		}
	}
	if len(refused) == 0 {
		return nil
	}
	// Delivered already (a re-stream), or claimed before a crash or by
	// another relay: its outcome is unknown.
	known, err := readLedger(ctx, s.pool, s.sql.stream.ledgerOf, refused)
	if err != nil {
		return err
	}
	for i, p := range claiming {
		if p.Claimed {
			continue
		}
		prev := known[relay.LedgerKey{EventKey: claimingEvents[i].EventKey, Action: p.Sink}]
		if prev.state == "delivered" {
			p.State = relay.PairDelivered
		} else {
			p.State, p.PrevOwner = relay.PairUnknown, prev.owner
		}
	}
	return nil
}

// restreamed marks the works whose row is no longer the stream's as Skip,
// and their pairs the ledger shows delivered as PairDelivered; one query
// per 10,000 rows. Rows missing from the table are left as they are.
func (s *Store) restreamed(ctx context.Context, works []*relay.Work) error {
	byID := make(map[int64]*relay.Work, len(works))
	ids := make([]int64, 0, len(works))
	for _, w := range works {
		ids = append(ids, w.Event.ID)
		byID[w.Event.ID] = w
	}
	for chunk := range chunks(ids) {
		// Planned at each call (pgx's unnamed statement), never from a
		// cached plan: the ledger grows fast in a drain, and a plan made
		// while it was small may read all of it for every call
		// (docs/performance.md, "Plans that do not depend on statistics").
		rows, err := s.pool.Query(ctx, s.sql.stream.restreamed, pgx.QueryExecModeExec, chunk)
		if err != nil {
			return fmt.Errorf("read state of re-streamed rows from id %d: %w", chunk[0], err)
		}
		var (
			id        int64
			owned     bool
			delivered []string
		)
		found := make(map[int64]bool, len(chunk))
		_, err = pgx.ForEachRow(rows, []any{&id, &owned, &delivered}, func() error {
			found[id] = true
			w := byID[id]
			if !owned {
				w.Skip = true
			}
			for _, p := range w.Pairs {
				if slices.Contains(delivered, p.Sink) {
					p.State = relay.PairDelivered
				}
			}
			delivered = nil
			return nil
		})
		if err != nil {
			return fmt.Errorf("read state of re-streamed rows from id %d: %w", chunk[0], err)
		}
		// A re-streamed event without its row: the row was deleted (pruned
		// once delivered, or by its owner) when its inserting transaction
		// is visible, and the event is not sent again. The slot sends
		// again what it confirmed after its last save when PostgreSQL
		// crashes, and retention goes by the confirmed position it saw
		// (docs/operations.md, "Retention"). A row not visible yet is
		// left to the settlement's wait.
		var missing []*relay.Work
		for _, id := range chunk {
			if !found[id] {
				missing = append(missing, byID[id])
			}
		}
		if len(missing) > 0 {
			gone, err := s.Gone(ctx, missing)
			if err != nil {
				return fmt.Errorf("re-streamed rows from id %d: %w", chunk[0], err)
			}
			for _, id := range gone {
				byID[id].Skip = true
			}
		}
	}
	return nil
}

// settlementRows is a batch of decisions split by statement.
type settlementRows struct {
	// newKeys/newActions: pairs delivered and not claimed (the stream's
	// usual case); deliveredKeys/deliveredActions: the others.
	newKeys, newActions             []string
	deliveredKeys, deliveredActions []string
	unknownKeys, unknownActions     []string
	unknownDetails                  []string
	releaseKeys, releaseActions     []string
	// row changes by kind: diversions, dead letters, held
	divertIDs  []int64
	divertAt   []pgtype.Timestamptz
	divertErrs []string
	divertN    []int32
	deadIDs    []int64
	deadErrs   []string
	deadN      []int32
	heldIDs    []int64
	heldErrs   []string
	heldN      []int32
	doneIDs    []int64
	retryIDs   []int64
	retryMS    []int64
	retryErrs  []*string
	retryN     []int32
}

// split sorts the pairs and rows of works into the statements that write
// them. Pairs: newly delivered ones into the ledger (one delivered row per
// pair on both paths: the record of delivery); claims whose outcome is
// unknown become 'unknown'; other claims are withdrawn.
func split(works []*relay.Work) *settlementRows {
	r := &settlementRows{}
	now := time.Now()
	for _, w := range works {
		ev, d := w.Event, w.Decision
		for _, p := range w.Pairs {
			switch {
			case p.Outcome.Kind == relay.Delivered && p.State != relay.PairDelivered && !p.Claimed && w.Path() == relay.PathStream:
				r.newKeys, r.newActions = append(r.newKeys, ev.EventKey), append(r.newActions, p.Sink)
			case p.Outcome.Kind == relay.Delivered && p.State != relay.PairDelivered:
				r.deliveredKeys, r.deliveredActions = append(r.deliveredKeys, ev.EventKey), append(r.deliveredActions, p.Sink)
			case p.Claimed && p.Outcome.Kind != relay.Delivered && (p.Outcome.Unknown || p.Outcome.Kind == relay.Held):
				detail := "outcome unknown: " + p.Outcome.Reason
				if p.Outcome.Kind == relay.Held {
					detail = p.Outcome.Reason
				}
				r.unknownKeys, r.unknownActions = append(r.unknownKeys, ev.EventKey), append(r.unknownActions, p.Sink)
				r.unknownDetails = append(r.unknownDetails, relay.ShortError(detail))
			case p.Claimed && p.Outcome.Kind != relay.Delivered:
				r.releaseKeys, r.releaseActions = append(r.releaseKeys, ev.EventKey), append(r.releaseActions, p.Sink)
			}
		}
		reason := relay.ShortError(d.Reason)
		switch d.Kind {
		case relay.Done:
			r.doneIDs = append(r.doneIDs, ev.ID)
		case relay.Later:
			r.divertIDs = append(r.divertIDs, ev.ID)
			r.divertAt = append(r.divertAt, pgtype.Timestamptz{Time: d.At, Valid: !d.At.IsZero()})
			r.divertErrs, r.divertN = append(r.divertErrs, reason), append(r.divertN, int32(d.Attempts))
			r.retryIDs, r.retryMS = append(r.retryIDs, ev.ID), append(r.retryMS, max(d.At.Sub(now), 0).Milliseconds())
			var e *string
			if reason != "" {
				e = &reason
			}
			r.retryErrs, r.retryN = append(r.retryErrs, e), append(r.retryN, int32(d.Attempts))
		case relay.DeadLetter:
			r.deadIDs, r.deadErrs, r.deadN = append(r.deadIDs, ev.ID), append(r.deadErrs, reason), append(r.deadN, int32(d.Attempts))
		case relay.Hold:
			r.heldIDs, r.heldErrs, r.heldN = append(r.heldIDs, ev.ID), append(r.heldErrs, reason), append(r.heldN, int32(d.Attempts))
		}
	}
	return r
}

// SettleStream implements relay.StreamStore: one transaction, one round
// trip, at most one statement per kind. With Config.AsyncCommit it commits
// with synchronous_commit = off: it becomes durable with the next
// SaveCheckpoint. An error rolls everything back; a refusal of a row's data
// (rowDataStates) wraps relay.ErrRowData. Safe to repeat with the same or
// an overlapping batch.
//
// Every pair the stream delivered gets its delivered ledger row here, the
// record of each delivery on both paths, and every row its status in the
// same transaction: done, a diversion, failed or held (docs/operations.md,
// "what the relay writes back"). The pairs are written before the rows
// (docs/architecture.md, "Lock order").
func (s *Store) SettleStream(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
	r := split(works)
	setCommit := ""
	if s.asyncCommit {
		setCommit = s.sql.setAsyncCommit
	}
	st := s.sql.stream
	write := func(plainInsert bool) ([]int64, error) {
		var steps []step
		keys, actions := r.deliveredKeys, r.deliveredActions
		switch {
		case len(r.newKeys) > 0 && plainInsert:
			steps = append(steps, exec(fmt.Sprintf("insert %d delivered ledger rows", len(r.newKeys)), st.deliveredNew, r.newKeys, r.newActions))
		case len(r.newKeys) > 0:
			keys, actions = slices.Concat(r.newKeys, keys), slices.Concat(r.newActions, actions)
		}
		if len(keys) > 0 {
			steps = append(steps, exec(fmt.Sprintf("write %d delivered ledger rows", len(keys)), st.delivered, keys, actions))
		}
		if len(r.unknownKeys) > 0 {
			steps = append(steps, exec(fmt.Sprintf("mark %d ledger pairs unknown", len(r.unknownKeys)), st.unknown, r.unknownKeys, r.unknownActions, r.unknownDetails))
		}
		if len(r.releaseKeys) > 0 {
			steps = append(steps, exec(fmt.Sprintf("withdraw %d ledger claims", len(r.releaseKeys)), st.release, r.releaseKeys, r.releaseActions, owner))
		}
		if len(r.doneIDs) > 0 {
			steps = append(steps, ids(fmt.Sprintf("mark %d rows done", len(r.doneIDs)), st.done, r.doneIDs))
		}
		if len(r.divertIDs) > 0 {
			steps = append(steps, ids(fmt.Sprintf("divert %d rows", len(r.divertIDs)), st.divert, r.divertIDs, r.divertAt, r.divertErrs, r.divertN))
		}
		if len(r.deadIDs) > 0 {
			steps = append(steps, ids(fmt.Sprintf("dead-letter %d rows", len(r.deadIDs)), st.deadLetter, r.deadIDs, r.deadErrs, r.deadN))
		}
		if len(r.heldIDs) > 0 {
			steps = append(steps, ids(fmt.Sprintf("hold %d rows", len(r.heldIDs)), st.held, r.heldIDs, r.heldErrs, r.heldN))
		}
		if len(steps) == 0 {
			return nil, nil
		}
		return s.runStreamSteps(ctx, setCommit, steps)
	}
	invisible, err := write(true)
	if len(r.newKeys) > 0 && hasSQLState(err, "23505") { // unique_violation
		// Another row of a pair (a claim), or another session inserting one
		// of the same pairs meanwhile (two relays around a takeover).
		invisible, err = write(false)
	}
	if err != nil {
		return nil, fmt.Errorf("settle %d stream events: %w", len(works), err)
	}
	return invisible, nil
}

// Diverted implements relay.StreamStore: the distinct aggregates (non-NULL
// aggregate_type and aggregate_id) with a row diverted to the claim path
// and not yet settled, or held. It only reads.
func (s *Store) Diverted(ctx context.Context) ([]relay.AggregateKey, error) {
	rows, err := s.pool.Query(ctx, s.sql.stream.diverted)
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

// Gone implements relay.StreamStore: of the works whose row a settlement
// could not see, those whose row was deleted — its insert is visible, the
// row is not there — as opposed to streamed rows whose commit is not
// visible yet. A row read from the table (Event.Xid 0) was visible when
// read: not there now, it was deleted. It only reads.
func (s *Store) Gone(ctx context.Context, works []*relay.Work) ([]int64, error) {
	ids, xids := make([]int64, len(works)), make([]int64, len(works))
	for i, w := range works {
		ids[i], xids[i] = w.Event.ID, int64(w.Event.Xid)
	}
	rows, err := s.pool.Query(ctx, s.sql.stream.gone, ids, xids)
	if err != nil {
		return nil, fmt.Errorf("look for deleted rows: %w", err)
	}
	gone, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("look for deleted rows: %w", err)
	}
	return gone, nil
}
