package replication_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
	"github.com/outbox-relay/outbox-relay/relay/replication"
)

// standbyEnv is a migrated primary and a physical standby of it (PostgreSQL
// 16+, from a cold copy) that replicates through a proxy the test can
// black-hole, and a ledger.Store on the primary.
type standbyEnv struct {
	primary, standby *pgtest.Cluster
	proxy            *netfault.Proxy
	// primaryURL reaches the primary and, once promoted, the standby
	// (target_session_attrs=read-write), as database_url would.
	primaryURL, standbyURL string
	pconn, sconn           *pgx.Conn
	store                  *ledger.Store
	slot                   string
}

func newStandbyEnv(t *testing.T) *standbyEnv {
	t.Helper()
	bindir := pgtest.BindirAtLeast(t, 16, "logical decoding on a standby")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e := &standbyEnv{slot: "standby_test"}
	e.primary = pgtest.NewCluster(t, pgtest.Options{Bindir: bindir})
	if err := e.primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	conn := mustConnect(t, e.primary.URL("app"))
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = conn.Close(ctx)
	e.proxy = netfault.NewProxy(t, "127.0.0.1:"+strconv.Itoa(e.primary.Port()))
	e.standby = pgtest.NewStandby(t, e.primary, pgtest.StandbyOptions{PrimaryAddr: e.proxy.Addr()})
	e.primaryURL = pgtest.MultiHostURL("app", e.primary, e.standby)
	e.standbyURL = e.standby.URL("app")
	e.pconn = mustConnect(t, e.primary.URL("app")) // the cold copy restarted the primary
	e.sconn = mustConnect(t, e.standbyURL)
	pool, err := pgxpool.New(ctx, e.primaryURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e.store = mustStore(t, pool, ledger.DefaultConfig())
	return e
}

// config is a Source decoding on the standby, with the ledger on the
// primary.
func (e *standbyEnv) config(t *testing.T, c relay.Consumer, primary replication.Primary) replication.Config {
	if primary == nil {
		primary = e.store
	}
	return replication.Config{
		ConnString:  e.standbyURL,
		Slot:        e.slot,
		Publication: "outbox_relay",
		Outbox:      relay.QualifiedName{Name: "integration_outbox"},
		Consumer:    c,
		Checkpoint:  e.store,
		HandOver:    e.store,
		Primary:     primary,
		StreamFrom:  e.store.StreamFrom,
		Logger:      testLogger(t),
	}
}

func (e *standbyEnv) insert(t *testing.T, keys ...string) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pconn, func(tx pgx.Tx) error {
		for _, k := range keys {
			if _, err := tx.Exec(ctx, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id, payload)
			                           VALUES ($1, 'test.event', 'test', $1, '{}')`, k); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("insert %v: %v", keys, err)
	}
}

// waitReplayed waits until the standby has replayed everything the primary
// has flushed now.
func (e *standbyEnv) waitReplayed(t *testing.T) {
	t.Helper()
	var target relay.LSN
	if err := e.pconn.QueryRow(context.Background(), "SELECT pg_current_wal_flush_lsn()::text").Scan(&target); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the standby to replay "+target.String(), func() bool {
		var got relay.LSN
		if err := e.sconn.QueryRow(context.Background(), "SELECT pg_last_wal_replay_lsn()::text").Scan(&got); err != nil {
			t.Fatal(err)
		}
		return got >= target
	})
}

func diverted(t *testing.T, conn *pgx.Conn, key string) bool {
	t.Helper()
	var marked bool
	if err := conn.QueryRow(context.Background(), "SELECT handoff_at IS NOT NULL FROM integration_outbox WHERE event_key = $1", key).Scan(&marked); err != nil {
		t.Fatalf("row %s: %v", key, err)
	}
	return marked
}

func slotCount(t *testing.T, conn *pgx.Conn, slot string) int {
	t.Helper()
	var n int
	if err := conn.QueryRow(context.Background(), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func eventKeys(c *fakeConsumer) []string {
	events, _, _, _ := c.snapshot()
	keys := make([]string, len(events))
	for i, ev := range events {
		keys[i] = ev.EventKey
	}
	return keys
}

// TestStandby_StreamsFromTheStandby (PostgreSQL 16+): with Config.Primary
// the slot is made on the standby (on 17+ without failover, which a standby
// refuses), the row pending at its creation goes to the claim path on the
// primary, a row committed on the primary afterwards is streamed from the
// standby, and the checkpoint is written on the primary before the slot on
// the standby is acknowledged past it. A slot of the relay's name left on
// the primary is dropped (it pins WAL there).
func TestStandby_StreamsFromTheStandby(t *testing.T) {
	e := newStandbyEnv(t)
	mustExec(t, e.pconn, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", e.slot)
	e.insert(t, "pending-at-creation")
	c := &fakeConsumer{}
	start(t, e.config(t, c, nil))
	waitStreaming(t, c, 1)

	if !diverted(t, e.pconn, "pending-at-creation") {
		t.Error("the row pending at the slot's creation was not diverted to the claim path on the primary")
	}
	if n := slotCount(t, e.sconn, e.slot); n != 1 {
		t.Errorf("the standby holds %d slots named %s, want 1", n, e.slot)
	}
	if n := slotCount(t, e.pconn, e.slot); n != 0 {
		t.Errorf("the primary still holds the relay's slot (%d): it pins WAL there", n)
	}

	e.insert(t, "fresh")
	waitFor(t, 30*time.Second, "the fresh row from the standby", func() bool { return c.eventCount() >= 1 })
	if keys := eventKeys(c); len(keys) != 1 || keys[0] != "fresh" {
		t.Fatalf("streamed %v, want [fresh]", keys)
	}
	commit := c.commitOf("fresh")
	waitFor(t, 30*time.Second, "the slot on the standby acknowledged past the fresh row", func() bool {
		_, _, confirmed, _, err := replication.SlotInfo(context.Background(), e.sconn, e.slot)
		if err != nil {
			t.Fatal(err)
		}
		return confirmed >= commit
	})
	// Read after the acknowledgement: the checkpoint was written before it.
	saved, err := e.store.LoadCheckpoint(context.Background(), e.slot)
	if err != nil {
		t.Fatal(err)
	}
	if saved < commit {
		t.Errorf("the standby's slot is acknowledged past %s, the fresh row's transaction, and the primary's checkpoint is at %s", commit, saved)
	}
}

// countingPrimary counts the hand-overs of slots made on the standby.
type countingPrimary struct {
	replication.Primary
	handOvers atomic.Int32
}

func (p *countingPrimary) MarkForClaimFromStandby(ctx context.Context, standby *pgx.Conn, slot, snapshot string, consistent relay.LSN) (int64, error) {
	p.handOvers.Add(1)
	return p.Primary.MarkForClaimFromStandby(ctx, standby, slot, snapshot, consistent)
}

// TestStandby_HandOverWaitsForTheStandby (PostgreSQL 16+): the slot on a
// lagging standby is made only once the standby has replayed the primary's
// position, so the hand-over sees the primary's rows as they are, not as
// they were. Here a row the claim path had claimed (processing) went back
// to pending on the primary (a poll-mode retry keeps handoff_at NULL), and
// a running-transactions record on the primary came before that change,
// while the standby's link was black-holed: a slot made at once on the
// standby would be consistent at that record, see the row as processing,
// and leave it to nobody — never streamed, never claimed.
func TestStandby_HandOverWaitsForTheStandby(t *testing.T) {
	e := newStandbyEnv(t)
	e.insert(t, "claimed-then-retried")
	mustExec(t, e.pconn, "UPDATE integration_outbox SET status = 'processing', locked_by = 'poller', locked_at = now() WHERE event_key = 'claimed-then-retried'")
	e.waitReplayed(t)

	e.proxy.BlackHole(netfault.NewConnsBlackHole)
	mustExec(t, e.pconn, "SELECT pg_log_standby_snapshot()")
	mustExec(t, e.pconn, "UPDATE integration_outbox SET status = 'pending', locked_by = NULL, locked_at = NULL, attempts = 1 WHERE event_key = 'claimed-then-retried'")
	c := &fakeConsumer{}
	start(t, e.config(t, c, nil))
	time.Sleep(time.Second)
	if c.restartCount() != 0 {
		t.Fatal("the source streams from a standby that has not replayed the primary's position")
	}
	e.proxy.Pass()
	waitStreaming(t, c, 1)
	if !diverted(t, e.pconn, "claimed-then-retried") {
		t.Error("the row pending on the primary when the slot was made is neither diverted to the claim path nor streamed: lost")
	}
}

// TestStandby_RestartOfTheStandby (PostgreSQL 16+): the standby restarts
// while the source streams from it; the source resumes from the slot, every
// row arrives, and every one streamed before the restart is below the
// horizon the consumer is given (the primary's position), so the engine
// checks it against the ledger instead of sending it again.
func TestStandby_RestartOfTheStandby(t *testing.T) {
	e := newStandbyEnv(t)
	c := &fakeConsumer{}
	cfg := e.config(t, c, nil)
	cfg.ReconnectMax = 500 * time.Millisecond
	start(t, cfg)
	waitStreaming(t, c, 1)
	e.insert(t, "before-1", "before-2")
	waitFor(t, 30*time.Second, "the rows before the restart", func() bool { return c.eventCount() >= 2 })
	before := c.commitOf("before-2")

	if err := e.standby.Restart(context.Background()); err != nil {
		t.Fatal(err)
	}
	e.insert(t, "after-1")
	waitStreaming(t, c, 2)
	waitFor(t, 30*time.Second, "the row after the restart", func() bool {
		return c.commitOf("after-1") != 0
	})
	_, _, _, restarts := c.snapshot()
	if h := restarts[len(restarts)-1]; h < before {
		t.Errorf("after the standby's restart the horizon is %s, below %s, the end of a transaction streamed before: it would be sent again unchecked", h, before)
	}
	seen := map[string]bool{}
	for _, k := range eventKeys(c) {
		seen[k] = true
	}
	for _, k := range []string{"before-1", "before-2", "after-1"} {
		if !seen[k] {
			t.Errorf("row %s never streamed", k)
		}
	}
}

// TestStandby_PromotionKeepsTheSlot (PostgreSQL 16+): the primary dies and
// the standby the source decodes on is promoted. The slot is on the promoted
// server: the source ends with relay.ErrServerChanged (a new timeline), and
// the next term's source continues from that slot — no new slot, no
// hand-over — with the rows committed on the new primary.
func TestStandby_PromotionKeepsTheSlot(t *testing.T) {
	e := newStandbyEnv(t)
	c := &fakeConsumer{}
	primary := &countingPrimary{Primary: e.store}
	cfg := e.config(t, c, primary)
	cfg.ReconnectMax = 500 * time.Millisecond
	src, err := replication.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	waitStreaming(t, c, 1)
	e.insert(t, "before-promotion")
	waitFor(t, 30*time.Second, "the row before the promotion", func() bool { return c.eventCount() >= 1 })
	e.waitReplayed(t)

	if err := e.primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := e.standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, relay.ErrServerChanged) {
			t.Fatalf("Run after the promotion: %v, want relay.ErrServerChanged", err)
		}
	case <-time.After(90 * time.Second):
		t.Fatal("the source did not end after the promotion")
	}

	e.store.BeginTerm()
	next := &fakeConsumer{}
	start(t, e.config(t, next, primary))
	waitStreaming(t, next, 1)
	newConn := mustConnect(t, e.standbyURL)
	if _, err := newConn.Exec(context.Background(), `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id, payload)
	                                                 VALUES ('after-promotion', 'test.event', 'test', 'a', '{}')`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the row committed on the promoted standby", func() bool { return next.commitOf("after-promotion") != 0 })
	if n := primary.handOvers.Load(); n != 1 {
		t.Errorf("%d slots made through a hand-over, want 1: the promotion lost the slot", n)
	}
	for _, k := range eventKeys(next) {
		if !strings.HasPrefix(k, "before-") && !strings.HasPrefix(k, "after-") {
			t.Errorf("unexpected event %s", k)
		}
	}
}

// TestStandbyWatch_LagAndUnreachable (PostgreSQL 16+): the watch says
// nothing while the standby keeps up (the primary idle, then busy); it
// reports the standby lagging once its link to the primary has been
// black-holed longer than MaxLag while the primary writes, after voiding
// the slot's hand-over; WaitHealthy waits while the link is still cut (a
// fresh measure must not take the stuck standby for a caught-up one) and
// returns once it is back; and a stopped standby is reported unreachable.
func TestStandbyWatch_LagAndUnreachable(t *testing.T) {
	e := newStandbyEnv(t)
	var voids atomic.Int32
	w, err := replication.NewStandbyWatch(replication.StandbyWatchConfig{
		ConnString: e.standbyURL,
		Primary:    e.store,
		MaxLag:     time.Second,
		Void:       func(context.Context) error { voids.Add(1); return nil },
		Logger:     testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	watch := func(d time.Duration) (time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		began := time.Now()
		err := w.Watch(ctx)
		return time.Since(began), err
	}
	if _, err := watch(2500 * time.Millisecond); err != nil {
		t.Fatalf("idle primary, standby caught up: %v", err)
	}
	stopWriting := make(chan struct{})
	writing := make(chan struct{})
	go func() {
		defer close(writing)
		for i := 0; ; i++ {
			select {
			case <-stopWriting:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if _, err := e.pconn.Exec(context.Background(), "SELECT pg_logical_emit_message(false, 'test', 'busy')"); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	defer func() { close(stopWriting); <-writing }()
	if _, err := watch(2500 * time.Millisecond); err != nil {
		t.Fatalf("busy primary, standby keeping up: %v", err)
	}

	e.proxy.BlackHole(netfault.NewConnsBlackHole)
	took, err := watch(30 * time.Second)
	var gone *replication.StandbyUnavailableError
	if !errors.As(err, &gone) || gone.Kind != replication.StandbyLagging {
		t.Fatalf("standby cut off from the primary: Watch = %v, want lagging", err)
	}
	if took > 5*time.Second || voids.Load() != 1 {
		t.Errorf("reported after %s with %d voids, want within a few seconds and 1", took, voids.Load())
	}
	short, cancelShort := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancelShort()
	if err := w.WaitHealthy(short); err == nil {
		t.Fatal("WaitHealthy returned while the standby's link was still black-holed")
	}
	e.proxy.Pass()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := w.WaitHealthy(ctx); err != nil {
		t.Fatalf("WaitHealthy after the link came back: %v", err)
	}

	if err := e.standby.Stop(); err != nil {
		t.Fatal(err)
	}
	_, err = watch(30 * time.Second)
	if !errors.As(err, &gone) || gone.Kind != replication.StandbyUnreachable {
		t.Fatalf("standby stopped: Watch = %v, want unreachable", err)
	}
}

// TestStandby_AcknowledgementWaitsForTheStandby (PostgreSQL 16+): once the
// checkpoint is written on the primary, the slot on the standby is
// acknowledged past the events only when the standby has received that
// WAL (so a promotion of it keeps their outcomes), or, when it does not
// receive it (cut off; or shutting down, its walsender waiting for this
// acknowledgement), after a bounded wait, on the primary's durable record
// alone, with a warning.
func TestStandby_AcknowledgementWaitsForTheStandby(t *testing.T) {
	e := newStandbyEnv(t)
	c := &fakeConsumer{holdEvents: true}
	var logs logBuffer
	cfg := e.config(t, c, nil)
	cfg.Logger = zerolog.New(&logs)
	start(t, cfg)
	waitStreaming(t, c, 1)
	e.insert(t, "held")
	waitFor(t, 30*time.Second, "the event from the standby", func() bool { return c.eventCount() == 1 })
	commit := c.commitOf("held")

	e.proxy.BlackHole(netfault.NewConnsBlackHole)
	released := time.Now()
	c.release(commit)
	var acked time.Duration
	waitFor(t, 30*time.Second, "the slot acknowledged past the event", func() bool {
		_, _, confirmed, _, err := replication.SlotInfo(context.Background(), e.sconn, e.slot)
		if err != nil {
			t.Fatal(err)
		}
		acked = time.Since(released)
		return confirmed >= commit
	})
	if acked < 900*time.Millisecond {
		t.Errorf("acknowledged %v after the checkpoint while the standby could not receive it: it did not wait", acked)
	}
	if !strings.Contains(logs.String(), "acknowledging on the primary's durable record") {
		t.Error("no warning that the acknowledgement went out on the primary's durable record alone")
	}
	e.proxy.Pass()
}
