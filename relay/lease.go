package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// leaseLeft reports how much of the claim path's lease on w is left, less
// a margin (a tenth of the lease, 1-30 s): from its claim, or the last
// successful renewal after it. Another relay's sweeper takes a row over
// once its lease has passed, so a claimed row is sent only while this is
// positive (docs/operations-health.md, "a lost lock").
func (e *Engine) leaseLeft(w *Work, now time.Time) time.Duration {
	from := w.ClaimedAt
	if r := time.Unix(0, e.leaseRenewed.Load()); r.After(from) {
		from = r
	}
	margin := min(max(e.cfg.ClaimLease/10, time.Second), 30*time.Second)
	if margin > e.cfg.ClaimLease/4 {
		margin = e.cfg.ClaimLease / 4
	}
	return from.Add(e.cfg.ClaimLease - margin).Sub(now)
}

// renewLeases extends the claim path's leases on the rows it is working on,
// every third of the lease, until ctx ends.
func (e *Engine) renewLeases(ctx context.Context) {
	every := max(e.cfg.ClaimLease/3, 100*time.Millisecond)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		e.mu.Lock()
		ids := make([]int64, 0, len(e.inflight[PathClaim]))
		for id := range e.inflight[PathClaim] {
			ids = append(ids, id)
		}
		e.mu.Unlock()
		if len(ids) == 0 {
			continue
		}
		began := time.Now()
		if err := e.cfg.Claim.ExtendLeases(ctx, ids, e.cfg.Owner); err != nil {
			if ctx.Err() == nil {
				e.log.Warn().Err(err).Int("rows", len(ids)).Msg("extend the leases of rows being delivered; retrying at the next renewal (rows whose lease passes meanwhile are not sent)")
			}
			continue
		}
		e.leaseRenewed.Store(began.UnixNano())
	}
}

// SubmitClaimed hands rows the claim path claimed to the engine: it
// prepares their ledger claims and queues them; a row whose claims the
// ledger refuses for its data is dead-lettered unsent (refuse.go). It
// blocks while the engine applies back-pressure. On an error (ctx ended,
// or the ledger claims could not be made) the rows it did not take are
// returned to the caller, which puts them back; every row it took is
// settled by the engine.
func (e *Engine) SubmitClaimed(ctx context.Context, works []*Work) (notTaken []*Work, err error) {
	if e.cfg.Claim == nil {
		return works, errors.New("engine: no claim store")
	}
	if err := e.waitStarted(ctx); err != nil {
		return works, err
	}
	if len(works) == 0 {
		return nil, nil
	}
	e.linkRuns(works)
	for _, w := range works {
		w.path = PathClaim
		routed := e.route(PathClaim, w.Event)
		w.Pairs, w.lanes, w.refused, w.size = routed.Pairs, routed.lanes, routed.refused, routed.size
		if w.ClaimedAt.IsZero() {
			w.ClaimedAt = time.Now()
		}
	}
	// Room for more than the engine holds at once never comes: a larger
	// batch is taken in parts, in order.
	for len(works) > 0 {
		part := works[:e.unsettled.fit(works)]
		works = works[len(part):]
		if err := e.submitClaimedPart(ctx, part); err != nil {
			return slices.Concat(part, works), err
		}
	}
	return nil, nil
}

// submitClaimedPart takes room for works, prepares their ledger claims and
// queues them; on an error it has taken none of them.
func (e *Engine) submitClaimedPart(ctx context.Context, works []*Work) error {
	if err := e.take(ctx, works); err != nil {
		return err
	}
	err := e.prepareIsolating(ctx, works, func(ctx context.Context, works []*Work) error {
		return e.cfg.Claim.PrepareClaim(ctx, works, e.cfg.Owner, e.cfg.ClaimLease)
	})
	if err != nil {
		e.unsettled.give(works...)
		return fmt.Errorf("claim the ledger pairs of %d rows: %w", len(works), err)
	}
	now := time.Now()
	for _, w := range works {
		e.admit(w, nil)
	}
	for _, w := range works {
		e.dispatch(ctx, w, now)
	}
	return nil
}

// linkRuns links the works of each aggregate that came in one claim (in id
// order): a run. A run's later rows never go out in a lane once an earlier
// one was not delivered there (claimRun).
func (e *Engine) linkRuns(works []*Work) {
	if e.cfg.Unordered || len(works) < 2 {
		return
	}
	var count map[AggregateKey]int
	for _, w := range works {
		if w.run == nil && w.Event.Ordered() {
			if count == nil {
				count = map[AggregateKey]int{}
			}
			count[w.Event.AggregateKey()]++
		}
	}
	runs := map[AggregateKey]*claimRun{}
	for _, w := range works {
		if w.run != nil || !w.Event.Ordered() {
			continue
		}
		agg := w.Event.AggregateKey()
		if count[agg] < 2 {
			continue
		}
		r := runs[agg]
		if r == nil {
			r = &claimRun{stopped: make([]bool, len(e.lanes))}
			runs[agg] = r
		}
		w.run = r
	}
}
