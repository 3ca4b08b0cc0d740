package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// waitSlot waits until the relay has created its slot and is streaming.
func (s *setup) waitSlot(t *testing.T) {
	t.Helper()
	eventually(t, 30*time.Second, "the relay to stream from its slot", func() bool {
		return s.scalar(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active") == 1
	})
}

func (s *setup) waitAllDelivered(t *testing.T, timeout time.Duration, keys map[string]bool) {
	t.Helper()
	eventually(t, timeout, fmt.Sprintf("%d events at both sinks", len(keys)), func() bool {
		hook := byKey(s.hook.deliveries())
		for k := range keys {
			if len(hook[k]) == 0 {
				return false
			}
		}
		msgs := byKey(streamMessages(t, s.nats.URL()))
		for k := range keys {
			if len(msgs[k]) == 0 {
				return false
			}
		}
		return true
	})
}

// TestRelay_EndToEnd: 5,000 events from 4 writers, each owning 25
// aggregates, reach both sinks once, in per-aggregate order; the ledger has
// one delivered row per (event, sink); every row ends done.
func TestRelay_EndToEnd(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.startInProcess(t, s.configFile(t, ""))
	s.waitSlot(t)

	s.publishWriters(t, 4, 1250, 25, "e2e")
	keys := s.keys(t, "true")
	if len(keys) != 5000 {
		t.Fatalf("published %d events", len(keys))
	}
	s.waitAllDelivered(t, 90*time.Second, keys)

	hook, msgs := s.hook.deliveries(), streamMessages(t, s.nats.URL())
	if len(hook) != 5000 || len(msgs) != 5000 {
		t.Fatalf("webhook got %d requests, NATS stored %d messages; want 5000 each (no repeats without faults)", len(hook), len(msgs))
	}
	checkOrder(t, "webhook", hook)
	checkOrder(t, "nats", msgs)
	for _, d := range append(hook, msgs...) {
		if d.IdemKey != d.EventKey {
			t.Fatalf("idempotency key %q for event %q", d.IdemKey, d.EventKey)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.doneRows(t, "true") != 5000 {
		if time.Now().After(deadline) {
			rows, _ := s.pool.Query(context.Background(), `SELECT id, status, handoff_at IS NOT NULL, coalesce(last_error, ''),
				(SELECT string_agg(action || ':' || state, ',') FROM integration_idempotency l WHERE l.event_key = o.event_key)
				FROM integration_outbox o WHERE NOT `+doneSQL+` ORDER BY id LIMIT 10`)
			for rows.Next() {
				var id int64
				var status, lastErr string
				var handoff bool
				var ledgerState *string
				rows.Scan(&id, &status, &handoff, &lastErr, &ledgerState)
				t.Logf("row %d: %s handoff=%v ledger=%v last_error=%q", id, status, handoff, ledgerState, lastErr)
			}
			t.Fatalf("%d rows not done", 5000-s.doneRows(t, "true"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The record of delivery is one delivered ledger row per (event,
	// sink), the stream's included (docs/operations.md, "what the relay
	// writes back"), and every row ends done.
	if n := s.scalar(t, `SELECT count(*) FROM integration_idempotency WHERE state = 'delivered'`); n != 10000 {
		t.Fatalf("the ledger has %d delivered rows, want 10000: one per event and sink", n)
	}
	if n := s.scalar(t, `SELECT count(*) FROM (SELECT event_key FROM integration_idempotency GROUP BY event_key HAVING count(*) <> 2) AS x`); n != 0 {
		t.Fatalf("%d events without exactly one ledger row per sink", n)
	}
	if n := s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status <> 'done'`); n != 0 {
		t.Fatalf("%d rows not done", n)
	}
}

// TestRelay_KillNine: kill -9 mid-stream, restart; nothing is missing, and
// a repeat carries the same idempotency key and body as the first delivery.
func TestRelay_KillNine(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfgPath := s.configFile(t, "")
	var logs bytes.Buffer
	var logMu sync.Mutex
	logw := writerFunc(func(p []byte) (int, error) { logMu.Lock(); defer logMu.Unlock(); return logs.Write(p) })

	relay1 := s.startProcess(t, cfgPath, logw)
	s.waitSlot(t)

	var wg sync.WaitGroup
	wg.Go(func() { s.publishWriters(t, 3, 1000, 20, "kill") })
	eventually(t, 60*time.Second, "some deliveries before the kill", func() bool { return len(s.hook.deliveries()) >= 600 })
	relay1.Process.Signal(syscall.SIGKILL)
	relay1.Wait()
	before := len(s.hook.deliveries())
	t.Logf("killed the relay after %d webhook deliveries", before)

	s.startProcess(t, cfgPath, logw)
	wg.Wait()
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 120*time.Second, keys)

	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		repeats := 0
		for key, copies := range byKey(ds) {
			for _, c := range copies[1:] {
				repeats++
				if c.IdemKey != copies[0].IdemKey || c.Body != copies[0].Body {
					t.Fatalf("%s: repeat of %s differs: id %q vs %q, body %s vs %s", sink, key, c.IdemKey, copies[0].IdemKey, c.Body, copies[0].Body)
				}
			}
		}
		// Repeats come only from deliveries in flight at the kill (sent,
		// not yet in the ledger): the webhook's 8 requests plus one settle
		// batch, not everything since the last acknowledgement.
		t.Logf("%s: %d deliveries, %d repeats", sink, len(ds), repeats)
		if repeats > 300 {
			t.Fatalf("%s: %d repeats after one kill: more than what was in flight", sink, repeats)
		}
		checkOrder(t, sink, ds)
	}
	s.waitDone(t, "true", int64(len(keys)))
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// TestRelay_LargeTransactionAck: one 10,000-row transaction to a slow
// sink; the slot's confirmed_flush_lsn never passes the transaction before
// its last row is delivered, and passes it soon after.
func TestRelay_LargeTransactionAck(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.hook.setReply(func(delivery) int { time.Sleep(500 * time.Microsecond); return 204 })
	s.startInProcess(t, s.configFile(t, ""))
	s.waitSlot(t)

	ctx := context.Background()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'bulk.row', 'bulk', (g % 500)::text, 'bulk-' || g, jsonb_build_object('g', g) FROM generate_series(1, 10000) g`); err != nil {
		t.Fatal(err)
	}
	var beforeCommit relay.LSN
	if err := tx.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&beforeCommit); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	samples, violations := 0, 0
	for len(s.hook.deliveries()) < 10000 {
		confirmed, _ := s.slotLSN(t)
		delivered := len(s.hook.deliveries())
		samples++
		if confirmed > beforeCommit && delivered < 10000 {
			violations++
			t.Errorf("confirmed_flush_lsn %v passed the transaction (commit after %v) with %d of 10000 delivered", confirmed, beforeCommit, delivered)
		}
		if samples > 3000 {
			t.Fatal("delivery did not finish")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("%d samples while delivering, %d violations", samples, violations)
	eventually(t, 10*time.Second, "the acknowledgement to pass the transaction", func() bool {
		confirmed, _ := s.slotLSN(t)
		return confirmed > beforeCommit
	})
}

// TestRelay_FirstStartDeliversExistingRows: 1,000 rows pending before the
// slot exists are read from the slot's exported snapshot and delivered
// beside the stream (docs/architecture.md, "Slot creation"); rows written
// meanwhile by writers that keep going, on the same aggregates, follow
// them (streamed, or through the claim path behind them); every row
// reaches each sink exactly once, each aggregate in order.
func TestRelay_FirstStartDeliversExistingRows(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.publishWriters(t, 2, 500, 50, "old")
	var wg sync.WaitGroup
	wg.Go(func() { s.publishWriters(t, 2, 300, 20, "new") })
	s.startInProcess(t, s.configFile(t, ""))
	wg.Wait()

	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 60*time.Second, keys)
	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		for key, copies := range byKey(ds) {
			if len(copies) != 1 {
				t.Fatalf("%s: %s delivered %d times", sink, key, len(copies))
			}
		}
		checkOrder(t, sink, ds)
	}
	// An aggregate whose new event reached the stream before its rows were
	// queued follows that event to the claim path (docs/architecture.md,
	// "Slot creation"): the rest of its rows go there too, in order.
	t.Logf("%d of the 2,000 deliveries of pre-existing rows by the claim path", s.scalar(t, `SELECT count(*) FROM integration_idempotency l
		JOIN integration_outbox o USING (event_key) WHERE o.event_key LIKE 'old-%' AND l.owner IS NOT NULL`))
	if n := s.scalar(t, `SELECT count(*) FROM integration_idempotency l JOIN integration_outbox o USING (event_key) WHERE o.event_key LIKE 'old-%'`); n != 2000 {
		t.Fatalf("%d delivered ledger rows for the 1000 pre-existing rows, want 2000 (one per sink)", n)
	}
	eventually(t, 10*time.Second, "every row done", func() bool {
		return s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status <> 'done'") == 0
	})
}

// TestRelay_ReceiverOutage: the webhook answers 503 for 10 s. The slot's
// acknowledgement keeps advancing; the affected rows are diverted
// (pending, future available_at, last_error) and later events of their
// aggregates follow them instead of overtaking; NATS is unaffected.
func TestRelay_ReceiverOutage(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	var down atomic.Bool
	down.Store(true)
	s.hook.setReply(func(delivery) int {
		if down.Load() {
			return 503
		}
		return 204
	})
	s.startInProcess(t, s.configFile(t, ""))
	s.waitSlot(t)
	outageEnds := time.Now().Add(10 * time.Second)

	s.publishWriters(t, 2, 50, 5, "outage")
	_, afterPublish := s.slotLSN(t)
	eventually(t, 9*time.Second, "the acknowledgement to pass the events despite the outage", func() bool {
		confirmed, _ := s.slotLSN(t)
		return confirmed >= afterPublish
	})
	if time.Now().After(outageEnds) {
		t.Fatal("the acknowledgement only advanced after the outage")
	}
	if n := s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE event_key LIKE 'outage-%' AND status = 'pending'
		AND handoff_at IS NOT NULL AND available_at > now() AND last_error LIKE '%503%'`); n == 0 {
		t.Fatal("no row was diverted with a future available_at and the 503 in last_error")
	}
	if n := s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE event_key LIKE 'outage-%' AND handoff_at IS NOT NULL`); n != 100 {
		t.Fatalf("%d of 100 rows diverted; every aggregate had a failed event, so all should follow it", n)
	}
	eventually(t, 20*time.Second, "NATS to get every event", func() bool { return len(streamMessages(t, s.nats.URL())) == 100 })

	time.Sleep(time.Until(outageEnds))
	down.Store(false)
	// A later event of a diverted aggregate still waits behind its diverted
	// predecessors; a fresh aggregate streams.
	s.publishWriters(t, 1, 1, 1, "later") // aggregate w0-0: diverted
	if _, err := s.pool.Exec(context.Background(), `SELECT outbox_publish('order.placed', 'order', 'fresh', 'fresh-1', '{}')`); err != nil {
		t.Fatal(err)
	}
	eventually(t, 15*time.Second, "the fresh aggregate's event at the webhook", func() bool {
		return len(byKey(s.hook.deliveries())["fresh-1"]) == 1
	})
	if len(byKey(s.hook.deliveries())["later-w0-0"]) != 0 {
		t.Fatal("a later event overtook its aggregate's diverted events")
	}
	// Its diversion is written once every sink has an outcome (NATS too).
	eventually(t, 10*time.Second, "the later event of a diverted aggregate diverted", func() bool {
		return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE event_key = 'later-w0-0' AND handoff_at IS NOT NULL`) == 1
	})
}

// TestRelay_IdleOutboxKeepsWALBounded: while the outbox is idle and another
// table takes 50 MB of inserts, the slot keeps up; then, idle for a minute,
// the relay rewrites its checkpoint at most once.
func TestRelay_IdleOutboxKeepsWALBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("takes over a minute: skipped with -short")
	}
	s := newSetup(t, pgtest.NewDatabase(t))
	ctx := context.Background()
	if _, err := s.pool.Exec(ctx, "CREATE TABLE other_busy_table (id bigserial, pad text)"); err != nil {
		t.Fatal(err)
	}
	s.startInProcess(t, s.configFile(t, ""))
	s.waitSlot(t)
	s.publishWriters(t, 1, 5, 5, "first") // a checkpoint exists
	s.waitAllDelivered(t, 20*time.Second, s.keys(t, "true"))

	_, start := s.slotLSN(t)
	for range 50 {
		if _, err := s.pool.Exec(ctx, "INSERT INTO other_busy_table (pad) SELECT repeat('y', 900) FROM generate_series(1, 1000)"); err != nil {
			t.Fatal(err)
		}
	}
	_, end := s.slotLSN(t)
	t.Logf("other table wrote %d MB of WAL", (end-start)>>20)
	eventually(t, 10*time.Second, "retained WAL under 16 MB", func() bool {
		confirmed, current := s.slotLSN(t)
		return current-confirmed < 16<<20
	})

	var before time.Time
	s.pool.QueryRow(ctx, "SELECT updated_at FROM relay_checkpoint WHERE slot_name = 'outbox_relay'").Scan(&before)
	writes := 0
	last := before
	for range 65 {
		time.Sleep(time.Second)
		var at time.Time
		s.pool.QueryRow(ctx, "SELECT updated_at FROM relay_checkpoint WHERE slot_name = 'outbox_relay'").Scan(&at)
		if !at.Equal(last) {
			writes++
			last = at
		}
	}
	if writes > 1 {
		t.Fatalf("idle for a minute, the checkpoint was rewritten %d times, want at most once", writes)
	}
	t.Logf("idle minute: %d checkpoint writes", writes)
}

var _ = os.Getenv

// TestRelay_KillNineLeavesNoDeliveredRowPending: the stream's settlement
// writes a delivered event's status done in the transaction that writes its
// delivered ledger rows (docs/architecture.md, "One event's path"). While
// events flow, no row the slot has been acknowledged past is still pending;
// and a relay killed with SIGKILL mid-stream leaves no row pending whose
// every sink has its delivered ledger row — the rows a crash left behind for
// a repair pass when the status was marked after the settlement.
func TestRelay_KillNineLeavesNoDeliveredRowPending(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfgPath := s.configFile(t, "")
	var logs syncBuffer
	relay1 := s.startProcess(t, cfgPath, &logs)
	s.waitSlot(t)
	ctx := context.Background()

	// Writers publish one event per transaction and note, after each
	// commit, a WAL position at or past it.
	type published struct {
		key   string
		after relay.LSN
	}
	var (
		mu   sync.Mutex
		pubs []published
		wg   sync.WaitGroup
	)
	stop := make(chan struct{})
	for w := range 3 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("k9-w%d-%d", w, i)
				var res string
				if err := s.pool.QueryRow(ctx, `SELECT outbox_publish('order.placed', 'order', $1, $2, jsonb_build_object('i', $3::int))`,
					fmt.Sprintf("w%d-%d", w, i%10), key, i).Scan(&res); err != nil {
					t.Errorf("publish %s: %v", key, err)
					return
				}
				var after relay.LSN
				if err := s.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&after); err != nil {
					t.Errorf("WAL position: %v", err)
					return
				}
				mu.Lock()
				pubs = append(pubs, published{key, after})
				mu.Unlock()
				time.Sleep(2 * time.Millisecond)
			}
		})
	}
	stopWriters := sync.OnceFunc(func() { close(stop); wg.Wait() })
	t.Cleanup(stopWriters)

	// The slot's confirmed position is read first, the statuses after: a
	// row found pending then was pending when the slot had passed it.
	checked := 0
	for deadline := time.Now().Add(4 * time.Second); time.Now().Before(deadline) || checked < 200; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline.Add(30 * time.Second)) {
			t.Fatalf("the slot was acknowledged past only %d events in 34 s", checked)
		}
		confirmed, _ := s.slotLSN(t)
		var passed []string
		mu.Lock()
		for _, p := range pubs {
			if p.after <= confirmed {
				passed = append(passed, p.key)
			}
		}
		mu.Unlock()
		rows, err := s.pool.Query(ctx, `SELECT event_key, coalesce(status, 'NULL') FROM integration_outbox WHERE event_key = ANY($1) AND status IS DISTINCT FROM 'done'`, passed)
		if err != nil {
			t.Fatal(err)
		}
		var key, status string
		if _, err := pgx.ForEachRow(rows, []any{&key, &status}, func() error {
			t.Errorf("event %s is %s, and the slot is acknowledged past its commit (at %v)", key, status, confirmed)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		checked = len(passed)
		if t.Failed() {
			t.FailNow()
		}
	}
	t.Logf("%d events the slot was acknowledged past, each done by then", checked)

	relay1.Process.Signal(syscall.SIGKILL)
	relay1.Wait()
	stopWriters()
	deliveredPending := `SELECT count(*) FROM integration_outbox AS o
 WHERE (o.status = 'pending' OR o.status IS NULL)
   AND (SELECT count(*) FROM integration_idempotency AS l WHERE l.event_key = o.event_key AND l.state = 'delivered') = 2`
	if n := s.scalar(t, deliveredPending); n != 0 {
		t.Fatalf("after the kill, %d rows are pending although both sinks have their delivered ledger row", n)
	}
	t.Logf("killed with %d events published, %d done", len(pubs), s.doneRows(t, "true"))

	s.startProcess(t, cfgPath, &logs)
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 120*time.Second, keys)
	s.waitDone(t, "true", int64(len(keys)))
}
