package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The load's events: aggregate type "order", aggregate ids "a000".."aNNN",
// each owned by one writer, which writes it one transaction at a time, so
// the per-aggregate sequence number in the payload is the commit order.
const (
	aggregateType = "order"
	insertSQL     = `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
VALUES ($1, '` + aggregateType + `', $2, $3, $4::text::jsonb)`
	// insertAtSQL sets available_at: NULL (due now, docs/guarantees.md) or
	// $5 seconds from now (scheduled; its aggregate's later events wait).
	insertAtSQL = `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at)
VALUES ($1, '` + aggregateType + `', $2, $3, $4::text::jsonb, CASE WHEN $5::float8 > 0 THEN now() + make_interval(secs => $5::float8) END)`
	// insertNullStatusSQL writes the status NULL, as the seed schema
	// allows: the row is pending (docs/guarantees.md, "NULL status and NULL
	// available_at").
	insertNullStatusSQL = `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status)
VALUES ($1, '` + aggregateType + `', $2, $3, $4::text::jsonb, NULL)`
	// nullAtShare and scheduledShare of the single-row transactions insert
	// a row with a NULL available_at, or one scheduled scheduledIn (±50%)
	// ahead.
	nullAtShare    = 0.004
	scheduledShare = 0.004
	scheduledIn    = 3 * time.Second
	// nullStatusShare of the rows (of any transaction, but those with an
	// available_at of their own) are written with a NULL status.
	nullStatusShare = 0.003
	// largeShare of the single-row transactions carry a payload of
	// load.largeMin..largeMax bytes: a few a minute at the profiles' rates.
	largeShare = 0.0013
	// multiRowShare of the transactions carry 2..maxRowsPerTx events, some
	// of one aggregate, in id (= sequence) order; bulkShare carry
	// bulkMin..bulkMax, more than the stream hands the engine at once (256).
	multiRowShare = 0.3
	maxRowsPerTx  = 8
	bulkShare     = 0.002
	bulkMin       = 100
	bulkMax       = 400
	padding       = 160
)

// outboxRow is one event a writer publishes.
type outboxRow struct {
	key, agg, eventType, payload string
	seq                          int64
	// availableAt: 0 leaves available_at to its default (now), <0 writes
	// NULL, >0 schedules the row that far ahead.
	availableAt time.Duration
	nullStatus  bool // status written NULL (availableAt must be 0)
	large       int  // bytes of padding of a large payload; 0 for the usual
	// legacy: written with the outbox's bound on event_key lengths off
	// (keyBoundTrigger), as a row older than that bound is; a transaction
	// with one such row is written so whole.
	legacy bool
}

// committedEvent is an event whose transaction committed, and when the
// writer learnt it (right after COMMIT returned, or when an unknown outcome
// was found committed).
type committedEvent struct {
	key, agg   string
	seq        int64
	at         time.Duration
	nullStatus bool
	large      int // bytes of padding of a large payload, else 0
}

// loadStats counts what the writers did.
type loadStats struct {
	txSingle, txMulti  atomic.Int64
	txBulk             atomic.Int64 // bulkMin..bulkMax rows
	failedAttempts     atomic.Int64 // an INSERT or COMMIT that returned an error
	foundCommitted     atomic.Int64 // … whose transaction had committed after all
	foundNotCommitted  atomic.Int64 // … whose transaction had not (written again)
	uniqueAfterFailure atomic.Int64 // a retry met the earlier attempt's committed rows
	nullAt, scheduled  atomic.Int64 // rows with a NULL available_at; scheduled ahead
	nullStatus, large  atomic.Int64 // rows with a NULL status; with a large payload
}

// load runs the writers.
type load struct {
	pool       *pgxpool.Pool
	writers    int
	aggregates int
	rate       float64
	seed       uint64
	since      func() time.Duration
	// largeMin and largeMax bound a large payload's padding, in bytes:
	// under what nats-server takes in one message (setUp sizes them).
	largeMin, largeMax int

	stats     loadStats
	mu        sync.Mutex
	committed []committedEvent
	// rewritten are the keys of failed attempts found not committed and
	// written again: after a failover, a commit the old primary made (and a
	// relay may have delivered) that its standby never received.
	rewritten map[string]bool
}

// run writes until stop is closed, then returns once every writer has
// settled its last transaction. It fails only when ctx ends or a
// transaction turns out partially committed.
func (l *load) run(ctx context.Context, stop <-chan struct{}) error {
	errs := make(chan error, l.writers)
	var wg sync.WaitGroup
	for w := range l.writers {
		wg.Go(func() { errs <- l.writer(ctx, stop, w) })
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		if err != nil {
			all = append(all, err)
		}
	}
	return errors.Join(all...)
}

// writer w owns the aggregates whose number is w modulo the writer count.
func (l *load) writer(ctx context.Context, stop <-chan struct{}, w int) error {
	rng := rand.New(rand.NewPCG(l.seed, uint64(w)+1))
	var aggs []string
	for a := w; a < l.aggregates; a += l.writers {
		aggs = append(aggs, fmt.Sprintf("a%03d", a))
	}
	next := map[string]int64{}
	pad := strings.Repeat("x", padding)
	perSecond := l.rate / float64(l.writers)
	due := time.Now()
	for n := 0; ; {
		select {
		case <-stop:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		k := 1
		switch r := rng.Float64(); {
		case r < bulkShare:
			k = bulkMin + rng.IntN(bulkMax-bulkMin+1)
		case r < bulkShare+multiRowShare:
			k = 2 + rng.IntN(maxRowsPerTx-1)
		}
		rows := make([]outboxRow, k)
		for i := range rows {
			agg := aggs[rng.IntN(len(aggs))]
			next[agg]++
			seq := next[agg]
			eventType := "order.updated"
			if seq == 1 {
				eventType = "order.created"
			}
			rows[i] = outboxRow{key: fmt.Sprintf("w%d-%07d", w, n), agg: agg, eventType: eventType, seq: seq,
				payload: fmt.Sprintf(`{"seq": %d, "writer": %d, "pad": %q}`, seq, w, pad)}
			n++
		}
		if k == 1 {
			switch r := rng.Float64(); {
			case r < nullAtShare:
				rows[0].availableAt = -1
			case r < nullAtShare+scheduledShare:
				rows[0].availableAt = time.Duration(float64(scheduledIn) * (0.5 + rng.Float64()))
			case r < nullAtShare+scheduledShare+largeShare && l.largeMax > 0:
				r := &rows[0]
				r.large = l.largeMin + rng.IntN(l.largeMax-l.largeMin+1)
				r.payload = fmt.Sprintf(`{"seq": %d, "writer": %d, "pad": %q}`, r.seq, w, randomText(rng, r.large))
			}
		}
		for i := range rows {
			if rows[i].availableAt == 0 && rng.Float64() < nullStatusShare {
				rows[i].nullStatus = true
			}
		}
		if err := l.commit(ctx, rows); err != nil {
			return fmt.Errorf("writer %d: %w", w, err)
		}
		switch {
		case rows[0].availableAt < 0:
			l.stats.nullAt.Add(1)
		case rows[0].availableAt > 0:
			l.stats.scheduled.Add(1)
		}
		switch {
		case k == 1:
			l.stats.txSingle.Add(1)
		case k < bulkMin:
			l.stats.txMulti.Add(1)
		default:
			l.stats.txBulk.Add(1)
		}
		due = due.Add(time.Duration(float64(k) / perSecond * float64(time.Second)))
		wait := time.Until(due)
		if wait < -time.Second { // behind after an outage: do not burst
			due, wait = time.Now(), 0
		}
		if wait > 0 {
			select {
			case <-stop:
			case <-ctx.Done():
			case <-time.After(wait):
			}
		}
	}
}

// commit writes rows in one transaction and does not return before it has
// committed: a failed attempt's outcome is resolved by looking for its rows
// (all there: it committed; none: write again), so the set of committed
// events is exact across a PostgreSQL restart.
func (l *load) commit(ctx context.Context, rows []outboxRow) error {
	keys := make([]string, len(rows))
	for i, r := range rows {
		keys[i] = r.key
	}
	for attempt := 0; ; attempt++ {
		err := l.insert(ctx, rows)
		if err == nil {
			l.record(rows)
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		var pgErr *pgconn.PgError
		if attempt > 0 && errors.As(err, &pgErr) && pgErr.Code == "23505" {
			// An earlier attempt committed after its check found nothing
			// (its backend was still finishing): the rows are there.
			l.stats.uniqueAfterFailure.Add(1)
			return l.resolve(ctx, rows, keys)
		}
		l.stats.failedAttempts.Add(1)
		found, err := l.resolveCount(ctx, keys)
		if err != nil {
			return err
		}
		switch found {
		case len(keys):
			l.stats.foundCommitted.Add(1)
			l.record(rows)
			return nil
		case 0:
			l.stats.foundNotCommitted.Add(1)
			l.mu.Lock()
			if l.rewritten == nil {
				l.rewritten = map[string]bool{}
			}
			for _, k := range keys {
				l.rewritten[k] = true
			}
			l.mu.Unlock()
		default:
			return fmt.Errorf("a transaction of %d rows is partially visible (%d rows): keys %v", len(keys), found, keys)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(min(time.Duration(attempt+1)*100*time.Millisecond, 2*time.Second)):
		}
	}
}

// resolve records rows after a retry found them committed.
func (l *load) resolve(ctx context.Context, rows []outboxRow, keys []string) error {
	found, err := l.resolveCount(ctx, keys)
	if err != nil {
		return err
	}
	if found != len(keys) {
		return fmt.Errorf("a retry met a committed key but only %d of %d rows are visible: keys %v", found, len(keys), keys)
	}
	l.record(rows)
	return nil
}

// resolveCount counts which of keys are in the table, retrying while the
// database is unreachable.
func (l *load) resolveCount(ctx context.Context, keys []string) (int, error) {
	for attempt := 0; ; attempt++ {
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var n int
		// Retention may have pruned a committed row by now.
		err := l.pool.QueryRow(qctx, `SELECT count(*) FROM `+allOutbox+` AS o WHERE event_key = ANY($1)`, keys).Scan(&n)
		cancel()
		if err == nil {
			return n, nil
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(min(time.Duration(attempt+1)*100*time.Millisecond, 2*time.Second)):
		}
	}
}

// insert writes rows: one autocommit INSERT for a single row, else one
// transaction with the INSERTs sent as a batch (ids in order).
// A transaction holding a legacy row turns the bound on key lengths off
// around its INSERTs, inside it, so no other session writes without it.
func (l *load) insert(ctx context.Context, rows []outboxRow) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	legacy := slices.ContainsFunc(rows, func(r outboxRow) bool { return r.legacy })
	if len(rows) == 1 && !legacy {
		sql, args := rows[0].statement()
		_, err := l.pool.Exec(ctx, sql, args...)
		return err
	}
	return pgx.BeginFunc(ctx, l.pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		if legacy {
			// ALTER TABLE waits for the writers and settlements in flight
			// on the table, and they for it: keep that short.
			b.Queue(`SET LOCAL lock_timeout = '5s'`)
			b.Queue(`ALTER TABLE integration_outbox DISABLE TRIGGER ` + keyBoundTrigger)
		}
		for _, r := range rows {
			sql, args := r.statement()
			b.Queue(sql, args...)
		}
		if legacy {
			b.Queue(`ALTER TABLE integration_outbox ENABLE TRIGGER ` + keyBoundTrigger)
		}
		return tx.SendBatch(ctx, b).Close()
	})
}

// statement is the INSERT that writes r, with its arguments.
func (r outboxRow) statement() (string, []any) {
	switch {
	case r.availableAt != 0:
		return insertAtSQL, []any{r.eventType, r.agg, r.key, r.payload, r.availableAt.Seconds()}
	case r.nullStatus:
		return insertNullStatusSQL, []any{r.eventType, r.agg, r.key, r.payload}
	}
	return insertSQL, []any{r.eventType, r.agg, r.key, r.payload}
}

func (l *load) record(rows []outboxRow) {
	at := l.since()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range rows {
		l.committed = append(l.committed, committedEvent{key: r.key, agg: r.agg, seq: r.seq, at: at, nullStatus: r.nullStatus, large: r.large})
		if r.nullStatus {
			l.stats.nullStatus.Add(1)
		}
		if r.large > 0 {
			l.stats.large.Add(1)
		}
	}
}

// randomText is n random letters and digits: a payload or key PostgreSQL
// cannot compress.
func randomText(rng *rand.Rand, n int) string {
	const alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	for i := range b {
		b[i] = alnum[rng.IntN(len(alnum))]
	}
	return string(b)
}

// events returns a copy of the committed events.
func (l *load) events() []committedEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]committedEvent(nil), l.committed...)
}

// rewrittenKeys returns a copy of the keys written again after an attempt
// found not committed.
func (l *load) rewrittenKeys() map[string]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := make(map[string]bool, len(l.rewritten))
	for k := range l.rewritten {
		m[k] = true
	}
	return m
}

// count is the number of committed events.
func (l *load) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.committed)
}

// otherTable is a table outside the publication that busyOtherTable fills,
// so that most of the run's WAL is not the outbox's: the slot must keep
// releasing it (docs/guarantees.md, "a slow or dead sink") for the retained WAL to stay bounded.
const otherTable = "chaos_other_table"

// busyOtherTable inserts otherRowsPerTick rows of ~900 bytes every 500 ms
// (about 2 MB/s of WAL) until stop is closed, truncating the table now and
// then; errors (PostgreSQL down) skip a tick.
func busyOtherTable(ctx context.Context, pool *pgxpool.Pool, stop <-chan struct{}) {
	const otherRowsPerTick = 1000
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for i := 1; ; i++ {
		select {
		case <-stop:
			return
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, _ = pool.Exec(qctx, `INSERT INTO `+otherTable+` (pad) SELECT repeat('y', 900) FROM generate_series(1, $1::int)`, otherRowsPerTick)
		if i%40 == 0 {
			_, _ = pool.Exec(qctx, `TRUNCATE `+otherTable)
		}
		cancel()
	}
}
