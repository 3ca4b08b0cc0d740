package replication_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/replication"
)

func TestStreamsInsertsInCommitOrder(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{}
	start(t, e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)
	ctx := context.Background()
	mustExec(t, e.conn, "CREATE TABLE unpublished (id int)")

	// A transaction that starts first but commits last arrives last.
	late := mustConnect(t, e.url)
	lateTx, err := late.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mustExecTx(t, lateTx, `INSERT INTO integration_outbox (event_key, event_type) VALUES ('late', 'late.event')`)

	type txn struct {
		keys  []string
		after relay.LSN // pg_current_wal_lsn() after the commit
	}
	var txns []txn
	run := func(keys []string, stmts ...string) {
		t.Helper()
		err := pgx.BeginFunc(ctx, e.conn, func(tx pgx.Tx) error {
			for _, s := range stmts {
				if _, err := tx.Exec(ctx, s); err != nil {
					return fmt.Errorf("%s: %w", s, err)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		txns = append(txns, txn{keys: keys, after: e.currentLSN(t)})
	}
	run([]string{"k1", "k2", "ключ-🙂"},
		`INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id, payload)
		 VALUES ('k1', 'order.created', 'order', '42', '{"b": 2, "a": [1, 2.50, "ü"], "n": null}')`,
		`INSERT INTO unpublished VALUES (1)`,
		`INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id, payload)
		 VALUES ('k2', NULL, NULL, NULL, NULL)`,
		`INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id, payload, created_at)
		 VALUES ('ключ-🙂', 'тип.событие', 'агрегат', 'ид "quoted" \ tab	', '{"text": "日本語 \"q\" \\ \u0001"}',
		         '2026-12-02 16:17:36.123456+00')`,
	)
	// Rows that are not pending are streamed too: the engine decides.
	run([]string{"k4"},
		`INSERT INTO integration_outbox (event_key, event_type, payload, status, attempts, available_at)
		 VALUES ('k4', 'order.paid', '"just a string"', 'done', 3, '2030-01-01 00:00:00.000001+00')`,
	)
	// Updates and deletes are not published, and unpublished tables are ignored.
	run(nil,
		`UPDATE integration_outbox SET status = 'done' WHERE event_key = 'k1'`,
		`DELETE FROM integration_outbox WHERE event_key = 'k2'`,
		`INSERT INTO unpublished VALUES (2)`,
	)
	run([]string{"k5", "k6"},
		`INSERT INTO integration_outbox (event_key, event_type, payload) VALUES ('k5', 'x', '[]'), ('k6', 'x', '{}')`,
	)
	if err := lateTx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	txns = append(txns, txn{keys: []string{"late"}, after: e.currentLSN(t)})

	waitFor(t, 10*time.Second, "7 events", func() bool { return c.eventCount() >= 7 })
	time.Sleep(300 * time.Millisecond) // nothing else may arrive
	events, _, commits, _ := c.snapshot()

	var wantKeys []string
	for _, tx := range txns {
		wantKeys = append(wantKeys, tx.keys...)
	}
	var gotKeys []string
	for _, ev := range events {
		gotKeys = append(gotKeys, ev.EventKey)
	}
	if fmt.Sprint(gotKeys) != fmt.Sprint(wantKeys) {
		t.Fatalf("events arrived as %q, want commit order %q", gotKeys, wantKeys)
	}

	// Fields decode to exactly what the table holds. k2 was deleted since,
	// so its expectations are written out.
	for _, ev := range events {
		if ev.EventKey == "k2" {
			if ev.EventType != nil || ev.AggregateType != nil || ev.AggregateID != nil || ev.Payload != nil {
				t.Errorf("k2: NULL columns decoded as %v %v %v %q", ev.EventType, ev.AggregateType, ev.AggregateID, ev.Payload)
			}
			continue
		}
		var (
			id                     int64
			typ, aggType, aggID    *string
			payload                *string
			createdAt, availableAt time.Time
			attempts               int
		)
		err := e.conn.QueryRow(ctx, `SELECT id, event_type, aggregate_type, aggregate_id, payload::text, created_at, available_at, attempts
		                               FROM integration_outbox WHERE event_key = $1`, ev.EventKey).
			Scan(&id, &typ, &aggType, &aggID, &payload, &createdAt, &availableAt, &attempts)
		if err != nil {
			t.Fatalf("%s: %v", ev.EventKey, err)
		}
		if ev.ID != id || !equalPtr(ev.EventType, typ) || !equalPtr(ev.AggregateType, aggType) || !equalPtr(ev.AggregateID, aggID) {
			t.Errorf("%s: decoded id=%d type=%v aggregate=%v/%v, want %d %v %v/%v", ev.EventKey,
				ev.ID, deref(ev.EventType), deref(ev.AggregateType), deref(ev.AggregateID), id, deref(typ), deref(aggType), deref(aggID))
		}
		if (payload == nil) != (ev.Payload == nil) || payload != nil && !bytes.Equal(ev.Payload, []byte(*payload)) {
			t.Errorf("%s: payload %q, want jsonb text %q", ev.EventKey, ev.Payload, deref(payload))
		}
		if !ev.CreatedAt.Equal(createdAt) || ev.CreatedAt.Location() != time.UTC {
			t.Errorf("%s: created_at %v, want %v in UTC", ev.EventKey, ev.CreatedAt, createdAt)
		}
		if !ev.AvailableAt.Equal(availableAt) {
			t.Errorf("%s: available_at %v, want %v", ev.EventKey, ev.AvailableAt, availableAt)
		}
		if wantStatus := map[string]string{"k4": "done"}[ev.EventKey]; ev.EventKey != "k1" && ev.Status != wantStatus && !(wantStatus == "" && ev.Status == "pending") {
			t.Errorf("%s: status %q as inserted, want %q", ev.EventKey, ev.Status, wantStatus)
		}
		if ev.Attempts != attempts {
			t.Errorf("%s: attempts %d, want %d", ev.EventKey, ev.Attempts, attempts)
		}
	}
	if got := events[2]; !got.CreatedAt.Equal(time.Date(2026, 12, 2, 16, 17, 36, 123456000, time.UTC)) {
		t.Errorf("explicit created_at decoded as %v", got.CreatedAt.Format(time.RFC3339Nano))
	}

	// Commit gets the end of each transaction: after its commit record
	// (CommitLSN), and no later than the server's WAL position read after
	// the commit.
	byKey := map[string]*relay.Event{}
	for _, ev := range events {
		byKey[ev.EventKey] = ev
	}
	var wantCommits []relay.LSN
	for i, tx := range txns {
		if len(tx.keys) == 0 {
			continue
		}
		end := c.commitOf(tx.keys[0])
		wantCommits = append(wantCommits, end)
		for _, k := range tx.keys {
			ev := byKey[k]
			if c.commitOf(k) != end {
				t.Errorf("txn %d, %s: Commit(%s); want one end per transaction", i, k, c.commitOf(k))
			}
			if !(ev.CommitLSN < end && end <= tx.after) {
				t.Errorf("txn %d, %s: CommitLSN %s, Commit(%s), WAL after commit %s; want CommitLSN < end <= WAL", i, k, ev.CommitLSN, end, tx.after)
			}
		}
	}
	// Transactions without events (the update/delete one) are skipped by
	// pgoutput or committed empty; either way the ends with events come in
	// order.
	var gotCommits []relay.LSN
	for _, lsn := range commits {
		for _, w := range wantCommits {
			if lsn == w {
				gotCommits = append(gotCommits, lsn)
			}
		}
	}
	if fmt.Sprint(gotCommits) != fmt.Sprint(wantCommits) {
		t.Errorf("Commit calls %v, want %v in order", gotCommits, wantCommits)
	}
}

func TestLargeTransactionArrivesInBoundedBatches(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{}
	start(t, e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)

	const rows = 20000
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, payload)
	                     SELECT 'big-' || g, 'bulk', jsonb_build_object('n', g) FROM generate_series(1, $1) g`, rows)
	after := e.currentLSN(t)
	waitFor(t, 60*time.Second, "20,000 events and their commit", func() bool {
		_, _, commits, _ := c.snapshot()
		return len(commits) >= 1
	})
	events, batches, commits, _ := c.snapshot()
	if len(events) != rows {
		t.Fatalf("got %d events, want %d", len(events), rows)
	}
	maxBatch := 0
	for _, n := range batches {
		maxBatch = max(maxBatch, n)
	}
	if maxBatch > 256 || len(batches) < rows/256 {
		t.Errorf("%d batches, the largest %d events; want batches of at most 256", len(batches), maxBatch)
	}
	if atCommit := c.commitOf(events[0].EventKey); len(commits) != 1 || commits[0] > after || atCommit != commits[0] || c.commitOf(events[rows-1].EventKey) != commits[0] {
		t.Errorf("commits %v (WAL after %s); want one commit, after all %d events", commits, after, rows)
	}
	for i := 1; i < len(events); i++ {
		if events[i].ID <= events[i-1].ID || events[i].CommitLSN != events[0].CommitLSN {
			t.Fatalf("event %d: id %d after %d, CommitLSN %s vs %s", i, events[i].ID, events[i-1].ID, events[i].CommitLSN, events[0].CommitLSN)
		}
	}
}

func TestAcknowledgesOnlySettledTransactions(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{holdEvents: true}
	cp := &fakeCheckpoint{observe: e.observer(t)}
	start(t, e.config(t, c, cp, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)
	mustExec(t, e.conn, "CREATE TABLE busy (pad text)")

	e.insert(t, "held")
	waitFor(t, 10*time.Second, "the commit", func() bool { return c.commitOf("held") != 0 })
	end := c.commitOf("held")
	// WAL after the held transaction: keepalives now carry later positions,
	// which must not be acknowledged either.
	for range 5 {
		mustExec(t, e.conn, "INSERT INTO busy SELECT repeat('x', 1000) FROM generate_series(1, 100)")
		time.Sleep(300 * time.Millisecond)
		if got := e.confirmed(t); got >= end {
			t.Fatalf("slot confirmed %s, past the unsettled transaction ending at %s", got, end)
		}
	}

	released := time.Now()
	c.release(end)
	waitFor(t, 2500*time.Millisecond, "the slot to pass the settled transaction", func() bool { return e.confirmed(t) >= end })
	t.Logf("acknowledged %v after settling", time.Since(released).Round(time.Millisecond))

	saves, _ := cp.snapshot()
	checkSavedBeforeAck(t, saves, end)
}

func TestCheckpointFailureHoldsAcknowledgement(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{}
	cp := &fakeCheckpoint{observe: e.observer(t)}
	start(t, e.config(t, c, cp, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)

	cp.setFail(true)
	e.insert(t, "a")
	waitFor(t, 10*time.Second, "the commit", func() bool { return c.commitOf("a") != 0 })
	end := c.commitOf("a")
	time.Sleep(1500 * time.Millisecond)
	if got := e.confirmed(t); got >= end {
		t.Fatalf("slot confirmed %s past %s although the checkpoint could not be written", got, end)
	}
	if _, failures := cp.snapshot(); failures == 0 {
		t.Fatal("no checkpoint write was attempted")
	}
	cp.setFail(false)
	waitFor(t, 2500*time.Millisecond, "the acknowledgement once the checkpoint works", func() bool { return e.confirmed(t) >= end })
	saves, _ := cp.snapshot()
	checkSavedBeforeAck(t, saves, end)
}

// checkSavedBeforeAck checks that a checkpoint at or past end was written
// while the slot was still confirmed before end.
func checkSavedBeforeAck(t *testing.T, saves []savedCheckpoint, end relay.LSN) {
	t.Helper()
	for _, s := range saves {
		if s.lsn >= end {
			if s.confirmed >= end {
				t.Errorf("checkpoint %s written when the slot was already confirmed at %s", s.lsn, s.confirmed)
			}
			return
		}
	}
	t.Errorf("no checkpoint at or past %s was written: %+v", end, saves)
}

func TestStatusFlowsWhileSubmitBlocks(t *testing.T) {
	e := newEnv(t)
	blocked := make(chan struct{})
	unblock := make(chan struct{})
	var once sync.Once
	c := &fakeConsumer{holdEvents: true}
	c.submitHook = func(ctx context.Context, events []*relay.Event) error {
		if events[0].EventKey != "slow" {
			return nil
		}
		once.Do(func() { close(blocked) })
		select {
		case <-unblock:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	cfg := e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url})
	// A walsender that hears nothing for 3 s ends the connection.
	cfg.ConnString = withParam(t, e.url, "wal_sender_timeout", "3s")
	start(t, cfg)
	waitStreaming(t, c, 1)

	e.insert(t, "fast")
	e.insert(t, "slow")
	// More messages than the source queues: its receiver must wait for room.
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type) SELECT 'queued-' || g, 'x' FROM generate_series(1, 2000) g`)
	select {
	case <-blocked:
	case <-time.After(10 * time.Second):
		t.Fatal("Submit of the second transaction was never called")
	}
	end := c.commitOf("fast")
	_, _, pid, _ := slotState(t, e)
	c.release(end)
	waitFor(t, 2500*time.Millisecond, "the acknowledgement while Submit blocks", func() bool { return e.confirmed(t) >= end })

	// Longer than wal_sender_timeout: status updates keep the stream alive.
	time.Sleep(4 * time.Second)
	if _, _, now, _ := slotState(t, e); now != pid || c.restartCount() != 1 {
		t.Fatalf("walsender %d -> %d, %d restarts: the stream was dropped while Submit blocked", pid, now, c.restartCount())
	}
	close(unblock)
	c.release(^relay.LSN(0))
	waitFor(t, 10*time.Second, "the queued events", func() bool { return c.eventCount() == 2002 })
	waitFor(t, 5*time.Second, "the acknowledgement of everything", func() bool { return e.confirmed(t) >= c.commitOf("queued-2000") })
}

func TestIdleOutboxLetsSlotAdvance(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{}
	cp := &fakeCheckpoint{}
	start(t, e.config(t, c, cp, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)
	mustExec(t, e.conn, "CREATE TABLE busy (id serial, pad text)")

	before := e.currentLSN(t)
	for range 10 { // ~20 MB of WAL the publication does not cover
		mustExec(t, e.conn, "INSERT INTO busy (pad) SELECT repeat(md5(g::text), 30) FROM generate_series(1, 2000) g")
	}
	after := e.currentLSN(t)
	if after-before < 20e6 {
		t.Fatalf("only %d bytes of WAL written", after-before)
	}
	written := time.Now()
	waitFor(t, 5*time.Second, "the slot to advance past the busy table's WAL", func() bool { return e.confirmed(t) >= after })
	t.Logf("%d bytes of other tables' WAL acknowledged %v after they were written", after-before, time.Since(written).Round(time.Millisecond))

	if c.eventCount() != 0 {
		t.Errorf("%d events from an unpublished table", c.eventCount())
	}
	if saves, _ := cp.snapshot(); len(saves) != 0 {
		t.Errorf("keepalive-only advances wrote %d checkpoints within a minute, want 0", len(saves))
	}
}

func TestNewSlotDeliversThePendingRows(t *testing.T) {
	e := newEnv(t)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type) SELECT 'old-' || g, 'x' FROM generate_series(1, 5) g`)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, status) VALUES ('old-done', 'x', 'done')`)

	c := &fakeConsumer{}
	claim := &claimRecorder{url: e.url}
	start(t, e.config(t, c, &fakeCheckpoint{}, claim))
	waitStreaming(t, c, 1)

	snapshots, counts := claim.waitCalls(t, 1)
	if len(snapshots) != 1 || snapshots[0] == "" || counts[0] != 5 {
		t.Fatalf("hand-overs: snapshots %q, counts %v; want one call delivering the 5 pending rows", snapshots, counts)
	}
	if keys := keysOf(c.handedOver()); fmt.Sprint(keys) != "[old-1 old-2 old-3 old-4 old-5]" {
		t.Errorf("rows given to the consumer's HandOver: %v, want the 5 pending before the slot", keys)
	}

	e.insert(t, "new-1")
	e.insert(t, "new-2")
	waitFor(t, 10*time.Second, "the new rows", func() bool { return c.eventCount() >= 2 })
	time.Sleep(500 * time.Millisecond)
	events, _, _, _ := c.snapshot()
	if len(events) != 2 || events[0].EventKey != "new-1" || events[1].EventKey != "new-2" {
		t.Errorf("streamed %v, want only the rows inserted after the slot", keysOf(events))
	}
}

func TestReconnectsAfterWalsenderTerminated(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{}
	claim := &claimRecorder{url: e.url}
	start(t, e.config(t, c, &fakeCheckpoint{}, claim))
	waitStreaming(t, c, 1)

	e.insert(t, "before")
	waitFor(t, 10*time.Second, "the first event", func() bool { return c.commitOf("before") != 0 })
	end := c.commitOf("before")
	waitFor(t, 5*time.Second, "its acknowledgement", func() bool { return e.confirmed(t) >= end })

	_, _, pid, _ := slotState(t, e)
	var ok bool
	if err := e.conn.QueryRow(context.Background(), "SELECT pg_terminate_backend($1)", pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("terminate walsender %d: %v %v", pid, ok, err)
	}
	waitStreaming(t, c, 2)
	waitFor(t, 10*time.Second, "a new walsender", func() bool {
		_, _, now, _ := slotState(t, e)
		return now != 0 && now != pid
	})

	e.insert(t, "after")
	waitFor(t, 10*time.Second, "the event after the reconnect", func() bool { return c.commitOf("after") != 0 })
	time.Sleep(300 * time.Millisecond)
	events, _, _, restarts := c.snapshot()
	if fmt.Sprint(keysOf(events)) != "[before after]" {
		t.Errorf("events %v, want [before after]: the stream resumes from the slot", keysOf(events))
	}
	if restarts[1] < end {
		t.Errorf("second Restart horizon %s is before the acknowledged %s", restarts[1], end)
	}
	// The slot has its hand-over record: it is kept, not made again.
	if snapshots, _ := claim.waitCalls(t, 1); len(snapshots) != 1 {
		t.Errorf("%d hand-overs, want 1: the slot was made again after a reconnect", len(snapshots))
	}
}

func TestRecreatesDroppedSlot(t *testing.T) {
	e := newEnv(t)
	c1 := &fakeConsumer{}
	claim1 := &claimRecorder{url: e.url}
	r := start(t, e.config(t, c1, &fakeCheckpoint{}, claim1))
	waitStreaming(t, c1, 1)
	claim1.waitCalls(t, 1) // the hand-over finishes beside the stream
	if err := r.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}

	// The walsender may still be exiting: retry until the slot is free.
	waitFor(t, 10*time.Second, "the slot to be dropped", func() bool {
		_, err := e.conn.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", e.slot)
		return err == nil
	})
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type) SELECT 'gap-' || g, 'x' FROM generate_series(1, 3) g`)

	c2 := &fakeConsumer{}
	claim2 := &claimRecorder{url: e.url}
	start(t, e.config(t, c2, &fakeCheckpoint{}, claim2))
	waitStreaming(t, c2, 1)
	if _, counts := claim2.waitCalls(t, 1); len(counts) != 1 || counts[0] != 3 {
		t.Fatalf("hand-over counts %v, want one hand-over of the 3 rows inserted while the slot was missing", counts)
	}
	if exists, _, _, _ := slotState(t, e); !exists {
		t.Fatal("slot not recreated")
	}
	e.insert(t, "next")
	waitFor(t, 10*time.Second, "streaming on the new slot", func() bool { return c2.commitOf("next") != 0 })
	if keys := keysOf(mustEvents(c2)); fmt.Sprint(keys) != "[next]" {
		t.Errorf("streamed %v, want [next]", keys)
	}
}

// TestSourceRecreatesSlotWithoutHandOverRecord: a relay that stopped between
// creating its slot and handing the rows pending then to the claim path
// leaves a slot that will never stream those rows, and no record of the
// hand-over. The next Source drops that slot and makes it again, handing
// every row pending in the new slot's snapshot to the claim path — the
// rows from before the first slot and those committed since — and streams
// only what comes after.
// TestNewSlotStreamsNothingAsSeenBefore: a session that made its slot
// restarts the consumer with the slot's consistent point as the horizon,
// so an event committed after it — here while the hand-over read its
// snapshot, before streaming began — is not taken as possibly delivered
// before (each such transaction waited for a ledger check of its own).
func TestNewSlotStreamsNothingAsSeenBefore(t *testing.T) {
	e := newEnv(t)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type) VALUES ('before', 'x')`)
	c := &fakeConsumer{}
	claim := &claimRecorder{url: e.url}
	var insertBetween func(ctx context.Context)
	var once sync.Once
	claim.afterOpen = func(ctx context.Context) { once.Do(func() { insertBetween(ctx) }) }
	insertBetween = func(ctx context.Context) {
		conn, err := pgx.Connect(ctx, e.url)
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, `INSERT INTO integration_outbox (event_key, event_type) VALUES ('between', 'x')`); err != nil {
			t.Error(err)
		}
	}
	start(t, e.config(t, c, &fakeCheckpoint{}, claim))
	waitFor(t, 10*time.Second, "the event committed while the hand-over read", func() bool { return c.commitOf("between") != 0 })
	claim.waitCalls(t, 1)
	claim.mu.Lock()
	consistent := claim.consistents[0]
	claim.mu.Unlock()
	_, _, _, restarts := c.snapshot()
	if len(restarts) != 1 || restarts[0] != consistent {
		t.Fatalf("consumer restarted with horizons %v, want the new slot's consistent point %s", restarts, consistent)
	}
	if ev := mustEvents(c)[0]; ev.EventKey != "between" || ev.CommitLSN < restarts[0] {
		t.Errorf("first streamed event %s committed at %s, before the horizon %s: it would be checked as re-streamed", ev.EventKey, ev.CommitLSN, restarts[0])
	}
}

func TestSourceRecreatesSlotWithoutHandOverRecord(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type) SELECT 'before-' || g, 'x' FROM generate_series(1, 3) g`)
	claim := &claimRecorder{url: e.url}
	if err := claim.BeginSlot(ctx, e.slot); err != nil {
		t.Fatalf("BeginSlot: %v", err)
	}
	var first relay.LSN
	if err := e.conn.QueryRow(ctx, `SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')`, e.slot).Scan(&first); err != nil {
		t.Fatalf("create the slot: %v", err)
	}
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type) SELECT 'since-' || g, 'x' FROM generate_series(1, 2) g`)
	since := e.currentLSN(t)
	if done, err := claim.HandedOver(ctx, e.slot); err != nil || done {
		t.Fatalf("HandedOver = %v, %v; want false before the Source runs", done, err)
	}

	c := &fakeConsumer{}
	start(t, e.config(t, c, &fakeCheckpoint{}, claim))
	waitStreaming(t, c, 1)
	if _, counts := claim.waitCalls(t, 1); len(counts) != 1 || counts[0] != 5 {
		t.Fatalf("hand-over counts %v, want one hand-over of the 5 pending rows", counts)
	}
	if _, _, _, confirmed := slotState(t, e); confirmed < since {
		t.Errorf("slot confirmed at %s, before %s: the slot made at %s was kept", confirmed, since, first)
	}
	if done, err := claim.HandedOver(ctx, e.slot); err != nil || !done {
		t.Errorf("HandedOver = %v, %v; want true after the Source made the slot again", done, err)
	}
	if keys := keysOf(c.handedOver()); fmt.Sprint(keys) != "[before-1 before-2 before-3 since-1 since-2]" {
		t.Errorf("rows given to the consumer's HandOver: %v, want the 5 pending when the slot was made again", keys)
	}

	e.insert(t, "after")
	waitFor(t, 10*time.Second, "streaming on the new slot", func() bool { return c.commitOf("after") != 0 })
	if keys := keysOf(mustEvents(c)); fmt.Sprint(keys) != "[after]" {
		t.Errorf("streamed %v, want [after]: the rows of the hand-over are not streamed too", keys)
	}
}

func TestUnavailable(t *testing.T) {
	tests := []struct {
		name   string
		setup  func(t *testing.T) replication.Config
		reason string
	}{
		{
			name: "publication missing",
			setup: func(t *testing.T) replication.Config {
				e := newEnv(t)
				mustExec(t, e.conn, "DROP PUBLICATION outbox_relay")
				return e.config(t, &fakeConsumer{}, &fakeCheckpoint{}, &claimRecorder{url: e.url})
			},
			reason: `publication "outbox_relay" does not exist`,
		},
		{
			name: "publication without the outbox",
			setup: func(t *testing.T) replication.Config {
				e := newEnv(t)
				mustExec(t, e.conn, "CREATE TABLE other (id int)")
				mustExec(t, e.conn, "ALTER PUBLICATION outbox_relay SET TABLE other")
				return e.config(t, &fakeConsumer{}, &fakeCheckpoint{}, &claimRecorder{url: e.url})
			},
			reason: "does not publish table public.integration_outbox",
		},
		{
			name: "no REPLICATION privilege",
			setup: func(t *testing.T) replication.Config {
				e := newEnv(t)
				role := "norepl_" + e.slot
				mustExec(t, e.conn, "CREATE ROLE "+role+" LOGIN NOREPLICATION")
				t.Cleanup(func() { _, _ = e.conn.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
				cfg := e.config(t, &fakeConsumer{}, &fakeCheckpoint{}, &claimRecorder{url: e.url})
				u, err := url.Parse(e.url)
				if err != nil {
					t.Fatal(err)
				}
				u.User = url.User(role)
				cfg.ConnString = u.String()
				return cfg
			},
			reason: "REPLICATION privilege",
		},
		{
			name: "wal_level replica",
			setup: func(t *testing.T) replication.Config {
				cluster := pgtest.NewCluster(t, pgtest.Options{WALLevel: "replica"})
				return replication.Config{
					ConnString:  cluster.URL("postgres"),
					Slot:        "outbox_relay",
					Publication: "outbox_relay",
					Outbox:      relay.QualifiedName{Name: "integration_outbox"},
					Consumer:    &fakeConsumer{},
					Checkpoint:  &fakeCheckpoint{},
					HandOver:    handOverStub{},
					Logger:      testLogger(t),
				}
			},
			reason: "wal_level",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src, err := replication.New(tt.setup(t))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err = src.Run(ctx)
			ue, ok := errors.AsType[*replication.UnavailableError](err)
			if !ok {
				t.Fatalf("Run returned %v, want *UnavailableError", err)
			}
			if !strings.Contains(ue.Reason, tt.reason) {
				t.Errorf("reason %q does not mention %q", ue.Reason, tt.reason)
			}
		})
	}
}

func TestDecodeErrorNamesColumnAndReconnects(t *testing.T) {
	e := newEnv(t)
	mustExec(t, e.conn, "CREATE TABLE thin_outbox (id bigserial PRIMARY KEY, event_key text NOT NULL)")
	mustExec(t, e.conn, "CREATE PUBLICATION thin_pub FOR TABLE thin_outbox WITH (publish = 'insert')")
	logs := &logBuffer{}
	c := &fakeConsumer{}
	cfg := e.config(t, c, &fakeCheckpoint{}, nil)
	cfg.Publication = "thin_pub"
	cfg.Outbox = relay.QualifiedName{Schema: "public", Name: "thin_outbox"}
	cfg.HandOver = handOverStub{}
	cfg.Logger = zerolog.New(zerolog.SyncWriter(logs))
	start(t, cfg)
	waitStreaming(t, c, 1)

	mustExec(t, e.conn, "INSERT INTO thin_outbox (event_key) VALUES ('k')")
	waitStreaming(t, c, 2) // the connection is dropped and made again
	log := logs.String()
	if !strings.Contains(log, `column \"event_type\"`) || !strings.Contains(log, `\"public\".\"thin_outbox\"`) {
		t.Errorf("log does not name the column and the relation:\n%s", log)
	}
	if n := c.eventCount(); n != 0 {
		t.Errorf("%d events submitted from an undecodable transaction", n)
	}
}

func TestNewRejectsInvalidConfig(t *testing.T) {
	valid := func() replication.Config {
		return replication.Config{
			ConnString:  "postgres://localhost/db",
			Slot:        "outbox_relay",
			Publication: "outbox_relay",
			Outbox:      relay.QualifiedName{Name: "integration_outbox"},
			Consumer:    &fakeConsumer{},
			Checkpoint:  &fakeCheckpoint{},
			HandOver:    handOverStub{},
		}
	}
	tests := []struct {
		name   string
		modify func(*replication.Config)
	}{
		{"slot with upper case", func(c *replication.Config) { c.Slot = "Outbox" }},
		{"empty publication", func(c *replication.Config) { c.Publication = "" }},
		{"empty outbox", func(c *replication.Config) { c.Outbox = relay.QualifiedName{} }},
		{"no consumer", func(c *replication.Config) { c.Consumer = nil }},
		{"no checkpoint", func(c *replication.Config) { c.Checkpoint = nil }},
		{"no HandOver", func(c *replication.Config) { c.HandOver = nil }},
		{"bad connection string", func(c *replication.Config) { c.ConnString = "postgres://%zz" }},
	}
	if _, err := replication.New(valid()); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := valid()
			tt.modify(&cfg)
			if _, err := replication.New(cfg); err == nil {
				t.Error("New accepted it")
			}
		})
	}
}

func slotState(t *testing.T, e *testEnv) (exists bool, walStatus string, activePID int32, confirmed relay.LSN) {
	t.Helper()
	exists, walStatus, confirmed, activePID, err := replication.SlotInfo(context.Background(), e.conn, e.slot)
	if err != nil {
		t.Fatal(err)
	}
	return exists, walStatus, activePID, confirmed
}

func mustExecTx(t *testing.T, tx pgx.Tx, sql string) {
	t.Helper()
	if _, err := tx.Exec(context.Background(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func withParam(t *testing.T, connURL, key, value string) string {
	t.Helper()
	u, err := url.Parse(connURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}

func keysOf(events []*relay.Event) []string {
	keys := make([]string, len(events))
	for i, ev := range events {
		keys[i] = ev.EventKey
	}
	return keys
}

func mustEvents(c *fakeConsumer) []*relay.Event {
	events, _, _, _ := c.snapshot()
	return events
}

func equalPtr(a, b *string) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func deref(s *string) string {
	if s == nil {
		return "<nil>"
	}
	return *s
}

func TestLargePayloadsAreBatchedByBytes(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{}
	start(t, e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)

	const rows = 24 // ~1 MiB each
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, payload)
	                     SELECT 'fat-' || g, 'fat', jsonb_build_object('pad', repeat(md5(g::text), 32768)) FROM generate_series(1, $1) g`, rows)
	waitFor(t, 30*time.Second, "the commit", func() bool { return c.commitOf("fat-1") != 0 })
	events, batches, _, _ := c.snapshot()
	if len(events) != rows {
		t.Fatalf("got %d events, want %d", len(events), rows)
	}
	if len(events[0].Payload) < 1<<20 {
		t.Fatalf("payload of %d bytes, want over 1 MiB", len(events[0].Payload))
	}
	for _, n := range batches {
		if n > 5 {
			t.Errorf("batches %v: one holds %d events of 1 MiB, want at most 4 MiB (+1 event) per batch", batches, n)
			break
		}
	}
}

// TestHorizonReadOnceTheSlotIsOurs: the consumer restarts with the horizon
// (events committed before it may have been delivered before and are
// checked against the ledger) read once START_REPLICATION has made the slot
// this session's, and before anything of the session is consumed. Read
// before — while a former leader's walsender may still hold the slot and
// stream — events that leader delivered after the position was read would
// be sent again unchecked.
func TestHorizonReadOnceTheSlotIsOurs(t *testing.T) {
	e := newEnv(t)
	var (
		mu       sync.Mutex
		problems []string
	)
	c := &fakeConsumer{}
	c.restartHook = func(ctx context.Context, horizon relay.LSN) error {
		check, err := pgx.Connect(ctx, e.url)
		if err != nil {
			return err
		}
		defer check.Close(context.Background())
		var current relay.LSN
		err = check.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&current)
		exists, _, confirmed, pid, serr := replication.SlotInfo(ctx, check, e.slot)
		mu.Lock()
		defer mu.Unlock()
		switch {
		case err != nil || serr != nil:
			problems = append(problems, fmt.Sprint(err, serr))
		case !exists || pid == 0:
			problems = append(problems, fmt.Sprintf("Restart called with slot exists=%v active_pid=%d: before the slot was the session's", exists, pid))
		case func() bool { evs, _, commits, _ := c.snapshot(); return len(evs) > 0 || len(commits) > 0 }():
			problems = append(problems, "Restart called after the session's messages were consumed")
		case horizon < confirmed || horizon > current:
			problems = append(problems, fmt.Sprintf("horizon %s outside [slot confirmed %s, server WAL %s]", horizon, confirmed, current))
		}
		return nil
	}
	start(t, e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)
	e.insert(t, "x")
	waitFor(t, 10*time.Second, "the event", func() bool { return c.commitOf("x") != 0 })

	mu.Lock()
	defer mu.Unlock()
	for _, p := range problems {
		t.Error(p)
	}
}

func TestRecreatesLostSlot(t *testing.T) {
	cluster := pgtest.NewCluster(t, pgtest.Options{Settings: map[string]string{
		"max_slot_wal_keep_size": "1MB",
		"max_wal_size":           "64MB",
		"min_wal_size":           "32MB",
	}})
	ctx := context.Background()
	if err := cluster.CreateDatabase(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	e := &testEnv{url: cluster.URL("relay"), slot: "outbox_relay"}
	e.conn = mustConnect(t, e.url)
	if _, err := migrations.Migrate(ctx, e.conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}

	c1 := &fakeConsumer{}
	claim1 := &claimRecorder{url: e.url}
	r := start(t, e.config(t, c1, &fakeCheckpoint{}, claim1))
	waitStreaming(t, c1, 1)
	claim1.waitCalls(t, 1) // the hand-over finishes beside the stream
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}

	// Rows the lost slot will never stream, then enough WAL for a checkpoint
	// to invalidate the slot.
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type) SELECT 'lost-' || g, 'x' FROM generate_series(1, 4) g`)
	mustExec(t, e.conn, "CREATE TABLE filler (pad text)")
	waitFor(t, 60*time.Second, "the slot to be lost", func() bool {
		mustExec(t, e.conn, "INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 1000)")
		mustExec(t, e.conn, "SELECT pg_switch_wal()")
		mustExec(t, e.conn, "CHECKPOINT")
		_, status, _, _ := slotState(t, e)
		return status == "lost"
	})

	c2 := &fakeConsumer{}
	claim := &claimRecorder{url: e.url}
	start(t, e.config(t, c2, &fakeCheckpoint{}, claim))
	waitStreaming(t, c2, 1)
	if _, counts := claim.waitCalls(t, 1); len(counts) != 1 || counts[0] != 4 {
		t.Fatalf("hand-over counts %v, want one hand-over of the 4 rows", counts)
	}
	if _, status, _, _ := slotState(t, e); status == "lost" {
		t.Fatal("the slot is still lost")
	}
	e.insert(t, "after")
	waitFor(t, 10*time.Second, "streaming on the recreated slot", func() bool { return c2.commitOf("after") != 0 })
}

func TestResumesAfterServerRestart(t *testing.T) {
	cluster := pgtest.NewCluster(t, pgtest.Options{})
	ctx := context.Background()
	if err := cluster.CreateDatabase(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	e := &testEnv{url: cluster.URL("relay"), slot: "outbox_relay"}
	e.conn = mustConnect(t, e.url)
	if _, err := migrations.Migrate(ctx, e.conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}
	c := &fakeConsumer{}
	start(t, e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)
	e.insert(t, "before")
	waitFor(t, 10*time.Second, "the first event", func() bool { return c.commitOf("before") != 0 })
	end := c.commitOf("before")
	waitFor(t, 5*time.Second, "its acknowledgement", func() bool { return e.confirmed(t) >= end })

	if err := cluster.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	e.conn = mustConnect(t, e.url)
	waitStreaming(t, c, 2)
	e.insert(t, "after")
	waitFor(t, 30*time.Second, "the event after the restart", func() bool { return c.commitOf("after") != 0 })

	// Before PostgreSQL 17 a shutdown checkpoint does not persist a slot
	// whose only change is confirmed_flush, so acknowledged transactions may
	// be streamed again after a restart: below the Restart horizon, where
	// the engine checks them against the ledger.
	events, _, _, restarts := c.snapshot()
	keys := keysOf(events)
	if keys[0] != "before" || keys[len(keys)-1] != "after" || len(keys) > 3 {
		t.Fatalf("events %v, want before, possibly before again, after", keys)
	}
	for _, ev := range events[1 : len(events)-1] {
		if ev.CommitLSN >= restarts[1] {
			t.Errorf("re-streamed %s committed at %s, not below the Restart horizon %s", ev.EventKey, ev.CommitLSN, restarts[1])
		}
	}
}
