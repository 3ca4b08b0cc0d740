package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// The workload's events: type order.updated of aggregate ("order", i mod
// -aggregates), key "<prefix><i>", and a payload of -payload bytes of jsonb
// text: {"pad": "xxx…", "seq": i}.
const (
	eventType     = "order.updated"
	aggregateType = "order"
	// payloadFrame is the length of {"pad": "", "seq": } as jsonb prints it.
	payloadFrame = 20
)

// payload returns event i's payload, as jsonb renders it.
func payload(i, size int) string {
	seq := strconv.Itoa(i)
	pad := max(size-payloadFrame-len(seq), 0)
	return `{"pad": "` + strings.Repeat("x", pad) + `", "seq": ` + seq + `}`
}

// bulkInsertSQL inserts the events from $1 to $2 with server-side
// generation, so the client is not the bottleneck of large inserts.
const bulkInsertSQL = `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
SELECT '` + eventType + `', '` + aggregateType + `', (g % $3)::text, $4 || g,
       jsonb_build_object('seq', g, 'pad', repeat('x', greatest($5 - ` + "20" + ` - length(g::text), 0)))
  FROM generate_series($1::bigint, $2::bigint) AS g`

// bulkInsert inserts events [0, n) with prefix, perStmt rows per statement
// (each statement its own transaction), from parallel connections.
func (e *env) bulkInsert(ctx context.Context, url, prefix string, n, perStmt, parallel int) error {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.MaxConns = int32(parallel)
	cfg.ConnConfig.RuntimeParams["application_name"] = benchAppName + " load"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, parallel)
	for range parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				from := int(next.Add(int64(perStmt))) - perStmt
				if from >= n || ctx.Err() != nil {
					return
				}
				to := min(from+perStmt, n) - 1
				if _, err := pool.Exec(ctx, bulkInsertSQL, from, to, e.o.aggregates, prefix, e.o.payloadSize); err != nil {
					errs <- fmt.Errorf("insert rows %d-%d: %w", from, to, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// insertSQL is one event, one transaction: the steady load.
const insertSQL = `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
VALUES ('` + eventType + `', '` + aggregateType + `', $1, $2, $3::text::jsonb)`

// loadResult summarises a paced load.
type loadResult struct {
	sent      int
	elapsed   time.Duration
	maxBehind time.Duration // the longest an insert started after its scheduled time
	commitMS  []float64     // sorted durations of the insert transactions, ms
}

// rate is the achieved insert rate.
func (l loadResult) rate() float64 { return float64(l.sent) / l.elapsed.Seconds() }

// runLoad inserts rate events per second for d, one event per transaction,
// from e.o.writers connections, on an open-loop schedule (event i is due at
// start + i/rate). With t set, events are t's and their commit times (taken
// right after the commit returns) are recorded; otherwise keys use prefix.
func (e *env) runLoad(ctx context.Context, pool *pgxpool.Pool, prefix string, t *tracker, rate float64, d time.Duration) (loadResult, error) {
	total := int(rate * d.Seconds())
	if t != nil {
		total = min(total, len(t.commit))
		prefix = t.prefix
	}
	start := time.Now()
	var next atomic.Int64
	var behind atomic.Int64
	var wg sync.WaitGroup
	var mu sync.Mutex
	var commitMS []float64
	errs := make(chan error, e.o.writers)
	for range e.o.writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []float64
			defer func() {
				mu.Lock()
				commitMS = append(commitMS, mine...)
				mu.Unlock()
			}()
			for {
				i := int(next.Add(1)) - 1
				if i >= total || ctx.Err() != nil {
					return
				}
				due := start.Add(time.Duration(float64(i) / rate * float64(time.Second)))
				if wait := time.Until(due); wait > 0 {
					time.Sleep(wait)
				} else {
					for b := behind.Load(); int64(-wait) > b && !behind.CompareAndSwap(b, int64(-wait)); b = behind.Load() {
					}
				}
				key := prefix + strconv.Itoa(i)
				began := time.Now()
				if _, err := pool.Exec(ctx, insertSQL, strconv.Itoa(i%e.o.aggregates), key, payload(i, e.o.payloadSize)); err != nil {
					errs <- fmt.Errorf("insert %s: %w", key, err)
					return
				}
				if t != nil {
					t.commit[i].Store(e.now())
				}
				mine = append(mine, float64(time.Since(began))/float64(time.Millisecond))
			}
		}()
	}
	wg.Wait()
	close(errs)
	slices.Sort(commitMS)
	res := loadResult{sent: min(int(next.Load()), total), elapsed: time.Since(start), maxBehind: time.Duration(behind.Load()), commitMS: commitMS}
	return res, <-errs
}

// newLoadPool opens the pool the load uses, with every connection open
// before the load starts.
func (e *env) newLoadPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(e.o.writers)
	cfg.MinConns = int32(e.o.writers)
	cfg.ConnConfig.RuntimeParams["application_name"] = benchAppName + " load"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	// Open every connection now: hold one each until all are open.
	var wg sync.WaitGroup
	var held sync.WaitGroup
	held.Add(e.o.writers)
	for range e.o.writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := pool.Acquire(ctx)
			held.Done()
			if err != nil {
				return
			}
			held.Wait()
			c.Release()
		}()
	}
	wg.Wait()
	return pool, nil
}

// The seed poller: what an n8n workflow on a schedule does today.
const (
	pollerClaimSQL = `UPDATE integration_outbox
   SET status = 'processing', locked_at = now(), locked_by = $1, attempts = attempts + 1
 WHERE id IN (SELECT id FROM integration_outbox
               WHERE status = 'pending' AND available_at <= now()
               ORDER BY created_at
               LIMIT 500
               FOR UPDATE SKIP LOCKED)
RETURNING id, event_key, event_type, aggregate_type, aggregate_id, payload::text, created_at`
	pollerDoneSQL = `UPDATE integration_outbox SET status = 'done', processed_at = now()
 WHERE id = ANY($1) AND locked_by = $2`
	pollerBatch = 500
)

// poller is the seed poller: every interval it claims pending rows 500 at a
// time (until a claim returns fewer), POSTs each to the webhook one after the
// other, and marks the claimed rows done. No NOTIFY.
type poller struct {
	pool     *pgxpool.Pool
	url      string
	interval time.Duration
	client   *http.Client
	posted   atomic.Int64
}

// run polls until ctx ends.
func (p *poller) run(ctx context.Context) error {
	t := time.NewTicker(p.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		for {
			n, err := p.cycle(ctx)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			if n < pollerBatch {
				break
			}
		}
	}
}

// cycle claims one batch, delivers it and marks it done.
func (p *poller) cycle(ctx context.Context) (int, error) {
	rows, err := p.pool.Query(ctx, pollerClaimSQL, "seed-poller")
	if err != nil {
		return 0, err
	}
	type row struct {
		ID            int64           `json:"id"`
		EventKey      string          `json:"event_key"`
		EventType     *string         `json:"event_type"`
		AggregateType *string         `json:"aggregate_type"`
		AggregateID   *string         `json:"aggregate_id"`
		Payload       json.RawMessage `json:"payload"`
		CreatedAt     string          `json:"created_at"`
	}
	var batch []row
	for rows.Next() {
		var r row
		var payload *string
		var created time.Time
		if err := rows.Scan(&r.ID, &r.EventKey, &r.EventType, &r.AggregateType, &r.AggregateID, &payload, &created); err != nil {
			rows.Close()
			return 0, err
		}
		if payload != nil {
			r.Payload = json.RawMessage(*payload)
		} else {
			r.Payload = json.RawMessage("null")
		}
		r.CreatedAt = created.UTC().Format("2006-01-02T15:04:05.000000Z07:00")
		batch = append(batch, r)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	ids := make([]int64, 0, len(batch))
	for _, r := range batch {
		body, err := json.Marshal(r)
		if err != nil {
			return 0, err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url, bytes.NewReader(body))
		if err != nil {
			return 0, err
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := p.client.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode >= 300 {
			return 0, fmt.Errorf("poller: POST %s: %s", r.EventKey, resp.Status)
		}
		p.posted.Add(1)
		ids = append(ids, r.ID)
	}
	if len(ids) > 0 {
		if _, err := p.pool.Exec(ctx, pollerDoneSQL, ids, "seed-poller"); err != nil {
			return 0, err
		}
	}
	return len(batch), nil
}
