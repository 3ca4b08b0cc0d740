package ledger

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The claim path after a claim (docs/architecture.md, "The claim path"):
// the (event, sink) pairs claimed in the ledger before sending, each
// batch settled in one synchronous transaction, and the leases renewed
// while a batch is sent; every change is conditional on the row or claim
// still being this owner's.

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
		return fmt.Errorf("claim %d ledger pairs: %w", len(claimKeys), rowDataError(err))
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
// one round trip, at most one statement per kind, and one that reports the
// rows deleted since they were claimed.
func (s *Store) SettleClaim(ctx context.Context, works []*relay.Work, owner string) ([]int64, error) {
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
		return nil, nil
	}
	claimed := make([]int64, len(works))
	for i, w := range works {
		claimed[i] = w.Event.ID
	}
	steps = append(steps, ids("look for deleted rows", st.missing, claimed))
	gone, err := s.runSteps(ctx, s.sql.setSynchronousCommit, steps)
	if err != nil {
		return nil, fmt.Errorf("settle %d claimed rows: %w", len(works), err)
	}
	return gone, nil
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

// ExtendLeases implements relay.ClaimStore. It renews the ledger claims
// before the rows, in the order every transaction of the relay's that
// writes both takes them (docs/architecture.md, "Lock order"): a renewal
// holding a row while it waited for the pair a settlement held, the
// settlement waiting for that row, was a deadlock.
func (s *Store) ExtendLeases(ctx context.Context, ids []int64, owner string) error {
	_, err := s.runSteps(ctx, "", []step{
		exec("renew ledger claims", s.sql.claim.extendClaims, ids, owner),
		exec("renew row leases", s.sql.claim.extendRows, ids, owner),
	})
	if err != nil {
		return fmt.Errorf("extend the leases of %d rows: %w", len(ids), err)
	}
	return nil
}
