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

// streamStatements are the stream path's SQL texts.
type streamStatements struct {
	// deliveredNew inserts delivered pairs with no delivered row yet
	// (plain INSERT); delivered upserts them (ON CONFLICT), for pairs this
	// relay claimed and when deliveredNew meets another row of a pair.
	deliveredNew string
	delivered    string
	done         string
	handOffs     string
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

func renderStream(t tables) streamStatements {
	outbox, ledger := t.outbox, t.ledger
	// Each row change reports, from its own snapshot, the ids it could not
	// see at all: the walsender may send a transaction before the
	// committing backend has left the proc array (with synchronous
	// replication, until a standby confirms it), so a fast delivery can
	// settle a row no other session sees yet. A separate check would run in
	// a later snapshot and could see the row then, hiding the miss.
	//
	// Batch statements find their rows by key whatever the statistics say
	// (docs/performance.md, "Plans that do not depend on statistics"): an
	// outbox row by its id (the transaction turns sequential scans off, so
	// the join with the batch probes the primary key per row), a ledger
	// pair by (event_key, action), and every NOT EXISTS probes per row (OFFSET 0
	// keeps it a subplan instead of an anti-join, which on a table grown
	// since its last ANALYZE, or with a plan cached while it was small,
	// hashed or sorted the whole table for each batch).
	invisible := func(update string) string {
		return update + fmt.Sprintf(`
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM %s v WHERE v.id = t.id OFFSET 0)`, outbox)
	}
	return streamStatements{
		// The stream's usual write: a pair it delivered and did not claim
		// has no ledger row. A plain INSERT of the pairs the ledger lacks
		// costs about 40% less per row than ON CONFLICT's speculative
		// insertion, and half the WAL records for the walsender to decode
		// (docs/performance.md). A pair with another row than a delivered
		// one (a claim) raises a unique violation, and SettleStream writes
		// the batch again with delivered.
		deliveredNew: fmt.Sprintf(`
INSERT INTO %[1]s (event_key, action, state, attempts, claimed_at, delivered_at)
SELECT t.k, t.a, 'delivered', 1, now(), now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
 WHERE NOT EXISTS (SELECT FROM %[1]s AS l WHERE l.event_key = t.k AND l.action = t.a AND l.state = 'delivered' OFFSET 0)`, ledger),
		delivered: deliveredSQL(ledger, false),

		// Delivered to every sink it is routed to (or routed to none): the
		// row's status is done, written in the transaction of its delivered
		// ledger rows, so that no reader ever asks the ledger whether a row
		// is delivered (docs/schema.md, "A row's states").
		done: invisible(fmt.Sprintf(`
WITH t AS (SELECT * FROM unnest($1::bigint[]) AS t(id)),
changed AS (
UPDATE %s AS o
   SET status = 'done', processed_at = now()
  FROM t
 WHERE o.id = t.id AND %s IS TRUE
RETURNING o.id)`, outbox, StreamOwned("o"))),

		// A hand-off: the row becomes the claim path's, due at available_at,
		// its status written pending (pending.go).
		handOffs: invisible(fmt.Sprintf(`
WITH t AS (SELECT * FROM unnest($1::bigint[], $2::timestamptz[], $3::text[], $4::int[]) AS t(id, avail, err, n)),
changed AS (
UPDATE %s AS o
   SET status = 'pending',
       handoff_at = now(),
       available_at = COALESCE(t.avail, now()),
       last_error = COALESCE(NULLIF(t.err, ''), o.last_error),
       attempts = GREATEST(COALESCE(o.attempts, 0), t.n)
  FROM t
 WHERE o.id = t.id AND %s IS TRUE
RETURNING o.id)`, outbox, StreamOwned("o"))),

		deadLetter: invisible(fmt.Sprintf(`
WITH t AS (SELECT * FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)),
changed AS (
UPDATE %s AS o
   SET status = 'failed', last_error = t.err, attempts = GREATEST(COALESCE(o.attempts, 0), t.n),
       processed_at = now(), locked_at = NULL, locked_by = NULL
  FROM t
 WHERE o.id = t.id AND %s IS TRUE
RETURNING o.id)`, outbox, StreamOwned("o"))),

		held: invisible(fmt.Sprintf(`
WITH t AS (SELECT * FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)),
changed AS (
UPDATE %s AS o
   SET status = 'held', last_error = t.err, attempts = GREATEST(COALESCE(o.attempts, 0), t.n),
       processed_at = now()
  FROM t
 WHERE o.id = t.id AND %s IS TRUE
RETURNING o.id)`, outbox, StreamOwned("o"))),

		// A pair whose outcome is unknown at a sink that holds such events:
		// 'unknown' (never claimed again but by dlq retry). A pair the
		// ledger shows delivered has a known outcome and is left alone.
		unknown: fmt.Sprintf(`
INSERT INTO %s AS l (event_key, action, state, attempts, detail)
SELECT t.k, t.a, 'unknown', 1, t.d
  FROM (SELECT DISTINCT ON (k, a) k, a, d FROM unnest($1::text[], $2::text[], $3::text[]) AS u(k, a, d) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'unknown', detail = EXCLUDED.detail
 WHERE l.state <> 'delivered'`, ledger),

		release: releaseSQL(ledger),

		// A row is still the stream's while it is pending and not handed
		// off. One probe of the outbox's primary key per id, and one of
		// the ledger's by its prefix event_key per row, whatever the
		// statistics (as `o.id = ANY($1)` the planner scanned the outbox
		// for a few hundred ids). Planned at each call (see restreamed).
		restreamed: fmt.Sprintf(`
SELECT o.id,
       %s IS TRUE,
       d.actions
  FROM (SELECT DISTINCT id FROM unnest($1::bigint[]) AS u(id)) AS t
 CROSS JOIN LATERAL (SELECT o.id, o.status, o.handoff_at, o.event_key FROM %s AS o WHERE o.id = t.id OFFSET 0) AS o
  LEFT JOIN LATERAL (
       SELECT array_agg(l.action ORDER BY l.action) AS actions
         FROM %s AS l
        WHERE l.event_key = o.event_key AND l.state = 'delivered') AS d ON true`, StreamOwned("o"), outbox, ledger),

		ledgerOf: ledgerPairsSQL(ledger),

		// The ids among $1 whose row does not exist although its insert is
		// visible: the row was deleted, not waiting to become visible. A
		// row read from the table (xid 0: a hand-over's, a claimed one)
		// was visible when read; a streamed row's inserting transaction
		// ($2, a 32-bit xid widened with the snapshot's epoch) is asked of
		// the snapshot.
		gone: fmt.Sprintf(`
WITH s AS (SELECT pg_current_snapshot() AS snap),
e AS (SELECT snap, pg_snapshot_xmax(snap)::text::bigint AS xmax FROM s)
SELECT t.id
  FROM unnest($1::bigint[], $2::bigint[]) AS t(id, xid), e
 WHERE NOT EXISTS (SELECT FROM %s AS o WHERE o.id = t.id)
   AND (t.xid = 0 OR pg_visible_in_snapshot(
         (((e.xmax >> 32) - CASE WHEN t.xid > (e.xmax & 4294967295) THEN 1 ELSE 0 END) << 32 | t.xid)::text::xid8,
         e.snap))`, outbox),

		// The claim before sending is the insert itself (never
		// check-then-insert). Only an 'unknown' pair — held, then released
		// by dlq retry — may be claimed again.
		claimPairs: fmt.Sprintf(`
INSERT INTO %s AS l (event_key, action, state, attempts, owner, claimed_at)
SELECT t.k, t.a, 'sending', 1, $3, now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'sending', owner = EXCLUDED.owner, claimed_at = now(), attempts = l.attempts + 1
 WHERE l.state = 'unknown'
RETURNING l.event_key, l.action`, ledger),

		// Read at every stream session's start, before its first event.
		// Pending rows may be a large backlog the stream owns (a slot
		// recreated behind 200,000 rows: scanning them all took 0.75 s
		// there, and every fresh event waited): the handed-off ones are
		// read through the hand-off index (its predicate repeated), the
		// claimed and held ones through the status index.
		diverted: fmt.Sprintf(`
SELECT aggregate_type, aggregate_id
  FROM %[1]s
 WHERE status = 'pending' AND handoff_at IS NOT NULL
   AND aggregate_type IS NOT NULL AND aggregate_id IS NOT NULL
UNION
SELECT aggregate_type, aggregate_id
  FROM %[1]s
 WHERE status IN ('processing', 'held') AND (handoff_at IS NOT NULL OR status = 'held')
   AND aggregate_type IS NOT NULL AND aggregate_id IS NOT NULL`, outbox),
	}
}

// deliveredSQL inserts delivered ledger pairs. ON CONFLICT DO UPDATE may
// touch a row only once per statement, so the pairs are made distinct
// first; the order makes concurrent settlements lock ledger rows in one
// order. A pair already delivered is left exactly as it is (insert-only); a
// claim ('sending', 'unknown') becomes delivered — on the claim path only
// the owner's own.
func deliveredSQL(ledger string, owned bool) string {
	owner, cond := "NULL::text", ""
	if owned {
		owner, cond = "$3", " AND (l.state <> 'sending' OR l.owner = EXCLUDED.owner)"
	}
	return fmt.Sprintf(`
INSERT INTO %s AS l (event_key, action, state, attempts, owner, claimed_at, delivered_at)
SELECT t.k, t.a, 'delivered', 1, %s, now(), now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'delivered', delivered_at = now()
 WHERE l.state <> 'delivered'%s`, ledger, owner, cond)
}

// releaseSQL withdraws the owner's claims whose send is known not to have
// reached the sink, so whoever delivers next claims afresh.
func releaseSQL(ledger string) string {
	return fmt.Sprintf(`
DELETE FROM %s AS l
 USING unnest($1::text[], $2::text[]) AS t(k, a)
 WHERE l.event_key = t.k AND l.action = t.a AND l.owner = $3 AND l.state = 'sending'`, ledger)
}

// ledgerPairsSQL reads the ledger's pairs of some event keys: one prefix
// probe of the primary key (event_key, action) per key. Written as a
// lateral subquery that is not pulled up (OFFSET 0), so the plan does not
// depend on the ledger's statistics: as `event_key = ANY($1)` the planner,
// knowing nothing of event_key alone on a ledger grown since its last
// ANALYZE, counted 0.5% of the table per key and scanned all of it for a
// batch of 50 keys (docs/performance.md, "Plans that do not depend on
// statistics").
func ledgerPairsSQL(ledger string) string {
	return fmt.Sprintf(`
SELECT p.event_key, p.action, p.state, p.owner
  FROM (SELECT DISTINCT k FROM unnest($1::text[]) AS u(k)) AS t
 CROSS JOIN LATERAL (SELECT event_key, action, state, owner FROM %s WHERE event_key = t.k OFFSET 0) AS p`, ledger)
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
	// row changes by kind: hand-offs, dead letters, held
	handIDs   []int64
	handAt    []pgtype.Timestamptz
	handErrs  []string
	handN     []int32
	deadIDs   []int64
	deadErrs  []string
	deadN     []int32
	heldIDs   []int64
	heldErrs  []string
	heldN     []int32
	doneIDs   []int64
	retryIDs  []int64
	retryMS   []int64
	retryErrs []*string
	retryN    []int32
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
			r.handIDs = append(r.handIDs, ev.ID)
			r.handAt = append(r.handAt, pgtype.Timestamptz{Time: d.At, Valid: !d.At.IsZero()})
			r.handErrs, r.handN = append(r.handErrs, reason), append(r.handN, int32(d.Attempts))
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
// same transaction: done, a hand-off, failed or held (docs/operations.md,
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
		if len(r.handIDs) > 0 {
			steps = append(steps, ids(fmt.Sprintf("hand off %d rows", len(r.handIDs)), st.handOffs, r.handIDs, r.handAt, r.handErrs, r.handN))
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
// aggregate_type and aggregate_id) with a row handed off to the claim path
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
