package ledger

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The claim path's SQL (docs/architecture.md, "the claim path"): claim a
// batch of due rows with one statement, claim their (event, sink) pairs in
// the ledger before sending, and settle each batch in one synchronous
// transaction, every change conditional on the row or claim still being
// this owner's.

// dbTimeout bounds one database round trip of the claim path.
const dbTimeout = 30 * time.Second

// OwnerLockClass is the first key of every owner lock:
// pg_advisory_lock(OwnerLockClass, hashtext(owner)). It is "obxr" in ASCII.
// In pg_locks the lock shows as locktype 'advisory', classid
// OwnerLockClass, objid hashtext(owner) (as oid) and objsubid 2 (the
// two-key form), so it cannot collide with single-bigint advisory locks
// such as tern's migration lock.
const OwnerLockClass = 0x6f627872

// OwnerPrefix starts every relay owner id. The lease sweeper treats a row
// locked by an owner with this prefix whose owner lock is free as abandoned
// at once; rows locked by anyone else (a legacy poller) only after their
// lease.
const OwnerPrefix = "outbox-relay:"

type claimOptions struct {
	unordered bool
}

type claimStatements struct {
	// claim[all][shape]: the claim query for poll mode (all) or not, and
	// the table's shape (see claimShape).
	claim        [2][3]string
	hasReplays   string
	ledgerPairs  string
	claimPairs   string
	delivered    string
	release      string
	unknown      string
	done         string
	failed       string
	retry        string
	held         string
	settled      string
	extendRows   string
	releaseOwned string
	extendClaims string
	expireLeases string
	repairDue    string
	lockOwner    string
	unlockOwner  string
}

// ownerAlive is true while the session advisory lock of the owner named by
// the SQL expression owner is held in this database.
func ownerAlive(owner string) string {
	return fmt.Sprintf(`EXISTS (
           SELECT FROM pg_locks AS k
            WHERE k.locktype = 'advisory' AND k.granted
              AND k.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
              AND k.classid = %d AND k.objid = hashtext(%s)::oid AND k.objsubid = 2)`, OwnerLockClass, owner)
}

func renderClaim(t tables, opts claimOptions) claimStatements {
	outbox, ledger := t.outbox, t.ledger
	// The ordering check: a row waits while a lower id of its aggregate is
	// unsettled (pending, processing or held — failed and done rows never
	// block), unless the ledger shows that row delivered to every sink it is
	// routed to (a row the stream delivered whose status is not marked
	// yet). Routing in SQL mirrors the engine's: $4 sink names, $5 "takes
	// every type", $6 the sink's globs as one regex (see globToRegex). The
	// status list repeats the order index's predicate so the planner can
	// use it.
	//
	// It looks for the nearest such row, walking the order index down from
	// the row's id (a scalar subquery with ORDER BY … DESC LIMIT 1: an
	// EXISTS would drop the ORDER BY and walk up from the aggregate's
	// first row; NOT COALESCE(…, false) rather than IS NULL keeps the
	// planner's estimate of the filter that of NOT EXISTS, so it still
	// scans the claim index in order). Rows the stream delivered stay
	// pending, and so in the order index, until their status is marked
	// (with mark_done: off, until retention prunes them); a handed-off row
	// is mostly
	// held back by the row just before it, so the walk ends at once
	// instead of passing the aggregate's whole streamed history for every
	// row (TestClaimCostIndependentOfStreamedHistory).
	ordering := fmt.Sprintf(`
       AND (o.aggregate_type IS NULL OR o.aggregate_id IS NULL OR NOT COALESCE((
            SELECT true FROM %[1]s AS p
             WHERE p.aggregate_type = o.aggregate_type
               AND p.aggregate_id = o.aggregate_id
               AND p.id < o.id
               AND p.status IN ('pending', 'processing', 'held')
               AND EXISTS (
                   SELECT FROM unnest($4::text[], $5::bool[], $6::text[]) AS s(sink, every_type, re)
                    WHERE (s.every_type OR p.event_type ~ s.re)
                      AND NOT EXISTS (
                          SELECT FROM %[2]s AS l
                           WHERE l.event_key = p.event_key AND l.action = s.sink
                             AND l.state = 'delivered'))
             ORDER BY p.id DESC
             LIMIT 1), false))`, outbox, ledger)
	if opts.unordered {
		ordering = "\n       AND $4::text[] IS NOT NULL AND $5::bool[] IS NOT NULL AND $6::text[] IS NOT NULL"
	}

	// River's JobGetAvailable shape: lock a batch of due rows, skipping rows
	// another claimer (or a legacy poller) has locked, then mark them ours.
	// In replication mode only rows handed to the claim path, through their
	// own partial index (available_at, id) WHERE status = 'pending' AND
	// handoff_at IS NOT NULL; in poll mode every due row, through
	// (available_at, id) WHERE status = 'pending' (a row the ledger shows
	// delivered everywhere is settled done without sending). payload::text is jsonb's text, byte for byte what the
	// stream decodes. replays and trace are the replays and trace_context
	// columns where they exist.
	claim := func(all bool, replays, trace string) string {
		which := "\n       AND o.handoff_at IS NOT NULL"
		if all {
			which = ""
		}
		return fmt.Sprintf(`
WITH locked AS (
    SELECT o.id
      FROM %[1]s AS o
     WHERE o.status = 'pending'
       AND o.available_at <= now()%[2]s
       AND $3::bool IS NOT NULL%[3]s
     ORDER BY o.available_at, o.id
     LIMIT $1
       FOR UPDATE SKIP LOCKED)
UPDATE %[1]s AS o
   SET status = 'processing', locked_at = now(), locked_by = $2
  FROM locked
 WHERE o.id = locked.id
RETURNING o.id, o.event_key, o.event_type, o.aggregate_type, o.aggregate_id, o.payload::text,
          o.created_at, COALESCE(o.attempts, 0), o.available_at, %[4]s, %[5]s`, outbox, which, ordering, replays, trace)
	}
	var claims [2][3]string
	for i, all := range []bool{false, true} {
		claims[i] = [3]string{
			claim(all, "0", "NULL::text"),
			claim(all, "COALESCE(o.replays, 0)", "NULL::text"),
			claim(all, "COALESCE(o.replays, 0)", "o.trace_context::text"),
		}
	}

	return claimStatements{
		claim: claims,
		// Whether the outbox has the replays column (migration 006) and
		// the trace_context column (migration 008).
		hasReplays: `SELECT EXISTS (SELECT FROM pg_attribute
                WHERE attrelid = $1::text::regclass AND attname = 'replays' AND NOT attisdropped),
       EXISTS (SELECT FROM pg_attribute
                WHERE attrelid = $1::text::regclass AND attname = 'trace_context' AND NOT attisdropped)`,

		ledgerPairs: ledgerPairsSQL(ledger),

		// The claim before sending is the insert itself (never
		// check-then-insert). An existing pair is taken when it is
		// 'unknown' (held, then released by dlq retry, or left by a send
		// whose outcome was unknown), or 'sending' with its lease ($4 ms)
		// passed, its owner gone (owner lock free), or this owner's own
		// (left by a failed settlement). Taking a 'sending' pair is an
		// unknown outcome; the caller tells that case by the state it read
		// before, or by attempts > 1 when the pair appeared since. Pairs
		// are locked in key order.
		claimPairs: fmt.Sprintf(`
INSERT INTO %[1]s AS l (event_key, action, state, attempts, owner, claimed_at)
SELECT t.k, t.a, 'sending', 1, $3, now()
  FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE
   SET state = 'sending', owner = EXCLUDED.owner, claimed_at = now(), attempts = l.attempts + 1
 WHERE l.state = 'unknown'
    OR (l.state = 'sending'
        AND (l.owner IS NULL OR l.owner = EXCLUDED.owner OR l.claimed_at IS NULL
             OR l.claimed_at < now() - $4::bigint * interval '1 millisecond'
             OR NOT %[2]s))
RETURNING l.event_key, l.action, l.attempts`, ledger, ownerAlive("l.owner")),

		delivered: deliveredSQL(ledger, true),
		release:   releaseSQL(ledger),

		// Our claim's outcome is unknown: held for a person (next attempt
		// NULL), or to be sent again by whoever claims the row next.
		unknown: fmt.Sprintf(`
UPDATE %s AS l
   SET state = 'unknown', detail = t.d, next_attempt_at = now() + t.delay * interval '1 millisecond'
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS t(k, a, d, delay)
 WHERE l.event_key = t.k AND l.action = t.a AND l.owner = $5 AND l.state = 'sending'`, ledger),

		// Every status change is conditional on the row still being ours.
		done: fmt.Sprintf(`
UPDATE %s
   SET status = 'done', processed_at = now(), locked_at = NULL, locked_by = NULL
 WHERE id = ANY($1::bigint[]) AND status = 'processing' AND locked_by = $2`, outbox),

		failed: fmt.Sprintf(`
UPDATE %s AS o
   SET status = 'failed', last_error = t.err, attempts = t.n, processed_at = now(),
       locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $4`, outbox),

		// Back to pending, still the claim path's (handoff_at is kept). A
		// NULL error keeps the previous last_error.
		retry: fmt.Sprintf(`
UPDATE %s AS o
   SET status = 'pending', attempts = t.n, available_at = now() + t.delay * interval '1 millisecond',
       last_error = COALESCE(t.err, o.last_error), locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::int[]) AS t(id, delay, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $5`, outbox),

		held: fmt.Sprintf(`
UPDATE %s AS o
   SET status = 'held', last_error = t.err, attempts = t.n, locked_at = NULL, locked_by = NULL
  FROM unnest($1::bigint[], $2::text[], $3::int[]) AS t(id, err, n)
 WHERE o.id = t.id AND o.status = 'processing' AND o.locked_by = $4`, outbox),

		// The aggregates among $1/$2 with no handed-off or held row left
		// unsettled: the stream may deliver their events again. The status
		// list repeats the order index's predicate.
		settled: fmt.Sprintf(`
SELECT t.at, t.ai
  FROM unnest($1::text[], $2::text[]) AS t(at, ai)
 WHERE NOT EXISTS (
       SELECT FROM %s AS o
        WHERE o.aggregate_type = t.at AND o.aggregate_id = t.ai
          AND o.status IN ('pending', 'processing', 'held')
          AND (o.handoff_at IS NOT NULL OR o.status = 'held'))`, outbox),

		releaseOwned: fmt.Sprintf(`
WITH back AS (
UPDATE %[1]s AS o SET status = 'pending', locked_at = NULL, locked_by = NULL,
       handoff_at = coalesce(o.handoff_at, now())
 WHERE o.status = 'processing' AND o.locked_by = $1
RETURNING o.event_key),
withdrawn AS (
DELETE FROM %[2]s AS l USING back WHERE l.event_key = back.event_key AND l.owner = $1 AND l.state = 'sending')
SELECT count(*) FROM back`, outbox, ledger),

		// A lease is renewed while its rows are being delivered.
		extendRows: fmt.Sprintf(`
UPDATE %s SET locked_at = now()
 WHERE id = ANY($1::bigint[]) AND status = 'processing' AND locked_by = $2`, outbox),
		extendClaims: fmt.Sprintf(`
UPDATE %s AS l SET claimed_at = now()
  FROM %s AS o
 WHERE o.id = ANY($1::bigint[]) AND l.event_key = o.event_key AND l.owner = $2 AND l.state = 'sending'`, ledger, outbox),

		// Leases: a processing row whose lease ($1 ms) passed, or whose
		// relay owner (locked_by starting with $2) holds no owner lock, goes
		// back to pending with its attempts. Other lockers (a legacy poller)
		// lose rows only by the lease.
		expireLeases: fmt.Sprintf(`
WITH stale AS (
    SELECT o.id, o.locked_by
      FROM %[1]s AS o
     WHERE o.status = 'processing'
       AND (o.locked_at IS NULL
            OR o.locked_at < now() - $1::bigint * interval '1 millisecond'
            OR (starts_with(o.locked_by, $2) AND NOT %[2]s))
       FOR UPDATE SKIP LOCKED)
UPDATE %[1]s AS o
   SET status = 'pending', locked_at = NULL, locked_by = NULL,
       -- A claimed row is never the stream's: it stays the claim path's.
       handoff_at = coalesce(o.handoff_at, now())
  FROM stale
 WHERE o.id = stale.id AND o.status = 'processing'
RETURNING o.id, stale.locked_by`, outbox, ownerAlive("o.locked_by")),

		// A row with a NULL status is pending, and a pending row with a
		// NULL available_at is due (both columns are nullable): the claim
		// query reads status = 'pending' and orders by available_at, so
		// they are written so.
		repairDue: fmt.Sprintf(`
UPDATE %s SET status = COALESCE(status, 'pending'), available_at = COALESCE(available_at, now())
 WHERE (status IS NULL OR (status = 'pending' AND available_at IS NULL))`, outbox),

		lockOwner:   fmt.Sprintf(`SELECT pg_try_advisory_lock(%d, hashtext($1))`, OwnerLockClass),
		unlockOwner: fmt.Sprintf(`SELECT pg_advisory_unlock(%d, hashtext($1))`, OwnerLockClass),
	}
}

// routingArrays are the ordering check's routing parameters, one entry per
// sink.
func (s *Store) routingArrays() (names []string, every []bool, regex []*string, err error) {
	for _, r := range s.routes {
		f, err := newSinkFilter(r.Events)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("sink %s: %w", r.Name, err)
		}
		names, every, regex = append(names, r.Name), append(every, f.everyType), append(regex, f.regex)
	}
	return names, every, regex, nil
}

// claimStatement returns the claim query for the table's shape (with or
// without the replays and trace_context columns, looked up once) and the
// mode.
func (s *Store) claimStatement(ctx context.Context, all bool) (string, error) {
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	if s.claimKnown {
		return s.pickClaim(all), nil
	}
	dbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dbTimeout)
	defer cancel()
	var replays, trace bool
	if err := s.pool.QueryRow(dbCtx, s.sql.claim.hasReplays, s.outbox).Scan(&replays, &trace); err != nil {
		return "", fmt.Errorf("inspect %s: %w", s.outbox, err)
	}
	switch {
	case replays && trace:
		s.claimShape = 2
	case replays:
		s.claimShape = 1
	default:
		s.claimShape = 0
	}
	s.claimKnown = true
	return s.pickClaim(all), nil
}

func (s *Store) pickClaim(all bool) string {
	i := 0
	if all {
		i = 1
	}
	return s.sql.claim.claim[i][s.claimShape]
}

// Claim implements relay.ClaimStore.
func (s *Store) Claim(ctx context.Context, q relay.ClaimQuery) ([]*relay.Work, error) {
	claimSQL, err := s.claimStatement(ctx, q.All)
	if err != nil {
		return nil, err
	}
	names, every, regex, err := s.routingArrays()
	if err != nil {
		return nil, err
	}
	dbCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	// The rows' leases begin with the statement (locked_at = now()), not
	// before this moment.
	leased := time.Now()
	rows, err := s.pool.Query(dbCtx, claimSQL, q.Limit, q.Owner, q.All, names, every, regex)
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	var (
		out               []*relay.Work
		created, availAt  pgtype.Timestamptz
		attempts, replays int32
	)
	for rows.Next() {
		ev := &relay.Event{Status: "processing"}
		if err := rows.Scan(&ev.ID, &ev.EventKey, &ev.EventType, &ev.AggregateType, &ev.AggregateID,
			&ev.Payload, &created, &attempts, &availAt, &replays, &ev.TraceContext); err != nil {
			rows.Close()
			return nil, fmt.Errorf("claim rows: %w", err)
		}
		ev.CreatedAt, ev.AvailableAt, ev.Attempts = created.Time, availAt.Time, int(attempts)
		out = append(out, &relay.Work{Event: ev, Replay: int(replays), ClaimedAt: leased})
	}
	if err := rows.Err(); err != nil {
		// The rows may have been claimed all the same; the sweeper returns
		// them once this owner is gone or their lease passed.
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	return out, nil
}

// PrepareClaim implements relay.ClaimStore: one read of the ledger and one
// synchronous insert of the claims for the batch.
func (s *Store) PrepareClaim(ctx context.Context, works []*relay.Work, owner string, lease time.Duration) error {
	keys := make([]string, 0, len(works))
	for _, w := range works {
		if len(w.Pairs) > 0 {
			keys = append(keys, w.Event.EventKey)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	dbCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	known, err := readLedger(dbCtx, s.pool, s.sql.claim.ledgerPairs, keys)
	if err != nil {
		return err
	}
	var claimKeys, claimActions []string
	for _, w := range works {
		for _, p := range w.Pairs {
			prev := known[relay.LedgerKey{EventKey: w.Event.EventKey, Action: p.Sink}]
			p.PrevOwner = prev.owner
			if prev.state == "delivered" {
				p.State = relay.PairDelivered
				continue
			}
			claimKeys, claimActions = append(claimKeys, w.Event.EventKey), append(claimActions, p.Sink)
		}
	}
	if len(claimKeys) == 0 {
		return nil
	}
	claimed := map[relay.LedgerKey]int32{}
	err = s.inTx(dbCtx, s.sql.setSynchronousCommit, func(b *pgx.Batch) {
		b.Queue(s.sql.claim.claimPairs, claimKeys, claimActions, owner, lease.Milliseconds())
	}, func(br pgx.BatchResults) error {
		rows, err := br.Query()
		if err != nil {
			return err
		}
		var k relay.LedgerKey
		var attempts int32
		_, err = pgx.ForEachRow(rows, []any{&k.EventKey, &k.Action, &attempts}, func() error {
			claimed[k] = attempts
			return nil
		})
		return err
	})
	if err != nil {
		return fmt.Errorf("claim %d ledger pairs: %w", len(claimKeys), err)
	}
	for _, w := range works {
		for _, p := range w.Pairs {
			if p.State == relay.PairDelivered {
				continue
			}
			key := relay.LedgerKey{EventKey: w.Event.EventKey, Action: p.Sink}
			attempts, ok := claimed[key]
			prev := known[key]
			switch {
			case !ok:
				p.State = relay.PairBlocked
			case prev.state == "sending" || prev.state == "" && attempts > 1:
				// We took over a claim whose send may have happened.
				p.State, p.Claimed = relay.PairUnknown, true
			default:
				p.Claimed = true
			}
		}
	}
	return nil
}

// SettleClaim implements relay.ClaimStore: one synchronous transaction and
// one round trip, at most one statement per kind.
func (s *Store) SettleClaim(ctx context.Context, works []*relay.Work, owner string) error {
	r := split(works)
	st := s.sql.claim
	var steps []step
	if len(r.deliveredKeys) > 0 {
		steps = append(steps, exec(fmt.Sprintf("record %d delivered pairs", len(r.deliveredKeys)), st.delivered, r.deliveredKeys, r.deliveredActions, owner))
	}
	if len(r.releaseKeys) > 0 {
		steps = append(steps, exec(fmt.Sprintf("withdraw %d ledger claims", len(r.releaseKeys)), st.release, r.releaseKeys, r.releaseActions, owner))
	}
	if len(r.unknownKeys) > 0 {
		// Held rows' pairs wait for a person (next attempt NULL); the
		// others are sent again when the row is due.
		delays := make([]*int64, len(r.unknownKeys))
		next := map[string]*int64{}
		for i, w := range works {
			if w.Decision.Kind == relay.Later {
				ms := max(time.Until(w.Decision.At), 0).Milliseconds()
				next[works[i].Event.EventKey] = &ms
			}
		}
		for i, k := range r.unknownKeys {
			delays[i] = next[k]
		}
		steps = append(steps, exec(fmt.Sprintf("mark %d ledger pairs unknown", len(r.unknownKeys)), st.unknown, r.unknownKeys, r.unknownActions, r.unknownDetails, delays, owner))
	}
	if len(r.doneIDs) > 0 {
		steps = append(steps, exec(fmt.Sprintf("mark %d rows done", len(r.doneIDs)), st.done, r.doneIDs, owner))
	}
	if len(r.deadIDs) > 0 {
		steps = append(steps, exec(fmt.Sprintf("dead-letter %d rows", len(r.deadIDs)), st.failed, r.deadIDs, r.deadErrs, r.deadN, owner))
	}
	if len(r.heldIDs) > 0 {
		steps = append(steps, exec(fmt.Sprintf("hold %d rows", len(r.heldIDs)), st.held, r.heldIDs, r.heldErrs, r.heldN, owner))
	}
	if len(r.retryIDs) > 0 {
		steps = append(steps, exec(fmt.Sprintf("put %d rows back", len(r.retryIDs)), st.retry, r.retryIDs, r.retryMS, r.retryErrs, r.retryN, owner))
	}
	if len(steps) == 0 {
		return nil
	}
	if _, err := s.runSteps(ctx, s.sql.setSynchronousCommit, steps); err != nil {
		return fmt.Errorf("settle %d claimed rows: %w", len(works), err)
	}
	return nil
}

// SettledAggregates implements relay.ClaimStore. It only reads.
func (s *Store) SettledAggregates(ctx context.Context, aggs []relay.AggregateKey) ([]relay.AggregateKey, error) {
	types, ids := make([]string, len(aggs)), make([]string, len(aggs))
	for i, a := range aggs {
		types[i], ids[i] = a.Type, a.ID
	}
	rows, err := s.pool.Query(ctx, s.sql.claim.settled, types, ids)
	if err != nil {
		return nil, fmt.Errorf("check settled aggregates: %w", err)
	}
	settled, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (relay.AggregateKey, error) {
		var a relay.AggregateKey
		err := row.Scan(&a.Type, &a.ID)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("check settled aggregates: %w", err)
	}
	return settled, nil
}

// ReleaseOwned returns to pending the rows processing under owner, keeping
// their attempts, and withdraws owner's 'sending' claims of them: the claim
// source calls it as it starts, when it has nothing in flight, so that rows
// a claim cut short by a stopping term left claimed do not wait for their
// lease. It returns how many rows it returned.
func (s *Store) ReleaseOwned(ctx context.Context, owner string) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, s.sql.claim.releaseOwned, owner).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("return the rows %s left claimed: %w", owner, err)
	}
	return n, nil
}

// ExtendLeases implements relay.ClaimStore.
func (s *Store) ExtendLeases(ctx context.Context, ids []int64, owner string) error {
	_, err := s.runSteps(ctx, "", []step{
		exec("renew row leases", s.sql.claim.extendRows, ids, owner),
		exec("renew ledger claims", s.sql.claim.extendClaims, ids, owner),
	})
	if err != nil {
		return fmt.Errorf("extend the leases of %d rows: %w", len(ids), err)
	}
	return nil
}
