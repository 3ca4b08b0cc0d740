package main

import (
	"context"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/relay"
)

// event is one outbox event a scenario publishes.
type event struct {
	Key  string
	Type string
	// Aggregate is its aggregate_id ("" for its own aggregate, its key);
	// the aggregate_type is e2e.
	Aggregate string
	Payload   string
	Published time.Time
}

// publish inserts events with outbox_publish, chunk by chunk, each chunk in
// one transaction (in key order, as the README recommends). Every call must
// answer 'inserted': the keys are new.
func publish(ctx context.Context, pool *pgxpool.Pool, events []event) error {
	const chunk = 50
	for start := 0; start < len(events); start += chunk {
		part := events[start:min(start+chunk, len(events))]
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			batch := &pgx.Batch{}
			for _, ev := range part {
				agg := ev.Aggregate
				if agg == "" {
					agg = ev.Key
				}
				batch.Queue(`SELECT outbox_publish($1, 'e2e', $2, $3, $4::jsonb)`, ev.Type, agg, ev.Key, ev.Payload)
			}
			res := tx.SendBatch(ctx, batch)
			defer res.Close()
			for _, ev := range part {
				var result string
				if err := res.QueryRow().Scan(&result); err != nil {
					return fmt.Errorf("outbox_publish %q: %w", ev.Key, err)
				}
				if result != "inserted" {
					return fmt.Errorf("outbox_publish %q = %s, want inserted", ev.Key, result)
				}
			}
			return res.Close()
		})
		if err != nil {
			return err
		}
		now := time.Now()
		for i := range part {
			part[i].Published = now
		}
	}
	return nil
}

// dbCounts are the Postgres side of a scenario: its events in the outbox,
// the workflow's claims and the business effects.
type dbCounts struct {
	Outbox     int64 // outbox rows of the scenario
	Claims     int64 // rows in n8n_processed_events
	ClaimsDone int64 // ... with done_at set
	Effects    int64 // rows in n8n_business_effects
	Applied    int64 // distinct event keys with an effect
	Twice      int64 // event keys with more than one effect
	// OutOfOrder counts effects applied after an effect of a later event
	// of their aggregate (effects in the order they were written).
	OutOfOrder int64
}

// countScenario counts the rows whose event key starts with prefix.
func countScenario(ctx context.Context, pool *pgxpool.Pool, prefix string) (dbCounts, error) {
	var c dbCounts
	err := pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM integration_outbox WHERE starts_with(event_key, $1)),
       (SELECT count(*) FROM n8n_processed_events WHERE starts_with(event_key, $1)),
       (SELECT count(*) FROM n8n_processed_events WHERE starts_with(event_key, $1) AND done_at IS NOT NULL),
       (SELECT count(*) FROM n8n_business_effects WHERE starts_with(event_key, $1)),
       (SELECT count(DISTINCT event_key) FROM n8n_business_effects WHERE starts_with(event_key, $1)),
       (SELECT count(*) FROM (SELECT 1 FROM n8n_business_effects WHERE starts_with(event_key, $1)
                              GROUP BY event_key HAVING count(*) > 1) t),
       (SELECT count(*) FROM (SELECT o.id, lag(o.id) OVER (PARTITION BY o.aggregate_type, o.aggregate_id ORDER BY b.id) AS prev
                                FROM integration_outbox o JOIN n8n_business_effects b ON b.event_key = o.event_key
                               WHERE starts_with(o.event_key, $1)) t
         WHERE t.prev > t.id)`, prefix).
		Scan(&c.Outbox, &c.Claims, &c.ClaimsDone, &c.Effects, &c.Applied, &c.Twice, &c.OutOfOrder)
	if err != nil {
		return c, fmt.Errorf("count scenario rows: %w", err)
	}
	return c, nil
}

// missingRow is an outbox row of a scenario without a business effect.
type missingRow struct {
	ID          int64
	Key         string
	Status      string
	DivertedAt  *time.Time
	AvailableAt time.Time
	Attempts    int
	LastError   *string
	Ledger      *string // the ledger's state for the sink, if any
}

// missingEffects lists the scenario's outbox rows that have no business
// effect, with where the relay left them.
func missingEffects(ctx context.Context, pool *pgxpool.Pool, prefix, sink string) ([]missingRow, error) {
	rows, err := pool.Query(ctx, `
SELECT o.id, o.event_key, o.status, o.handoff_at, o.available_at, o.attempts, o.last_error, l.state
  FROM integration_outbox o
  LEFT JOIN integration_idempotency l ON l.event_key = o.event_key AND l.action = $2
 WHERE starts_with(o.event_key, $1)
   AND NOT EXISTS (SELECT 1 FROM n8n_business_effects b WHERE b.event_key = o.event_key)
 ORDER BY o.id`, prefix, sink)
	if err != nil {
		return nil, fmt.Errorf("list events without an effect: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (missingRow, error) {
		var m missingRow
		err := r.Scan(&m.ID, &m.Key, &m.Status, &m.DivertedAt, &m.AvailableAt, &m.Attempts, &m.LastError, &m.Ledger)
		return m, err
	})
}

// explainMissing turns the rows without an effect into the failure message:
// which events the relay recorded as delivered although the workflow never
// applied them (lost), which wait for the claim path (diverted: pending
// with handoff_at), which were dead-lettered or held, and which the stream
// still owns, each group with its ids, first keys and last errors.
func explainMissing(rows []missingRow, waited time.Duration) string {
	var lost, handed, dead, held, streamed []missingRow
	for _, m := range rows {
		switch {
		case m.Ledger != nil && *m.Ledger == "delivered":
			lost = append(lost, m)
		case m.Status == "failed":
			dead = append(dead, m)
		case m.Status == "held":
			held = append(held, m)
		case m.DivertedAt != nil:
			handed = append(handed, m)
		default:
			streamed = append(streamed, m)
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d events have no business effect after waiting %s:", len(rows), waited.Round(time.Second))
	group := func(rows []missingRow, what string) {
		if len(rows) == 0 {
			return
		}
		fmt.Fprintf(&b, "\n  %d %s: %s", len(rows), what, describeRows(rows))
		for _, r := range lastErrors(rows) {
			fmt.Fprintf(&b, "\n    last_error: %s", r)
		}
	}
	group(lost, "LOST: the relay's ledger says delivered, but the workflow never applied them "+
		"(a 2xx that was not the workflow's answer? n8n answers any request with 200 \"n8n is starting up. Please wait\" while it migrates its database at startup)")
	group(handed, "PENDING WITH handoff_at (diverted to the claim path, which has not delivered them; does this relay build run the claim path?)")
	group(dead, "DEAD-LETTERED (status failed)")
	group(held, "held (outcome unknown, waiting for a person)")
	group(streamed, "owned by the stream and not delivered (pending, no handoff_at)")
	return b.String()
}

// eventRef matches the event key a relay error quotes, so that errors
// differing only in the key are counted together.
var eventRef = regexp.MustCompile(`event "(?:[^"\\]|\\.)*"`)

// lastErrors returns the distinct last errors of rows, most frequent first,
// with their counts; at most four.
func lastErrors(rows []missingRow) []string {
	counts := map[string]int{}
	for _, m := range rows {
		reason := "(none)"
		if m.LastError != nil {
			reason = eventRef.ReplaceAllString(firstLine(*m.LastError), `event "…"`)
		}
		counts[reason]++
	}
	reasons := make([]string, 0, len(counts))
	for r := range counts {
		reasons = append(reasons, r)
	}
	sort.Slice(reasons, func(i, j int) bool {
		if counts[reasons[i]] != counts[reasons[j]] {
			return counts[reasons[i]] > counts[reasons[j]]
		}
		return reasons[i] < reasons[j]
	})
	out := make([]string, 0, 4)
	for i, r := range reasons {
		if i == 4 {
			out = append(out, fmt.Sprintf("… %d other errors", len(reasons)-4))
			break
		}
		out = append(out, fmt.Sprintf("(%d) %s", counts[r], r))
	}
	return out
}

// describeRows names rows compactly: id ranges and the first keys.
func describeRows(rows []missingRow) string {
	var ids []string
	for i := 0; i < len(rows); {
		j := i
		for j+1 < len(rows) && rows[j+1].ID == rows[j].ID+1 {
			j++
		}
		if i == j {
			ids = append(ids, fmt.Sprint(rows[i].ID))
		} else {
			ids = append(ids, fmt.Sprintf("%d-%d", rows[i].ID, rows[j].ID))
		}
		i = j + 1
	}
	var keys []string
	for i, m := range rows {
		if i == 5 {
			keys = append(keys, fmt.Sprintf("… %d more", len(rows)-5))
			break
		}
		state := "no ledger row"
		if m.Ledger != nil {
			state = "ledger " + *m.Ledger
		}
		keys = append(keys, fmt.Sprintf("%q (attempts %d, %s)", m.Key, m.Attempts, state))
	}
	return "ids " + strings.Join(ids, ",") + "; keys " + strings.Join(keys, ", ")
}

// loadEvent reads one outbox row as the relay's stream decodes it, so its
// envelope is byte-identical to what the relay sent.
func loadEvent(ctx context.Context, pool *pgxpool.Pool, key string) (*relay.Event, error) {
	var ev relay.Event
	var payload *string
	err := pool.QueryRow(ctx, `SELECT id, event_key, event_type, aggregate_type, aggregate_id, payload::text, created_at
  FROM integration_outbox WHERE event_key = $1`, key).
		Scan(&ev.ID, &ev.EventKey, &ev.EventType, &ev.AggregateType, &ev.AggregateID, &payload, &ev.CreatedAt)
	if err != nil {
		return nil, fmt.Errorf("read outbox row %q: %w", key, err)
	}
	if payload != nil {
		ev.Payload = []byte(*payload)
	}
	return &ev, nil
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}
