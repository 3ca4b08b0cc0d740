package main

// The relay must never stall and never orphan a row (docs/guarantees.md).
// Each test here reproduces a defect found by review, end to end: a real
// PostgreSQL, the relay as `run` wires it, real sinks. They assert only what
// an operator sees — rows, ledger, slot, deliveries — so they hold whatever
// the relay's inner structure.

import (
	"bytes"
	"context"
	"fmt"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/relay"
	"io"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// publishBulk inserts n events of aggregates "bulk-<i%aggs>" with keys
// "<prefix>-<i>", in transactions of 500 rows.
func (s *setup) publishBulk(t *testing.T, prefix string, n, aggs int) {
	t.Helper()
	ctx := context.Background()
	for from := 0; from < n; from += 500 {
		to := min(from+500, n)
		if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
			SELECT 'order.placed', 'bulk', 'bulk-' || (g % $4), $1 || '-' || g, jsonb_build_object('i', g, 'pad', repeat('x', 250))
			  FROM generate_series($2::int, $3::int - 1) AS g`, prefix, from, to, aggs); err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
}

// waitDelivered waits until every key with prefix reached both sinks.
func (s *setup) waitDelivered(t *testing.T, prefix string, n int, timeout time.Duration) {
	t.Helper()
	count := func() (hook, js int) {
		seen := map[string]bool{}
		for _, d := range s.hook.deliveries() {
			if strings.HasPrefix(d.EventKey, prefix+"-") {
				seen[d.EventKey] = true
			}
		}
		hook = len(seen)
		seen = map[string]bool{}
		for _, d := range streamMessages(t, s.nats.URL()) {
			if strings.HasPrefix(d.EventKey, prefix+"-") {
				seen[d.EventKey] = true
			}
		}
		return hook, len(seen)
	}
	deadline := time.Now().Add(timeout)
	for {
		hook, js := count()
		if hook == n && js == n {
			return
		}
		if time.Now().After(deadline) {
			pending := s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status = 'pending' AND event_key LIKE $1 || '-%'`, prefix)
			active := s.scalar(t, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active`)
			t.Fatalf("after %v: %d of %d events reached the webhook, %d reached NATS; %d rows pending; slot active: %d",
				timeout, hook, n, js, pending, active)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// waitStreaming waits until the relay streams from its slot.
func (s *setup) waitStreaming(t *testing.T) {
	t.Helper()
	eventually(t, 20*time.Second, "the slot to be streamed", func() bool {
		return s.scalar(t, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active`) == 1
	})
}

// jsCount is how many messages the OUTBOX stream holds.
func (s *setup) jsCount(t *testing.T) int {
	t.Helper()
	return len(streamMessages(t, s.nats.URL()))
}

// TestNoStall_ConnectionDropUnderBackPressure: a slow webhook fills its lane,
// so decoding waits for room; then the replication connection drops. The
// relay must stream again and deliver everything once the webhook recovers.
// (Before the fix it never streamed again: the events of the batch that was
// being submitted were counted as in flight forever, and the next session
// waited for them.)
func TestNoStall_ConnectionDropUnderBackPressure(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	var slow atomic.Bool
	slow.Store(true)
	s.hook.setReply(func(delivery) int {
		if slow.Load() {
			time.Sleep(200 * time.Millisecond)
		}
		return 204
	})
	// lane_block_max keeps decoding waiting on the full lane instead of
	// diverting events after 2 s, so the drop surely lands while it waits.
	cfg := s.configFileWith(t, "    concurrency: 2", "")
	replaceInFile(t, cfg, "delivery:\n", "delivery:\n  lane_block_max: 5m\n")
	s.startInProcess(t, cfg)
	s.waitStreaming(t)

	const n = 6000
	s.publishBulk(t, "bp", n, 1000)
	// NATS takes events as fast as they are decoded: once it is thousands
	// ahead of the webhook, short of n, decoding waits for room in the
	// webhook's lane (it gains a few events each time the webhook answers).
	eventually(t, 60*time.Second, "decoding to wait for the full webhook lane", func() bool {
		c := s.jsCount(t)
		return c > 4000 && c < n-500 && c-len(s.hook.deliveries()) > 3500
	})
	if _, err := s.pool.Exec(context.Background(), `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	slow.Store(false)
	s.waitDelivered(t, "bp", n, 90*time.Second)
	// Every request was answered 204, well within the timeout, and the relay
	// did not crash: no outcome was unknown, so no event may be sent twice
	// (docs/guarantees.md, "at most one delivery recorded").
	var repeated []string
	for key, ds := range byKey(s.hook.deliveries()) {
		if len(ds) > 1 {
			repeated = append(repeated, fmt.Sprintf("%s×%d", key, len(ds)))
		}
	}
	if len(repeated) > 0 {
		sort.Strings(repeated)
		t.Errorf("%d events sent again after a 2xx across the walsender's termination: %v", len(repeated), repeated[:min(len(repeated), 10)])
	}
}

// TestNoStall_UnstorableErrorText: a webhook answers 400 with a long
// non-ASCII body (cut inside a character it is not valid UTF-8) and another
// with a NUL byte; PostgreSQL refuses such text. Each event is dead-lettered
// with a readable reason, and the events around it are settled and
// acknowledged: one row's data never holds the others.
func TestNoStall_UnstorableErrorText(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.hook.setReply(func(d delivery) int { return 204 })
	bodies := map[string]string{
		// The error text is cut to one short line; with three offsets, the
		// cut lands inside a three-byte character at least twice.
		"bad-0": strings.Repeat("€", 300),
		"bad-1": "a" + strings.Repeat("€", 300),
		"bad-2": "aa" + strings.Repeat("€", 300),
	}
	cfg := s.configFile(t, "")
	// A receiver that answers 400 with the bodies above.
	s.hook.Config.Handler = badBodyHandler(s.hook.Config.Handler, bodies)
	s.startInProcess(t, cfg)
	s.waitStreaming(t)

	ctx := context.Background()
	for _, key := range []string{"good-1", "bad-0", "good-2", "bad-1", "good-3", "bad-2", "good-4"} {
		if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', $1, $1, '{}')`, key); err != nil {
			t.Fatal(err)
		}
	}
	_, end := s.slotLSN(t)
	eventually(t, 30*time.Second, "bad events dead-lettered, good ones delivered, the slot acknowledged", func() bool {
		confirmed, _ := s.slotLSN(t)
		return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status = 'failed'`) == 3 &&
			len(byKey(s.hook.deliveries())) == 4 && confirmed >= end
	})
	rows, err := s.pool.Query(ctx, `SELECT event_key, last_error FROM integration_outbox WHERE status = 'failed'`)
	if err != nil {
		t.Fatal(err)
	}
	failed, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Key, Err string }])
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range failed {
		if !utf8.ValidString(f.Err) || strings.ContainsRune(f.Err, 0) || !strings.Contains(f.Err, "400") {
			t.Errorf("%s: last_error %q: want valid UTF-8 naming the status", f.Key, f.Err)
		}
	}
}

// TestNoStall_NullAvailableAtIsDue: a pending row with a NULL available_at
// (the column is nullable) that reaches the claim path is due at once, and
// the later events of its aggregate follow it.
func TestNoStall_NullAvailableAtIsDue(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	ctx := context.Background()
	// Pending before the slot exists: the hand-over gives it to the claim path.
	if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at)
		VALUES ('order.placed', 'order', 'null-agg', 'null-1', '{}', NULL)`); err != nil {
		t.Fatal(err)
	}
	s.startInProcess(t, s.configFile(t, ""))
	s.waitStreaming(t)
	for i := 2; i <= 4; i++ {
		if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', 'null-agg', $1, '{}')`, fmt.Sprintf("null-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 30*time.Second, "the NULL available_at row and its aggregate's later events delivered", func() bool {
		return len(byKey(s.hook.deliveries())) == 4
	})
	checkOrder(t, "hook", s.hook.deliveries())
}

// TestNoStall_ScheduledEventIsNotOvertaken: an event whose available_at is
// in the future goes to the claim path; the next event of its aggregate,
// committed a moment later, must wait for it.
func TestNoStall_ScheduledEventIsNotOvertaken(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.startInProcess(t, s.configFileWith(t, "", "source:\n  poll_interval: 100ms\n"))
	s.waitStreaming(t)
	ctx := context.Background()
	const rounds = 20
	for r := range rounds {
		agg := fmt.Sprintf("sched-%d", r)
		if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at)
			VALUES ('order.placed', 'order', $1, $1 || '-1', '{}', now() + interval '300 milliseconds')`, agg); err != nil {
			t.Fatal(err)
		}
		if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', $1, $1 || '-2', '{}')`, agg); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 30*time.Second, "every scheduled event and its successor delivered", func() bool {
		return len(byKey(s.hook.deliveries())) == 2*rounds && len(byKey(streamMessages(t, s.nats.URL()))) == 2*rounds
	})
	checkOrder(t, "hook", s.hook.deliveries())
	checkOrder(t, "nats", streamMessages(t, s.nats.URL()))
}

// TestNoStall_BoundedWhileSettlementFails: while the relay cannot record
// outcomes (its tables are locked) but replication works, it must stop
// decoding after a bounded number of unrecorded deliveries instead of
// sending everything, and catch up once the tables are free.
func TestNoStall_BoundedWhileSettlementFails(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.startInProcess(t, s.configFile(t, ""))
	s.waitStreaming(t)
	ctx := context.Background()
	lock, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(ctx)
	// Every table the relay records outcomes in.
	if _, err := lock.Exec(ctx, `DO $$
DECLARE t text;
BEGIN
  FOR t IN SELECT c.oid::regclass::text FROM pg_class c
            WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace
              AND c.relname NOT IN ('integration_outbox', 'integration_outbox_conflicts') AND c.relname NOT LIKE 'schema_version%'
  LOOP
    EXECUTE 'LOCK TABLE ' || t || ' IN ACCESS EXCLUSIVE MODE';
  END LOOP;
END $$`); err != nil {
		t.Fatal(err)
	}
	const n = 30000
	s.publishBulk(t, "locked", n, 1000)
	time.Sleep(5 * time.Second)
	sent := s.jsCount(t)
	if sent >= n/2 {
		t.Errorf("%d of %d events were sent while no outcome could be recorded: want decoding to stop at a bound", sent, n)
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	s.waitDelivered(t, "locked", n, 120*time.Second)
}

// badBodyHandler answers 400 with bodies[key] for the events whose key is in
// bodies, and passes every other request to next.
func badBodyHandler(next http.Handler, bodies map[string]string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if reply, ok := bodies[parseDelivery(body, "").EventKey]; ok {
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, reply)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(w, r)
	})
}

// replaceInFile replaces the first old with new in the file at path.
func replaceInFile(t *testing.T, path, old, new string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(b, []byte(old)) {
		t.Fatalf("%s has no %q", path, old)
	}
	if err := os.WriteFile(path, bytes.Replace(b, []byte(old), []byte(new), 1), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestNoStall_InvisibleRowDivertIsNotAcknowledged: with synchronous
// replication and its standby down, a commit is streamed while its row is
// still invisible to other sessions. A failed delivery must not be settled
// (nor the slot acknowledged past it) until its diversion is written: once the
// commit becomes visible the claim path delivers it. (Before the fix, after
// 30 s the event was settled anyway and the row stayed pending, owned by
// nobody.)
func TestNoStall_InvisibleRowDivertIsNotAcknowledged(t *testing.T) {
	cluster := pgtest.NewCluster(t, pgtest.Options{})
	ctx := context.Background()
	if err := cluster.CreateDatabase(ctx, "outbox"); err != nil {
		t.Fatal(err)
	}
	s := newSetup(t, cluster.URL("outbox"))
	var failing atomic.Bool
	failing.Store(true)
	s.hook.setReply(func(d delivery) int {
		if d.EventKey == "invisible" && failing.Load() {
			return http.StatusServiceUnavailable
		}
		return http.StatusNoContent
	})
	cfg := s.configFile(t, "")
	replaceInFile(t, cfg, "backoff: [1m]", "backoff: [1s]")
	s.startInProcess(t, cfg)
	s.waitStreaming(t)

	// Synchronous replication to a standby that does not exist: commits
	// wait, written and streamed but invisible.
	admin, err := pgx.Connect(ctx, cluster.URL("outbox"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(ctx) })
	setStandbys := func(names string) {
		t.Helper()
		if _, err := admin.Exec(ctx, fmt.Sprintf(`ALTER SYSTEM SET synchronous_standby_names = '%s'`, names)); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
			t.Fatal(err)
		}
	}
	setStandbys("ghost")
	t.Cleanup(func() { setStandbys("") })
	// pg_reload_conf only signals: publish on a session that has been seen
	// to have the setting, or the commit may not wait.
	publisher, err := pgx.Connect(ctx, cluster.URL("outbox"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { publisher.Close(ctx) })
	eventually(t, 10*time.Second, "the publishing session to see synchronous_standby_names", func() bool {
		var names string
		return publisher.QueryRow(ctx, `SELECT current_setting('synchronous_standby_names')`).Scan(&names) == nil && names == "ghost"
	})
	committed := make(chan error, 1)
	go func() {
		_, err := publisher.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', 'inv', 'invisible', '{}')`)
		committed <- err
	}()
	// Longer than the 30 s after which the old relay gave up on the row.
	select {
	case err := <-committed:
		t.Fatalf("the commit did not wait for the missing standby: %v", err)
	case <-time.After(35 * time.Second):
	}
	setStandbys("")
	if err := <-committed; err != nil {
		t.Fatal(err)
	}
	failing.Store(false)
	eventually(t, 30*time.Second, "the event delivered through the claim path", func() bool {
		return len(byKey(s.hook.deliveries())["invisible"]) > 0
	})
}

// TestNoStall_CrashBeforeHandOverCompletes: the relay is killed after the
// new slot exists but before the slot-creation hand-over has committed. The
// next start must not trust that slot: the rows pending at its creation
// reach the sinks.
func TestNoStall_CrashBeforeHandOverCompletes(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	ctx := context.Background()
	const n = 5
	for i := range n {
		if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', 'pre', $1, '{}')`, fmt.Sprintf("pre-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	// Hold the hand-over's UPDATE back: the slot gets created, the marking
	// of its pending rows waits for this lock.
	lock, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(ctx)
	if _, err := lock.Exec(ctx, `LOCK TABLE integration_outbox IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	cfg := s.configFile(t, "")
	var log1 syncBuffer
	first := s.startProcess(t, cfg, &log1)
	eventually(t, 30*time.Second, "the slot created and the hand-over waiting", func() bool {
		return s.scalar(t, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay'`) == 1 &&
			s.scalar(t, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
				WHERE NOT l.granted AND l.relation = 'integration_outbox'::regclass AND a.query ILIKE '%handoff_at%'`) > 0
	})
	first.Process.Signal(syscall.SIGKILL)
	first.Wait()
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	var log2 syncBuffer
	s.startProcess(t, cfg, &log2)
	keys := map[string]bool{}
	for i := range n {
		keys[fmt.Sprintf("pre-%d", i)] = true
	}
	s.waitAllDelivered(t, 40*time.Second, keys)
}

// TestNoStall_UnconsumedSlotDroppedInReplicationMode: in replication mode a
// relay that cannot stream from its slot (here every walsender is taken)
// must still drop the slot after slot_max_unconsumed, so that it does not
// keep WAL without bound, and recover once it can stream again.
func TestNoStall_UnconsumedSlotDroppedInReplicationMode(t *testing.T) {
	cluster := pgtest.NewCluster(t, pgtest.Options{Settings: map[string]string{"max_wal_senders": "4"}})
	ctx := context.Background()
	if err := cluster.CreateDatabase(ctx, "outbox"); err != nil {
		t.Fatal(err)
	}
	url := cluster.URL("outbox")
	s := newSetup(t, url)
	cfg := s.configFileWith(t, "", "source:\n  mode: replication\n  slot_max_unconsumed: 3s\n")
	s.startInProcess(t, cfg)
	s.waitStreaming(t)

	// End the relay's walsender and take every walsender slot.
	var hogs []*pgconn.PgConn
	defer func() {
		for _, h := range hogs {
			h.Close(ctx)
		}
	}()
	for len(hogs) < 4 {
		s.scalar(t, `SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots WHERE active`)
		h, err := pgconn.Connect(ctx, url+"&replication=database")
		if err != nil {
			continue
		}
		hogs = append(hogs, h)
	}
	eventually(t, 20*time.Second, "the unconsumed slot dropped", func() bool {
		return s.scalar(t, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay'`) == 0
	})
	if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', 'after', 'after-drop', '{}')`); err != nil {
		t.Fatal(err)
	}
	for _, h := range hogs {
		h.Close(ctx)
	}
	hogs = nil
	s.waitAllDelivered(t, 40*time.Second, map[string]bool{"after-drop": true})
}

// TestNoStall_SlowBatchKeepsItsLease: in poll mode, claims whose sends take
// longer than lock_timeout are extended while they are worked on, so another
// relay's sweeper does not take them over and send them again.
func TestNoStall_SlowBatchKeepsItsLease(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.hook.setReply(func(delivery) int {
		time.Sleep(400 * time.Millisecond)
		return http.StatusNoContent
	})
	cfg := s.configFileWith(t, "    concurrency: 1", "source:\n  mode: poll\n  poll_interval: 100ms\n  lock_timeout: 1s\n  batch_size: 20\n")
	s.startInProcess(t, cfg)
	s.startInProcess(t, cfg)
	ctx := context.Background()
	const n = 30
	for i := range n {
		if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', $1, $1, '{}')`, fmt.Sprintf("slow-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 60*time.Second, "every event delivered", func() bool { return len(byKey(s.hook.deliveries())) == n })
	time.Sleep(2 * time.Second)
	for key, copies := range byKey(s.hook.deliveries()) {
		if len(copies) > 1 {
			t.Errorf("%s reached the webhook %d times: its lease passed while it was being sent", key, len(copies))
		}
	}
}

// TestRepublishedKeyAfterPruneIsDeliveredOnBothPaths: retention pruned an
// event's row; the application publishes the same event_key again. That is a
// new event on either path (docs/guarantees.md): the stream and the claim
// path both deliver it.
func TestRepublishedKeyAfterPruneIsDeliveredOnBothPaths(t *testing.T) {
	for _, mode := range []string{"replication", "poll"} {
		t.Run(mode, func(t *testing.T) {
			s := newSetup(t, pgtest.NewDatabase(t))
			cfg := s.configFileWith(t, "", "source:\n  mode: "+mode+"\n  poll_interval: 100ms\n")
			s.startInProcess(t, cfg)
			if mode == "replication" {
				s.waitStreaming(t)
			}
			ctx := context.Background()
			publish := func() {
				t.Helper()
				if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', 'again', 'again', '{}')`); err != nil {
					t.Fatal(err)
				}
			}
			publish()
			eventually(t, 20*time.Second, "the first delivery", func() bool { return len(byKey(s.hook.deliveries())["again"]) == 1 })
			eventually(t, 20*time.Second, "the row done", func() bool {
				return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status = 'done'`) == 1
			})
			tables := admin.Tables{Outbox: relay.MustParseQualifiedName("integration_outbox"),
				Ledger: relay.MustParseQualifiedName("integration_idempotency"), Checkpoint: relay.MustParseQualifiedName("relay_checkpoint")}
			time.Sleep(10 * time.Millisecond)
			if _, _, err := admin.Prune(ctx, s.pool, tables, admin.RetentionConfig{DoneAfter: time.Millisecond, LedgerAfter: time.Hour}); err != nil {
				t.Fatal(err)
			}
			if n := s.scalar(t, `SELECT count(*) FROM integration_outbox`); n != 0 {
				t.Fatalf("%d rows left after pruning", n)
			}
			publish()
			eventually(t, 20*time.Second, "the re-published event delivered", func() bool { return len(byKey(s.hook.deliveries())["again"]) == 2 })
		})
	}
}
