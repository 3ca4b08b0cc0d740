package claim

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// dbTimeout bounds one database round trip of the claim path. Statements
// run on a context that ctx's end does not cancel: a claim or settlement
// cut off after the server committed it would leave rows 'processing'
// until the sweeper finds them.
const dbTimeout = 30 * time.Second

// claimedRow is one claimed row on its way through a batch.
type claimedRow struct {
	ev       *relay.Event
	replay   int // Delivery.Replay: the row's replays, 0 when never replayed
	envelope []byte
	nudge    []byte
	pairs    []*pair // one per routed sink

	// deferUntil is set when the row is not sent at all (a routed sink's
	// circuit is open, or the batch could not be prepared).
	deferUntil  time.Time
	deferReason string
}

func (r *claimedRow) key(sink string) relay.LedgerKey {
	return relay.LedgerKey{EventKey: r.ev.EventKey, Action: sink}
}

type pairState int

const (
	pairSend      pairState = iota // claimed by us: send it
	pairDelivered                  // the ledger shows it delivered
	pairBlocked                    // another owner's claim within its lease
	pairHold                       // a hold sink's claim we took over: hold, no send
)

// pair is one (row, sink).
type pair struct {
	row   *claimedRow
	route *route
	state pairState
	owner string // the ledger's owner before we claimed it, if any

	// The send, valid once the batch's sends are done.
	sent      bool
	skipped   string // why it was not sent (circuit, shutdown)
	skipUntil time.Time
	err       error
}

// ledgerEntry is a ledger pair as read before claiming.
type ledgerEntry struct {
	state string
	owner string
}

// runBatch claims one batch, delivers it and settles it. It returns how
// many rows it claimed. An error means the batch was not delivered; its
// rows were put back to pending where possible.
func (c *Claimer) runBatch(ctx context.Context) (int, error) {
	rows, err := c.claim(ctx)
	if err != nil {
		return 0, err
	}
	if len(rows) == 0 {
		return 0, nil
	}
	c.Stats.Claimed.Add(int64(len(rows)))
	if err := c.prepare(ctx, rows); err != nil {
		s := &settlement{}
		for _, r := range rows {
			s.retry = append(s.retry, retryRow{id: r.ev.ID, delay: retryDelay(1), attempts: r.ev.Attempts})
		}
		c.settle(ctx, s)
		return len(rows), fmt.Errorf("prepare %d claimed rows (put back to pending): %w", len(rows), err)
	}
	c.send(ctx, rows)
	s := c.outcomes(ctx, rows)
	if c.settle(ctx, s) {
		c.aggregatesSettled(ctx, s.settledAggs)
	}
	return len(rows), nil
}

// claim runs the claim query.
func (c *Claimer) claim(ctx context.Context) ([]*claimedRow, error) {
	args := []any{c.cfg.BatchSize, c.cfg.Owner}
	if !c.cfg.Unordered {
		args = append(args, c.sinkNames, c.sinkEvery, c.sinkRegex)
	}
	dbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dbTimeout)
	defer cancel()
	rows, err := c.cfg.Pool.Query(dbCtx, c.claimSQL, args...)
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	var (
		out               []*claimedRow
		created, availAt  pgtype.Timestamptz
		attempts, replays int32
	)
	for rows.Next() {
		ev := &relay.Event{Status: "processing"}
		if err := rows.Scan(&ev.ID, &ev.EventKey, &ev.EventType, &ev.AggregateType, &ev.AggregateID,
			&ev.Payload, &created, &attempts, &availAt, &replays); err != nil {
			rows.Close()
			return nil, fmt.Errorf("claim rows: %w", err)
		}
		ev.CreatedAt, ev.AvailableAt, ev.Attempts = created.Time, availAt.Time, int(attempts)
		out = append(out, &claimedRow{ev: ev, replay: int(replays)})
	}
	if err := rows.Err(); err != nil {
		// The rows may have been claimed all the same; the sweeper returns
		// them once this owner is gone or their lease passed.
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	return out, nil
}

// prepare routes the rows, skips pairs the ledger shows delivered, defers
// rows that need a sink whose circuit is open, and claims the remaining
// pairs in the ledger (one read and one write for the batch). Nothing is
// sent yet.
func (c *Claimer) prepare(ctx context.Context, rows []*claimedRow) error {
	keys := make([]string, 0, len(rows))
	for _, r := range rows {
		for _, rt := range c.routes {
			if routes(rt.Route, r.ev.EventType) {
				r.pairs = append(r.pairs, &pair{row: r, route: rt})
			}
		}
		if len(r.pairs) > 0 {
			keys = append(keys, r.ev.EventKey)
		}
	}
	if len(keys) == 0 {
		return nil
	}

	dbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dbTimeout)
	defer cancel()
	known := map[relay.LedgerKey]ledgerEntry{}
	qrows, err := c.cfg.Pool.Query(dbCtx, c.sql.ledgerPairs, keys)
	if err != nil {
		return fmt.Errorf("read ledger: %w", err)
	}
	var (
		k     relay.LedgerKey
		state string
		owner *string
	)
	_, err = pgx.ForEachRow(qrows, []any{&k.EventKey, &k.Action, &state, &owner}, func() error {
		known[k] = ledgerEntry{state: state, owner: deref(owner)}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read ledger: %w", err)
	}

	now := time.Now()
	var claimKeys, claimActions []string
	for _, r := range rows {
		for _, p := range r.pairs {
			prev := known[r.key(p.route.name)]
			p.owner = prev.owner
			if prev.state == "delivered" {
				p.state = pairDelivered
				continue
			}
			if until, open := p.route.circuit(now); open {
				if until.After(r.deferUntil) {
					r.deferUntil = until
				}
				r.deferReason = joinReason(r.deferReason, "sink "+p.route.name+": circuit open: sink is down")
			}
		}
		if !r.deferUntil.IsZero() {
			continue
		}
		for _, p := range r.pairs {
			if p.state != pairDelivered {
				claimKeys = append(claimKeys, r.ev.EventKey)
				claimActions = append(claimActions, p.route.name)
			}
		}
	}
	if len(claimKeys) == 0 {
		return nil
	}

	claimed := map[relay.LedgerKey]int32{}
	err = c.inTx(dbCtx, func(b *pgx.Batch) {
		b.Queue(c.sql.setSyncCommit)
		b.Queue(c.sql.claimPairs, claimKeys, claimActions, c.cfg.Owner, c.cfg.LockTimeout.Milliseconds())
	}, func(br pgx.BatchResults) error {
		if _, err := br.Exec(); err != nil {
			return err
		}
		rows, err := br.Query()
		if err != nil {
			return err
		}
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

	for _, r := range rows {
		if !r.deferUntil.IsZero() {
			continue
		}
		for _, p := range r.pairs {
			if p.state == pairDelivered {
				continue
			}
			key := r.key(p.route.name)
			attempts, ok := claimed[key]
			prev := known[key]
			switch {
			case !ok:
				p.state = pairBlocked
			case prev.state == "sending" || prev.state == "" && attempts > 1:
				// We took over a claim whose send may have happened.
				c.Stats.TakenOver.Add(1)
				from := prev.owner
				if from == "" {
					from = "unknown owner"
				}
				p.owner = from
				l := c.log.Warn().Str("sink", p.route.name).Int64("id", r.ev.ID).Str("event_key", r.ev.EventKey).Str("old_owner", from)
				if p.route.Hold {
					p.state = pairHold
					l.Msg("took over a ledger claim whose lease passed or whose owner is gone: outcome unknown, holding the event (the sink holds such events)")
				} else {
					p.state = pairSend
					l.Msg("took over a ledger claim whose lease passed or whose owner is gone: outcome unknown, sending again with the same id and body")
				}
			default:
				p.state = pairSend
			}
		}
	}
	return nil
}

// send delivers every pair in state pairSend: one goroutine per sink feeds
// the sink (whose window applies back-pressure), and send returns when
// every delivery has called done. After ctx is done, or while the sink's
// circuit is open, a pair is not sent.
func (c *Claimer) send(ctx context.Context, rows []*claimedRow) {
	perRoute := map[*route][]*pair{}
	for _, r := range rows {
		if !r.deferUntil.IsZero() {
			continue
		}
		for _, p := range r.pairs {
			if p.state != pairSend {
				continue
			}
			if p.route.Nudge && r.nudge == nil {
				r.nudge = r.ev.AppendNudge(nil)
			}
			if !p.route.Nudge && r.envelope == nil {
				r.envelope = r.ev.AppendEnvelope(nil)
			}
			perRoute[p.route] = append(perRoute[p.route], p)
		}
	}
	var wg sync.WaitGroup
	for rt, pairs := range perRoute {
		wg.Add(len(pairs))
		go func() {
			for _, p := range pairs {
				if ctx.Err() != nil {
					p.skipped, p.skipUntil = "not sent: shutting down", time.Now()
					wg.Done()
					continue
				}
				if until, open := rt.circuit(time.Now()); open {
					p.skipped, p.skipUntil = "circuit open: sink is down", until
					wg.Done()
					continue
				}
				body := p.row.envelope
				if rt.Nudge {
					body = p.row.nudge
				}
				p.sent = true
				d := &relay.Delivery{Event: p.row.ev, Body: body, Attempt: p.row.ev.Attempts + 1, Replay: p.row.replay}
				rt.Sink.Send(ctx, d, func(err error) {
					p.err = err
					if err == nil {
						rt.closeCircuit(c)
					} else if class, retryAfter := relay.Classify(err); class == relay.SinkDown {
						p.skipUntil = rt.openCircuit(c, firstLine(err.Error()), retryAfter)
					}
					wg.Done()
				})
			}
		}()
	}
	wg.Wait()
}

// settlement is a batch's outcome: at most one statement per kind.
type settlement struct {
	delivered   []relay.LedgerKey
	release     []relay.LedgerKey
	unknown     []unknownPair
	done        []int64
	failed      []finalRow
	held        []finalRow
	retry       []retryRow
	settledAggs []relay.AggregateKey // of rows done or failed
}

type unknownPair struct {
	key    relay.LedgerKey
	detail string
	// nextAttempt is the row's retry delay, for next_attempt_at; nil when
	// the row is not retried (held or failed).
	nextAttempt *time.Duration
}

type finalRow struct {
	id       int64
	err      string
	attempts int
}

type retryRow struct {
	id       int64
	delay    time.Duration
	err      string // "" keeps last_error
	attempts int
}

// outcomes turns the sends into the batch's settlement. Per row: any
// permanent error fails it; else an unknown outcome at a hold sink holds
// it; else a transient (or unknown, at a retry sink) error counts an
// attempt and schedules it after the backoff, or fails it at MaxAttempts;
// else a pair not sent (circuit open, another owner's live claim, shutdown)
// puts it back without counting; else it is done.
func (c *Claimer) outcomes(ctx context.Context, rows []*claimedRow) *settlement {
	s := &settlement{}
	now := time.Now()
	aggs := map[relay.AggregateKey]bool{}
	for _, r := range rows {
		ev := r.ev
		if !r.deferUntil.IsZero() {
			s.retry = append(s.retry, retryRow{id: ev.ID, delay: max(r.deferUntil.Sub(now), 0), err: r.deferReason, attempts: ev.Attempts})
			continue
		}
		var (
			failReasons, heldReasons, retryReasons, deferReasons string
			counted                                              bool
			retryAfter                                           time.Duration
			deferUntil                                           time.Time
			unknownRetry                                         []relay.LedgerKey
		)
		deferTo := func(t time.Time, reason string) {
			if t.After(deferUntil) {
				deferUntil = t
			}
			deferReasons = joinReason(deferReasons, reason)
		}
		for _, p := range r.pairs {
			sink := "sink " + p.route.name + ": "
			key := r.key(p.route.name)
			switch p.state {
			case pairDelivered:
				continue
			case pairBlocked:
				deferTo(now.Add(c.cfg.PollInterval), sink+"another owner ("+orUnknown(p.owner)+") holds a live claim to send it")
				continue
			case pairHold:
				reason := "outcome unknown: took over the ledger claim of " + p.owner + " (lease passed or owner gone)"
				heldReasons = joinReason(heldReasons, sink+reason)
				s.unknown = append(s.unknown, unknownPair{key: key, detail: reason})
				continue
			}
			if !p.sent {
				s.release = append(s.release, key)
				deferTo(p.skipUntil, sink+p.skipped)
				continue
			}
			if p.err == nil {
				s.delivered = append(s.delivered, key)
				c.Stats.Delivered.Add(1)
				continue
			}
			class, after := relay.Classify(p.err)
			reason := sink + firstLine(p.err.Error())
			switch {
			case class == relay.Permanent:
				s.release = append(s.release, key)
				failReasons = joinReason(failReasons, reason)
				counted = true
			case class == relay.SinkDown:
				s.release = append(s.release, key)
				deferTo(p.skipUntil, reason)
			case class == relay.Unknown && p.route.Hold:
				heldReasons = joinReason(heldReasons, reason)
				s.unknown = append(s.unknown, unknownPair{key: key, detail: "outcome unknown: " + firstLine(p.err.Error())})
				counted = true
			case class == relay.Unknown:
				// Whoever claims the row next sends it again (same id and
				// body): an 'unknown' pair may be claimed.
				unknownRetry = append(unknownRetry, key)
				retryReasons = joinReason(retryReasons, reason)
				counted = true
				retryAfter = max(retryAfter, after)
			case ctx.Err() != nil:
				// A send cut short by shutdown is not the event's fault.
				s.release = append(s.release, key)
				deferTo(now, reason)
			default:
				s.release = append(s.release, key)
				retryReasons = joinReason(retryReasons, reason)
				counted = true
				retryAfter = max(retryAfter, after)
			}
		}

		attempts := ev.Attempts
		if counted {
			attempts++
		}
		log := c.log.With().Int64("id", ev.ID).Str("event_key", ev.EventKey).Int("attempts", attempts).Logger()
		final := false // done or failed
		var nextAttempt *time.Duration
		switch {
		case failReasons != "":
			s.failed = append(s.failed, finalRow{id: ev.ID, err: failReasons, attempts: attempts})
			c.Stats.Failed.Add(1)
			final = true
			log.Warn().Str("error", failReasons).Msg("event failed: dead-lettered")
		case heldReasons != "":
			s.held = append(s.held, finalRow{id: ev.ID, err: heldReasons, attempts: attempts})
			c.Stats.Held.Add(1)
			log.Warn().Str("reason", heldReasons).Msg("event held: its outcome is unknown and the sink holds such events; see outbox-relay dlq list")
		case retryReasons != "" && attempts >= c.cfg.MaxAttempts:
			err := "max_attempts reached: " + retryReasons
			s.failed = append(s.failed, finalRow{id: ev.ID, err: err, attempts: attempts})
			c.Stats.Failed.Add(1)
			final = true
			log.Warn().Str("error", err).Msg("event failed: dead-lettered")
		case retryReasons != "":
			delay := max(c.backoff(attempts), retryAfter, deferUntil.Sub(now))
			nextAttempt = &delay
			s.retry = append(s.retry, retryRow{id: ev.ID, delay: delay, err: joinReason(retryReasons, deferReasons), attempts: attempts})
			c.Stats.Retried.Add(1)
			log.Debug().Str("error", retryReasons).Dur("retry_in", delay).Msg("delivery failed; retrying later")
		case deferReasons != "":
			s.retry = append(s.retry, retryRow{id: ev.ID, delay: max(deferUntil.Sub(now), 0), err: deferReasons, attempts: attempts})
		default:
			s.done = append(s.done, ev.ID)
			final = true
		}
		for _, key := range unknownRetry {
			s.unknown = append(s.unknown, unknownPair{key: key, detail: "outcome unknown: sent again at the next attempt", nextAttempt: nextAttempt})
		}
		if final && ev.Ordered() {
			aggs[ev.AggregateKey()] = true
		}
	}
	for a := range aggs {
		s.settledAggs = append(s.settledAggs, a)
	}
	return s
}

// settle writes s in one transaction and one round trip, at most one
// statement per kind, each conditional on the row still being ours
// (status 'processing', locked_by = owner) or the ledger claim still ours.
// It retries while the database is unreachable, and a few times more after
// ctx is done; it reports whether the write succeeded. Rows it could not
// settle stay 'processing' until the sweeper returns them.
func (c *Claimer) settle(ctx context.Context, s *settlement) bool {
	if len(s.delivered)+len(s.release)+len(s.unknown)+len(s.done)+len(s.failed)+len(s.held)+len(s.retry) == 0 {
		return true
	}
	statements := 0
	owner := c.cfg.Owner
	queue := func(b *pgx.Batch) {
		defer func() { statements = b.Len() }()
		b.Queue(c.sql.setSyncCommit)
		if len(s.delivered) > 0 {
			keys, actions := splitKeys(s.delivered)
			b.Queue(c.sql.delivered, keys, actions, owner)
		}
		if len(s.release) > 0 {
			keys, actions := splitKeys(s.release)
			b.Queue(c.sql.release, keys, actions, owner)
		}
		if n := len(s.unknown); n > 0 {
			keys, actions, details := make([]string, n), make([]string, n), make([]string, n)
			delays := make([]*int64, n)
			for i, u := range s.unknown {
				keys[i], actions[i], details[i] = u.key.EventKey, u.key.Action, u.detail
				if u.nextAttempt != nil {
					ms := u.nextAttempt.Milliseconds()
					delays[i] = &ms
				}
			}
			b.Queue(c.sql.unknown, keys, actions, details, delays, owner)
		}
		if len(s.done) > 0 {
			b.Queue(c.sql.done, s.done, owner)
		}
		if len(s.failed) > 0 {
			ids, errs, attempts := splitFinal(s.failed)
			b.Queue(c.sql.failed, ids, errs, attempts, owner)
		}
		if len(s.held) > 0 {
			ids, errs, attempts := splitFinal(s.held)
			b.Queue(c.sql.held, ids, errs, attempts, owner)
		}
		if n := len(s.retry); n > 0 {
			ids, delays, attempts := make([]int64, n), make([]int64, n), make([]int32, n)
			errs := make([]*string, n)
			for i, r := range s.retry {
				ids[i], delays[i], attempts[i] = r.id, r.delay.Milliseconds(), int32(r.attempts)
				if r.err != "" {
					errs[i] = &r.err
				}
			}
			b.Queue(c.sql.retry, ids, delays, errs, attempts, owner)
		}
	}
	results := func(br pgx.BatchResults) error {
		for range statements {
			if _, err := br.Exec(); err != nil {
				return err
			}
		}
		return nil
	}
	for attempt := 1; ; attempt++ {
		dbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dbTimeout)
		err := c.inTx(dbCtx, queue, results)
		cancel()
		if err == nil {
			return true
		}
		if ctx.Err() != nil && attempt >= 3 {
			c.log.Error().Err(err).Msg("settle a batch while stopping; its rows stay 'processing' until the sweeper of the next owner returns them")
			return false
		}
		wait := retryDelay(attempt)
		c.log.Error().Err(err).Dur("retry_in", wait).Msg("settle a batch; retrying")
		time.Sleep(wait)
	}
}

// aggregatesSettled tells the engine which aggregates of rows that became
// done or failed have no handed-off or held row left unsettled. DivertSeq
// is read before the table is checked, so a hand-off the engine makes
// meanwhile keeps its aggregate diverted.
func (c *Claimer) aggregatesSettled(ctx context.Context, aggs []relay.AggregateKey) {
	if c.cfg.OnAggregateSettled == nil || len(aggs) == 0 {
		return
	}
	var seq uint64
	if c.cfg.DivertSeq != nil {
		seq = c.cfg.DivertSeq()
	}
	types, ids := make([]string, len(aggs)), make([]string, len(aggs))
	for i, a := range aggs {
		types[i], ids[i] = a.Type, a.ID
	}
	dbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dbTimeout)
	defer cancel()
	rows, err := c.cfg.Pool.Query(dbCtx, c.sql.settled, types, ids)
	if err != nil {
		c.log.Warn().Err(err).Msg("check settled aggregates; the stream keeps diverting them until the next settlement")
		return
	}
	settled, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (relay.AggregateKey, error) {
		var a relay.AggregateKey
		err := row.Scan(&a.Type, &a.ID)
		return a, err
	})
	if err != nil {
		c.log.Warn().Err(err).Msg("check settled aggregates; the stream keeps diverting them until the next settlement")
		return
	}
	for _, a := range settled {
		c.cfg.OnAggregateSettled(a, seq)
	}
}

// inTx runs the statements queue adds as one batch in one transaction.
func (c *Claimer) inTx(ctx context.Context, queue func(*pgx.Batch), results func(pgx.BatchResults) error) error {
	b := &pgx.Batch{}
	queue(b)
	return pgx.BeginFunc(ctx, c.cfg.Pool, func(tx pgx.Tx) error {
		br := tx.SendBatch(ctx, b)
		err := results(br)
		if closeErr := br.Close(); err == nil {
			err = closeErr
		}
		return err
	})
}

// circuit reports whether the sink's circuit is open at now, and until when.
func (r *route) circuit(now time.Time) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.openUntil, now.Before(r.openUntil)
}

// openCircuit opens the sink's circuit for Retry-After, or 1 s doubling to
// 30 s with each opening in a row, and returns when it closes. Failures
// while it is open (other sends of the same batch) do not double it again.
func (r *route) openCircuit(c *Claimer, reason string, retryAfter time.Duration) time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	if now.Before(r.openUntil) {
		if retryAfter > 0 && now.Add(retryAfter).After(r.openUntil) {
			r.openUntil = now.Add(retryAfter)
		}
		return r.openUntil
	}
	r.downCount++
	cool := retryAfter
	if cool <= 0 {
		cool = min(time.Second<<min(r.downCount-1, 5), 30*time.Second)
	}
	r.openUntil = now.Add(cool)
	c.log.Warn().Str("sink", r.name).Str("error", reason).Dur("retry_in", cool).
		Msg("sink is down: circuit open, its rows wait without counting attempts")
	return r.openUntil
}

func (r *route) closeCircuit(c *Claimer) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.downCount > 0 {
		r.downCount = 0
		c.log.Info().Str("sink", r.name).Msg("sink is back: circuit closed")
	}
}

func splitKeys(keys []relay.LedgerKey) (eventKeys, actions []string) {
	eventKeys, actions = make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		eventKeys[i], actions[i] = k.EventKey, k.Action
	}
	return eventKeys, actions
}

func splitFinal(rows []finalRow) (ids []int64, errs []string, attempts []int32) {
	ids, errs, attempts = make([]int64, len(rows)), make([]string, len(rows)), make([]int32, len(rows))
	for i, r := range rows {
		ids[i], errs[i], attempts[i] = r.id, r.err, int32(r.attempts)
	}
	return ids, errs, attempts
}

func joinReason(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

func orUnknown(owner string) string {
	if owner == "" {
		return "unknown owner"
	}
	return owner
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// firstLine keeps error text to one short line for last_error.
func firstLine(s string) string {
	if i := strings.IndexAny(s, "\r\n"); i >= 0 {
		s = s[:i]
	}
	if len(s) > 500 {
		n := 500
		for n > 0 && !utf8.RuneStart(s[n]) {
			n--
		}
		s = s[:n]
	}
	return s
}
