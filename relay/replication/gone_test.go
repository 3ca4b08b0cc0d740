package replication_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
	claimpath "github.com/outbox-relay/outbox-relay/relay/claim"
)

// scriptedSink answers each delivery with answer(d) on a goroutine of its
// own, and records the event keys it acknowledged.
type scriptedSink struct {
	answer func(d *relay.Delivery) error

	mu        sync.Mutex
	delivered []string
}

var _ relay.Sink = (*scriptedSink)(nil)

func (s *scriptedSink) Name() string { return "hook" }

func (s *scriptedSink) Send(_ context.Context, d *relay.Delivery, done func(error)) {
	go func() {
		var err error
		if s.answer != nil {
			err = s.answer(d)
		}
		if err == nil {
			s.mu.Lock()
			s.delivered = append(s.delivered, d.Event.EventKey)
			s.mu.Unlock()
		}
		done(err)
	}()
}

func (s *scriptedSink) Close(context.Context) error { return nil }

func (s *scriptedSink) got(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Contains(s.delivered, key)
}

// relayRig is the stream as cmd/outbox-relay wires it: an engine over
// ledger.Store with one sink, fed by a Source whose hand-over is the
// store's (recorded by claim), and, with claimPath, the claim path over
// the rows diverted.
type relayRig struct {
	engine *relay.Engine
	store  *ledger.Store
	claim  *claimRecorder
	logs   *logBuffer
}

// startRelayRig runs an engine with sink and a Source over it until the
// test ends. Failed attempts are diverted at once (no inline retry).
func startRelayRig(t *testing.T, e *testEnv, sink relay.Sink) *relayRig {
	t.Helper()
	return startRelayRigWith(t, e, sink, &claimRecorder{url: e.url}, false)
}

// startRelayRigWith is startRelayRig with the hand-over's recorder claim
// and, with claimPath, the claim path beside the stream.
func startRelayRigWith(t *testing.T, e *testEnv, sink relay.Sink, claim *claimRecorder, claimPath bool) *relayRig {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, e.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	store := mustStore(t, pool, ledger.DefaultConfig())
	logs := &logBuffer{}
	log := zerolog.New(zerolog.MultiLevelWriter(logs, zerolog.NewTestWriter(t))).With().Timestamp().Logger()
	owner := ledger.NewOwner()
	engine, err := relay.NewEngine(relay.EngineConfig{
		Routes: []relay.Route{{Sink: sink}},
		Policy: relay.Policy{InlineAttempts: 0},
		Stream: store, Claim: store, Owner: owner,
		Logger: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	var claimSource *claimpath.Source
	if claimPath {
		// Before the engine runs: New registers its wake-up with it.
		claimSource, err = claimpath.New(claimpath.Config{Engine: engine, Store: store, PollInterval: 50 * time.Millisecond, Owner: owner, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
	}
	engineCtx, stopEngine := context.WithCancel(ctx)
	engineDone := make(chan struct{})
	go func() { defer close(engineDone); _ = engine.Run(engineCtx) }()
	t.Cleanup(func() { stopEngine(); <-engineDone })
	if claimSource != nil {
		claimCtx, stopClaim := context.WithCancel(ctx)
		claimDone := make(chan struct{})
		go func() { defer close(claimDone); _ = claimSource.Run(claimCtx) }()
		// Registered after the engine's: runs before it.
		t.Cleanup(func() { stopClaim(); <-claimDone })
	}

	cfg := e.config(t, engine.Stream(), &fakeCheckpoint{}, claim)
	cfg.WaitSettled = engine.WaitSettled
	cfg.Logger = log
	start(t, cfg)
	return &relayRig{engine: engine, store: store, claim: claim, logs: logs}
}

// goneRows reads outbox_relay_settle_gone_total for path.
func goneRows(t *testing.T, path relay.Path) float64 {
	t.Helper()
	families, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "outbox_relay_settle_gone_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "path" && l.GetValue() == string(path) {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// deletedRowOutcomes are the outcomes that need a write to the row: a
// diversion to the claim path and a dead letter.
var deletedRowOutcomes = []struct {
	name   string
	refuse error
}{
	{"diversion", relay.TransientError(errors.New("503 from the test"), 0)},
	{"dead letter", relay.PermanentError(errors.New("400 from the test"))},
}

// TestHandOverSettlesARowDeletedBeforeItsOutcome: a row a new slot's
// hand-over delivers is deleted (by hand, by the application's cleanup)
// before its outcome — a diversion or a dead letter, each a write to the
// row — is written. The row was visible when the hand-over read it, so
// not seeing it now means it is gone: the event is settled without its
// outcome, logged and counted, and the hand-over completes and is
// recorded; the rows beside it are delivered (docs/guarantees.md,
// "Deleted rows and invisible rows"). It waited forever before: the
// hand-over's rows carry no transaction id, and the check for deleted rows
// skipped them.
func TestHandOverSettlesARowDeletedBeforeItsOutcome(t *testing.T) {
	for _, tc := range deletedRowOutcomes {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id)
				SELECT 'old-' || g, 'x', 'order', g::text FROM generate_series(1, 3) g`)
			mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id) VALUES ('old-gone', 'x', 'order', 'gone')`)
			var goneID int64
			if err := e.conn.QueryRow(context.Background(), `SELECT id FROM integration_outbox WHERE event_key = 'old-gone'`).Scan(&goneID); err != nil {
				t.Fatal(err)
			}
			e.pushPastNewestUnblocked(t) // the old rows go through Deliver, not NewestUnblocked
			deleter := mustConnect(t, e.url)
			var deleteOnce sync.Once
			sink := &scriptedSink{answer: func(d *relay.Delivery) error {
				if d.Event.EventKey != "old-gone" {
					return nil
				}
				var err error
				deleteOnce.Do(func() {
					_, err = deleter.Exec(context.Background(), `DELETE FROM integration_outbox WHERE event_key = 'old-gone'`)
				})
				if err != nil {
					t.Errorf("delete old-gone: %v", err)
				}
				return tc.refuse
			}}
			goneBefore := goneRows(t, relay.PathStream)
			rig := startRelayRig(t, e, sink)

			_, counts := rig.claim.waitCalls(t, 1)
			if counts[0] != 1005 {
				t.Errorf("the hand-over delivered %d rows, want 1,005", counts[0])
			}
			if done, err := rig.store.HandedOver(context.Background(), e.slot); err != nil || !done {
				t.Errorf("HandedOver = %v, %v; want the hand-over recorded", done, err)
			}
			for _, k := range []string{"old-1", "old-2", "old-3", "bulk-1001"} {
				if !sink.got(k) {
					t.Errorf("%s not delivered", k)
				}
			}
			if n := goneRows(t, relay.PathStream) - goneBefore; n != 1 {
				t.Errorf("outbox_relay_settle_gone_total{path=stream} rose by %v, want 1", n)
			}
			logged := 0
			for _, line := range strings.Split(rig.logs.String(), "\n") {
				if strings.Contains(line, "was deleted") && strings.Contains(line, fmt.Sprintf(`"id":%d`, goneID)) {
					logged++
				}
			}
			if logged != 1 {
				t.Errorf("the deletion of row %d logged %d times, want once:\n%s", goneID, logged, rig.logs.String())
			}
		})
	}
}

// TestReconnectAfterAHandOverRowWasDeleted: the stream reconnects while a
// hand-over's row deleted before its outcome was written is in flight (the
// situation of TestHandOverSettlesARowDeletedBeforeItsOutcome). The next
// session finds the slot without its hand-over record, drops it and waits
// for the engine to settle before it makes a new one: that wait ends, and
// within a bound a slot streams again and a new row is delivered. Before,
// the wait never ended: no slot, no stream, and new rows stayed pending
// with nothing to deliver them.
func TestReconnectAfterAHandOverRowWasDeleted(t *testing.T) {
	e := newEnv(t)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id)
		SELECT 'old-' || g, 'x', 'order', g::text FROM generate_series(1, 3) g`)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id) VALUES ('old-gone', 'x', 'order', 'gone')`)
	e.pushPastNewestUnblocked(t)
	admin := mustConnect(t, e.url)
	var once sync.Once
	var firstPID int32 // the walsender of the first session
	reconnected := make(chan struct{})
	sink := &scriptedSink{answer: func(d *relay.Delivery) error {
		if d.Event.EventKey != "old-gone" {
			return nil
		}
		once.Do(func() {
			defer close(reconnected)
			ctx := context.Background()
			if _, err := admin.Exec(ctx, `DELETE FROM integration_outbox WHERE event_key = 'old-gone'`); err != nil {
				t.Errorf("delete old-gone: %v", err)
			}
			// The session ends before the outcome is written.
			err := admin.QueryRow(ctx, `SELECT active_pid, pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active`, e.slot).Scan(&firstPID, new(bool))
			if err != nil {
				t.Errorf("terminate the walsender: %v", err)
			}
		})
		return relay.TransientError(errors.New("503 from the test"), 0)
	}}
	rig := startRelayRig(t, e, sink)
	select {
	case <-reconnected:
	case <-time.After(30 * time.Second):
		t.Fatal("the hand-over never sent old-gone")
	}

	// Within the bound: a new slot streams (its walsender is not the
	// first session's), a row inserted then is delivered, and the new
	// slot's hand-over is recorded.
	const bound = 20 * time.Second
	inserted := false
	deadline := time.Now().Add(bound)
	for {
		done, err := rig.store.HandedOver(context.Background(), e.slot)
		if err != nil {
			t.Fatal(err)
		}
		if done && sink.got("fresh") {
			break
		}
		exists, _, pid, _ := slotState(t, e)
		if time.Now().After(deadline) {
			t.Fatalf("%v after the reconnect: slot exists %v, walsender %d (the first was %d), fresh row inserted %v and delivered %v, hand-over recorded %v",
				bound, exists, pid, firstPID, inserted, sink.got("fresh"), done)
		}
		if !inserted && exists && pid != 0 && pid != firstPID {
			e.insert(t, "fresh")
			inserted = true
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestSlotCreationEndsWhenItCannotFinish: CREATE_REPLICATION_SLOT waits
// for every transaction running when it began to end; one left open (a
// session idle in a transaction) holds it forever. After StallAfter the
// session ends with an error naming what the creation waits for — the
// oldest such transaction's backend — and the next session tries again:
// once the transaction ends, a slot is made and streams. Before, the
// session waited, silently, for as long as the transaction stayed open.
func TestSlotCreationEndsWhenItCannotFinish(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	blocker := mustConnect(t, e.url)
	mustExec(t, blocker, `BEGIN`)
	mustExec(t, blocker, `INSERT INTO integration_outbox (event_key, event_type) VALUES ('open', 'x')`)
	var pid int32
	if err := blocker.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}

	logs := &logBuffer{}
	c := &fakeConsumer{}
	cfg := e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url})
	cfg.StallAfter = time.Second
	cfg.ReconnectMax = 500 * time.Millisecond
	cfg.Logger = zerolog.New(zerolog.MultiLevelWriter(logs, zerolog.NewTestWriter(t)))
	start(t, cfg)
	waitFor(t, 15*time.Second, "the slot's creation to end with an error naming the open transaction", func() bool {
		return strings.Contains(logs.String(), fmt.Sprintf("pid %d", pid)) && strings.Contains(logs.String(), "idle in transaction")
	})
	if c.restartCount() != 0 {
		t.Fatalf("the consumer was restarted %d times with the slot's creation blocked", c.restartCount())
	}
	mustExec(t, blocker, `COMMIT`)
	waitStreaming(t, c, 1)
	if exists, _, _, _ := slotState(t, e); !exists {
		t.Fatal("no slot once the transaction ended")
	}
}

// TestHandOverReadEndsWhenItCannotFinish: the read of a new slot's
// snapshot waits here behind an ACCESS EXCLUSIVE lock on the outbox table
// (a migration's ALTER TABLE, say) which itself waits for the hand-over's
// other transaction: neither can finish, and PostgreSQL sees no deadlock.
// After StallAfter the read ends, and with it the session, with an error
// naming it; its transactions end, the lock is granted and released, and
// the next session makes the slot again and hands the rows over. Before,
// the session and the ALTER TABLE waited forever.
func TestHandOverReadEndsWhenItCannotFinish(t *testing.T) {
	e := newEnv(t)
	mustExec(t, e.conn, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id)
		SELECT 'old-' || g, 'x', 'order', g::text FROM generate_series(1, 3) g`)
	locker := mustConnect(t, e.url)
	locked := make(chan error, 1)
	var once sync.Once
	claim := &claimRecorder{url: e.url}
	claim.beforeAggregates = func(ctx context.Context) error {
		once.Do(func() {
			go func() {
				_, err := locker.Exec(context.Background(), `BEGIN; LOCK TABLE integration_outbox IN ACCESS EXCLUSIVE MODE`)
				locked <- err
			}()
			// The read starts once the lock is queued.
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				var waiting bool
				if err := e.conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE relation = 'integration_outbox'::regclass AND mode = 'AccessExclusiveLock' AND NOT granted)`).Scan(&waiting); err != nil || waiting {
					return
				}
			}
		})
		return nil
	}
	logs := &logBuffer{}
	c := &fakeConsumer{}
	cfg := e.config(t, c, &fakeCheckpoint{}, claim)
	cfg.StallAfter = time.Second
	cfg.ReconnectMax = 500 * time.Millisecond
	cfg.Logger = zerolog.New(zerolog.MultiLevelWriter(logs, zerolog.NewTestWriter(t)))
	start(t, cfg)

	select {
	case err := <-locked:
		if err != nil {
			t.Fatalf("lock the outbox: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the lock behind the hand-over's transaction was never granted: the read did not end")
	}
	// The session logs its error once its transactions have ended.
	waitFor(t, 10*time.Second, "an error naming the read that did not finish", func() bool {
		return strings.Contains(logs.String(), "read the rows pending at slot creation: not done after 1s")
	})
	mustExec(t, locker, `ROLLBACK`)
	if _, counts := claim.waitCalls(t, 1); counts[0] != 3 {
		t.Errorf("the next session's hand-over delivered %d rows, want 3", counts[0])
	}
}
