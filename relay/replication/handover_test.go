package replication_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestSlotRecreatedOnlyAfterConsumerSettled: when the slot is dropped while
// the consumer still holds an event it is delivering, the new slot is
// created (and its pending rows diverted to the claim path) only after
// WaitSettled returns, so the claim path does not get that row too and send
// it a second time. Here WaitSettled stands for the engine: it finishes the
// delivery, which marks the row done.
func TestSlotRecreatedOnlyAfterConsumerSettled(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{holdEvents: true}
	claim := &claimRecorder{url: e.url}
	cfg := e.config(t, c, &fakeCheckpoint{}, claim)
	settler := mustConnect(t, e.url) // used by the source's goroutine only
	var waits atomic.Int32
	cfg.WaitSettled = func(ctx context.Context) error {
		waits.Add(1)
		_, err := settler.Exec(ctx, `UPDATE integration_outbox SET status = 'done' WHERE event_key = 'inflight'`)
		return err
	}
	start(t, cfg)
	waitStreaming(t, c, 1)
	claim.waitCalls(t, 1) // the first hand-over finishes beside the stream
	e.insert(t, "inflight")
	waitFor(t, 10*time.Second, "the event", func() bool { return c.commitOf("inflight") != 0 })

	ctx := context.Background()
	waitFor(t, 10*time.Second, "the slot dropped", func() bool {
		_, _ = e.conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active`, e.slot)
		_, err := e.conn.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, e.slot)
		return err == nil
	})
	waitStreaming(t, c, 2)
	if snapshots, _ := claim.waitCalls(t, 2); len(snapshots) != 2 || waits.Load() < 2 {
		t.Fatalf("%d hand-overs, %d waits: want the slot recreated, after a wait", len(snapshots), waits.Load())
	}
	var diverted bool
	if err := e.conn.QueryRow(ctx, `SELECT handoff_at IS NOT NULL FROM integration_outbox WHERE event_key = 'inflight'`).Scan(&diverted); err != nil {
		t.Fatal(err)
	}
	if diverted {
		t.Fatal("the new slot's hand-over gave the claim path a row the consumer was still delivering")
	}
}

// pushPastNewestUnblocked writes 1,001 rows of aggregate bulk/1 after the test's
// backlog: the rows before them are not among the newest 1,000 that the
// hand-over feeds first (HandOverRows.NewestUnblocked), and bulk/1 has a row older
// than those, so NewestUnblocked feeds nothing and Deliver everything.
func (e *testEnv) pushPastNewestUnblocked(t *testing.T) {
	t.Helper()
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id)
		SELECT 'bulk-' || g, 'x', 'bulk', '1' FROM generate_series(1, 1001) g`)
}

// olds returns the keys of events with the prefix old-.
func olds(events []*relay.Event) []string {
	var out []string
	for _, k := range keysOf(events) {
		if strings.HasPrefix(k, "old-") {
			out = append(out, k)
		}
	}
	return out
}

// TestStreamsWhileTheHandOverMarks: a new slot streams while its hand-over
// marks the rows pending in its snapshot (docs/architecture.md, "slot
// creation"): an event committed after the slot reaches the consumer while
// the marking has not even begun. Before the first event the consumer is
// told to divert the backlog's aggregates, and released from it once every
// row is marked.
func TestStreamsWhileTheHandOverMarks(t *testing.T) {
	e := newEnv(t)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id)
		SELECT 'old-' || g, 'x', 'order', '1' FROM generate_series(1, 3) g`)
	e.pushPastNewestUnblocked(t)
	c := &fakeConsumer{}
	claim := &claimRecorder{url: e.url}
	var divertsAtMark atomic.Int32
	claim.beforeDeliver = func(ctx context.Context) error {
		d, _ := c.divertCalls()
		divertsAtMark.Store(int32(len(d)))
		// The marking waits for the stream to deliver a fresh event.
		for c.commitOf("fresh") == 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Millisecond):
			}
		}
		return nil
	}
	start(t, e.config(t, c, &fakeCheckpoint{}, claim))
	waitStreaming(t, c, 1)
	e.insert(t, "fresh")
	waitFor(t, 10*time.Second, "the fresh event streamed before the hand-over's marking", func() bool { return c.commitOf("fresh") != 0 })

	_, counts := claim.waitCalls(t, 1)
	if counts[0] != 1004 {
		t.Errorf("the hand-over delivered %d rows, want 1,004", counts[0])
	}
	if keys := olds(c.handedOver()); fmt.Sprint(keys) != "[old-1 old-2 old-3]" {
		t.Errorf("rows of order/1 given to the consumer's HandOver: %v, want [old-1 old-2 old-3]", keys)
	}
	if divertsAtMark.Load() != 1 {
		t.Errorf("%d Divert calls when the marking began, want 1 (before the stream's first event)", divertsAtMark.Load())
	}
	waitFor(t, 5*time.Second, "the diversion released", func() bool { _, released := c.divertCalls(); return released == 1 })
	diverts, _ := c.divertCalls()
	if len(diverts) != 1 || !slices.Equal(diverts[0], []relay.AggregateKey{{Type: "order", ID: "1"}, {Type: "bulk", ID: "1"}}) {
		t.Errorf("Divert calls %v, want one of the backlog's aggregates order/1 and bulk/1", diverts)
	}
	if c.restartCount() != 1 {
		t.Errorf("%d sessions, want 1", c.restartCount())
	}
}

// TestStreamsWhileTheSnapshotIsRead: a new slot streams while its
// hand-over reads the rows pending in its snapshot (reading a backlog of
// 200,000 took 0.7 s in make bench's slot-recreated, and every fresh event
// waited for it). An event of an aggregate without rows in the snapshot
// reaches the consumer during the read, and so does one of an aggregate
// whose rows were all among the newest (NewestUnblocked fed them first); one of an
// aggregate with older rows there is held until the rows' aggregates are
// pinned.
func TestStreamsWhileTheSnapshotIsRead(t *testing.T) {
	e := newEnv(t)
	// order/1's rows are older than the newest 1,000 (NewestUnblocked's), order/3's
	// one row is the newest.
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id)
		SELECT 'old-' || g, 'x', 'order', '1' FROM generate_series(1, 3) g`)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id)
		SELECT 'bulk-' || g, 'x', 'bulk', g::text FROM generate_series(1, 1000) g`)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id) VALUES ('recent', 'x', 'order', '3')`)
	c := &fakeConsumer{}
	var divertsAtFresh atomic.Int32
	divertsAtFresh.Store(-1)
	c.submitHook = func(ctx context.Context, events []*relay.Event) error {
		for _, ev := range events {
			if ev.EventKey == "fresh" {
				d, _ := c.divertCalls()
				divertsAtFresh.Store(int32(len(d)))
			}
		}
		return nil
	}
	claim := &claimRecorder{url: e.url}
	var held atomic.Bool
	claim.beforeAggregates = func(ctx context.Context) error {
		conn, err := pgx.Connect(ctx, e.url)
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		// An event of another aggregate goes on during the read.
		if _, err := conn.Exec(ctx, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id) VALUES ('other', 'x', 'order', '2')`); err != nil {
			return err
		}
		for deadline := time.Now().Add(10 * time.Second); c.commitOf("other") == 0; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				return errors.New("an event of an aggregate without rows in the snapshot did not reach the consumer during the read")
			}
		}
		// And one of the aggregate whose one row NewestUnblocked fed.
		if _, err := conn.Exec(ctx, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id) VALUES ('again', 'x', 'order', '3')`); err != nil {
			return err
		}
		for deadline := time.Now().Add(10 * time.Second); c.commitOf("again") == 0; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				return errors.New("an event of an aggregate whose rows NewestUnblocked fed did not reach the consumer during the read")
			}
		}
		if keys := keysOf(c.handedOver()); !slices.Contains(keys, "recent") || slices.Contains(keys, "old-1") {
			return fmt.Errorf("rows given to HandOver during the read: %d, want the newest (recent) and not order/1's", len(keys))
		}
		// The fresh event, on the backlog's aggregate, committed and sent
		// to the relay while the snapshot is still unread.
		var commit relay.LSN
		if _, err := conn.Exec(ctx, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id) VALUES ('fresh', 'x', 'order', '1')`); err != nil {
			return err
		}
		if err := conn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&commit); err != nil {
			return err
		}
		for deadline := time.Now().Add(10 * time.Second); ; {
			var sent relay.LSN
			err := conn.QueryRow(ctx, `SELECT COALESCE(max(r.sent_lsn), '0/0')::text FROM pg_stat_replication r
				JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1`, e.slot).Scan(&sent)
			if err != nil {
				return err
			}
			if sent >= commit {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the slot sent up to %s, not the fresh event at %s, while its snapshot was unread: it does not stream before the read", sent, commit)
			}
			time.Sleep(20 * time.Millisecond)
		}
		time.Sleep(200 * time.Millisecond)
		held.Store(c.commitOf("fresh") == 0 && divertsAtFresh.Load() == -1)
		return nil
	}
	start(t, e.config(t, c, &fakeCheckpoint{}, claim))
	_, counts := claim.waitCalls(t, 1)
	if counts[0] != 1004 {
		t.Errorf("the hand-over delivered %d rows, want 1,004", counts[0])
	}
	waitFor(t, 10*time.Second, "the fresh event", func() bool { return c.commitOf("fresh") != 0 })
	if keys := keysOf(c.handedOver()); len(keys) != 1004 || slices.Index(keys, "recent") > slices.Index(keys, "old-1") {
		t.Errorf("rows given to HandOver: %d, recent at %d, old-1 at %d; want 1,004, the newest (recent) before order/1's", len(keys), slices.Index(keys, "recent"), slices.Index(keys, "old-1"))
	}
	if !held.Load() {
		t.Error("the fresh event reached the consumer while the snapshot was unread")
	}
	if n := divertsAtFresh.Load(); n != 1 {
		t.Errorf("%d Divert calls when the fresh event was submitted, want 1 (its aggregate pinned first)", n)
	}
	if c.restartCount() != 1 {
		t.Errorf("%d sessions, want 1", c.restartCount())
	}
}

// TestFailedHandOverMakesTheSlotAgain: when the read of the newest rows
// (NewestUnblocked), of the snapshot's rows or their delivery fails while the slot
// streams, the session ends (events
// held at the handOverGate are streamed again by the next session, from the slot);
// the next one finds the slot without its hand-over record, makes it again
// and hands every pending row over, so nothing pending before the first
// slot is left to a slot that will never stream it. A diversion the first
// session set is not released (the next session's Restart ends it).
func TestFailedHandOverMakesTheSlotAgain(t *testing.T) {
	for _, step := range []string{"early", "read", "deliver"} {
		t.Run(step, func(t *testing.T) {
			e := newEnv(t)
			mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id)
				SELECT 'old-' || g, 'x', 'order', g::text FROM generate_series(1, 4) g`)
			e.pushPastNewestUnblocked(t)
			c := &fakeConsumer{}
			claim := &claimRecorder{url: e.url}
			var calls atomic.Int32
			fail := func(context.Context) error {
				if calls.Add(1) == 1 {
					return errors.New("injected " + step + " failure")
				}
				return nil
			}
			wantDiverts := 1 // the next session's; the failed one never pinned
			switch step {
			case "early":
				claim.beforeNewestUnblocked = fail
			case "read":
				claim.beforeAggregates = fail
			case "deliver":
				claim.beforeDeliver = fail
				wantDiverts = 2
			}
			start(t, e.config(t, c, &fakeCheckpoint{}, claim))
			_, counts := claim.waitCalls(t, 1)
			if counts[0] != 1005 || calls.Load() != 2 {
				t.Errorf("hand-overs: %d %s calls, the finished one delivered %v; want 2 calls, 1,005 rows", calls.Load(), step, counts)
			}
			if n := c.restartCount(); n != 2 {
				t.Errorf("%d sessions, want 2", n)
			}
			if n := len(c.handedOver()); n != 1005 {
				t.Errorf("%d rows given to the consumer's HandOver, want 1,005 (the second session's)", n)
			}
			diverts, released := c.divertCalls()
			if len(diverts) != wantDiverts || released != 1 {
				t.Errorf("%d Divert calls, %d released; want %d and 1", len(diverts), released, wantDiverts)
			}
			e.insert(t, "fresh")
			waitFor(t, 10*time.Second, "the fresh event", func() bool { return c.commitOf("fresh") != 0 })
		})
	}
}
