package replication_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/replication"
)

// TestMain fails the package when a test leaves a goroutine behind
// (docs/architecture.md, "Goroutines and their owners").
func TestMain(m *testing.M) { goleak.VerifyTestMain(pgtest.Wrap(m)) }

// fakeConsumer records what the source hands it and settles positions like
// the engine would: everything at once, or (holdEvents) transactions with
// events only up to the position the test releases.
type fakeConsumer struct {
	// submitHook, when set, runs before a batch is recorded; it may block
	// (back-pressure) until ctx is done.
	submitHook func(ctx context.Context, events []*relay.Event) error
	// restartHook, when set, runs at the start of Restart.
	restartHook func(ctx context.Context, horizon relay.LSN) error

	mu         sync.Mutex
	holdEvents bool
	released   relay.LSN

	events     []*relay.Event
	batches    []int
	commits    []relay.LSN
	keepalives int
	sent       int           // Sent calls
	sentSum    time.Duration // their lags
	restarts   []relay.LSN
	handOvers  []*relay.Event                // the rows given to HandOver, in order
	diverts    [][]relay.AggregateKey        // Divert calls, in order
	undiverted []map[relay.AggregateKey]bool // of each Divert call, the aggregates released
	// eventsAtCommit[i] is how many events had been submitted when commits[i] came.
	eventsAtCommit []int

	openEvents int        // events of the transaction being submitted
	pending    []position // committed or reported, not yet settled
	settled    relay.LSN
	passed     bool
}

type position struct {
	lsn    relay.LSN
	events bool
}

var _ relay.Consumer = (*fakeConsumer)(nil)

func (c *fakeConsumer) Submit(ctx context.Context, events []*relay.Event) error {
	if c.submitHook != nil {
		if err := c.submitHook(ctx, events); err != nil {
			return err
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.events = append(c.events, events...)
	c.batches = append(c.batches, len(events))
	c.openEvents += len(events)
	return nil
}

func (c *fakeConsumer) Commit(endLSN relay.LSN) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.commits = append(c.commits, endLSN)
	c.eventsAtCommit = append(c.eventsAtCommit, len(c.events))
	c.pending = append(c.pending, position{lsn: endLSN, events: c.openEvents > 0})
	c.openEvents = 0
}

func (c *fakeConsumer) Keepalive(walEnd relay.LSN) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.keepalives++
	c.pending = append(c.pending, position{lsn: walEnd})
}

func (c *fakeConsumer) Settled() (relay.LSN, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.pending) > 0 {
		p := c.pending[0]
		if p.events && c.holdEvents && p.lsn > c.released {
			break
		}
		c.settled = max(c.settled, p.lsn)
		c.passed = c.passed || p.events
		c.pending = c.pending[1:]
	}
	passed := c.passed
	c.passed = false
	return c.settled, passed
}

// Sent implements relay.Consumer: it counts the lags and sums them.
func (c *fakeConsumer) Sent(lag time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sent++
	c.sentSum += lag
}

// sentLags returns how many lags Sent reported and their sum.
func (c *fakeConsumer) sentLags() (int, time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sent, c.sentSum
}

// HandOver implements relay.Consumer: it records the rows, settled at
// once.
func (c *fakeConsumer) HandOver(ctx context.Context, events []*relay.Event) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.handOvers = append(c.handOvers, events...)
	return ctx.Err()
}

// HandOverSettled implements relay.Consumer.
func (c *fakeConsumer) HandOverSettled(ctx context.Context) error { return ctx.Err() }

// handedOver returns the rows given to HandOver.
func (c *fakeConsumer) handedOver() []*relay.Event {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*relay.Event(nil), c.handOvers...)
}

// Divert implements relay.Consumer: it records the aggregates, and those
// released.
func (c *fakeConsumer) Divert(aggs []relay.AggregateKey) (release func([]relay.AggregateKey)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.diverts = append(c.diverts, aggs)
	released := map[relay.AggregateKey]bool{}
	c.undiverted = append(c.undiverted, released)
	return func(done []relay.AggregateKey) {
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, a := range done {
			released[a] = true
		}
	}
}

// divertCalls returns the Divert calls and how many of them had every
// aggregate released.
func (c *fakeConsumer) divertCalls() ([][]relay.AggregateKey, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for i, aggs := range c.diverts {
		all := true
		for _, a := range aggs {
			all = all && c.undiverted[i][a]
		}
		if all {
			n++
		}
	}
	return append([][]relay.AggregateKey(nil), c.diverts...), n
}

func (c *fakeConsumer) Restart(ctx context.Context, horizon relay.LSN) error {
	if c.restartHook != nil {
		if err := c.restartHook(ctx, horizon); err != nil {
			return err
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.restarts = append(c.restarts, horizon)
	c.pending, c.settled, c.passed, c.openEvents = nil, 0, false, 0
	return nil
}

// release settles the held transactions that end at or before lsn.
func (c *fakeConsumer) release(lsn relay.LSN) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.released = max(c.released, lsn)
}

func (c *fakeConsumer) snapshot() (events []*relay.Event, batches []int, commits []relay.LSN, restarts []relay.LSN) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*relay.Event(nil), c.events...), append([]int(nil), c.batches...),
		append([]relay.LSN(nil), c.commits...), append([]relay.LSN(nil), c.restarts...)
}

func (c *fakeConsumer) eventCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.events)
}

func (c *fakeConsumer) restartCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.restarts)
}

// commitOf returns the end LSN the consumer got for the transaction holding
// the event with key, or 0.
func (c *fakeConsumer) commitOf(key string) relay.LSN {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, e := range c.events {
		if e.EventKey != key {
			continue
		}
		for j, n := range c.eventsAtCommit {
			if n > i {
				return c.commits[j]
			}
		}
	}
	return 0
}

// fakeCheckpoint records checkpoint writes and, with observe set, the slot's
// confirmed position at the moment of each write.
type fakeCheckpoint struct {
	observe func(ctx context.Context) relay.LSN

	mu       sync.Mutex
	fail     bool
	failWith error // the error a failing write returns; nil: a generic one
	failures int
	saves    []savedCheckpoint
}

type savedCheckpoint struct {
	lsn       relay.LSN
	confirmed relay.LSN // the slot's confirmed_flush_lsn when the write began
}

var _ relay.Checkpoint = (*fakeCheckpoint)(nil)

func (f *fakeCheckpoint) LoadCheckpoint(context.Context, string) (relay.LSN, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.saves) == 0 {
		return 0, nil
	}
	return f.saves[len(f.saves)-1].lsn, nil
}

func (f *fakeCheckpoint) SaveCheckpoint(ctx context.Context, _ string, lsn relay.LSN) error {
	var confirmed relay.LSN
	if f.observe != nil {
		confirmed = f.observe(ctx)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		f.failures++
		if f.failWith != nil {
			return f.failWith
		}
		return errors.New("checkpoint table unavailable")
	}
	f.saves = append(f.saves, savedCheckpoint{lsn: lsn, confirmed: confirmed})
	return nil
}

func (f *fakeCheckpoint) setFail(fail bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail = fail
}

func (f *fakeCheckpoint) snapshot() (saves []savedCheckpoint, failures int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]savedCheckpoint(nil), f.saves...), f.failures
}

// claimRecorder is the slot-creation hand-over of ledger.Store, on a pool
// of its own for each call (each hand-over's lasting until it is closed),
// recording each finished Deliver: it reads the rows pending in the slot's
// exported snapshot of integration_outbox and gives them to the consumer,
// and keeps the hand-over record in relay_checkpoint.
type claimRecorder struct {
	url string
	// beforeDeliver, when set, runs at the start of each Deliver; its
	// error fails the Deliver.
	beforeDeliver func(ctx context.Context) error
	// afterOpen, when set, runs once OpenHandOver has imported the
	// snapshot, before the session starts streaming.
	afterOpen func(ctx context.Context)
	// beforeAggregates, when set, runs before the hand-over reads its rows;
	// its error fails the read. beforeNewestUnblocked does the same for NewestUnblocked.
	beforeAggregates      func(ctx context.Context) error
	beforeNewestUnblocked func(ctx context.Context) error
	// afterFeed, when set, runs after each slice Deliver feeds, and
	// afterFed after each call of its fed with the aggregates released.
	afterFeed func(ctx context.Context, events []*relay.Event)
	afterFed  func(aggs []relay.AggregateKey)

	mu          sync.Mutex
	snapshots   []string
	counts      []int64
	consistents []relay.LSN // each finished Deliver's consistent point
}

var _ replication.HandOver = (*claimRecorder)(nil)

func (c *claimRecorder) withStore(ctx context.Context, f func(*ledger.Store) error) error {
	pool, err := pgxpool.New(ctx, c.url)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := ledger.New(pool, ledger.DefaultConfig())
	if err != nil {
		return err
	}
	return f(store)
}

func (c *claimRecorder) BeginSlot(ctx context.Context, slot string) error {
	return c.withStore(ctx, func(s *ledger.Store) error { return s.BeginSlot(ctx, slot) })
}

func (c *claimRecorder) HandedOver(ctx context.Context, slot string) (done bool, err error) {
	err = c.withStore(ctx, func(s *ledger.Store) error {
		done, err = s.HandedOver(ctx, slot)
		return err
	})
	return done, err
}

func (c *claimRecorder) OpenHandOver(ctx context.Context, snapshot string) (relay.HandOverRows, error) {
	pool, err := pgxpool.New(ctx, c.url)
	if err != nil {
		return nil, err
	}
	store, err := ledger.New(pool, ledger.DefaultConfig())
	if err != nil {
		pool.Close()
		return nil, err
	}
	rows, err := store.OpenHandOver(ctx, snapshot)
	if err != nil {
		pool.Close()
		return nil, err
	}
	if c.afterOpen != nil {
		c.afterOpen(ctx)
	}
	return &recordedHandOver{HandOverRows: rows, c: c, pool: pool, snapshot: snapshot}, nil
}

// recordedHandOver is a claimRecorder's hand-over in progress.
type recordedHandOver struct {
	relay.HandOverRows
	c        *claimRecorder
	pool     *pgxpool.Pool
	snapshot string
}

func (r *recordedHandOver) Aggregates(ctx context.Context) ([]relay.AggregateKey, error) {
	if r.c.beforeAggregates != nil {
		if err := r.c.beforeAggregates(ctx); err != nil {
			return nil, err
		}
	}
	return r.HandOverRows.Aggregates(ctx)
}

func (r *recordedHandOver) NewestUnblocked(ctx context.Context) ([]*relay.Event, []relay.AggregateKey, error) {
	if r.c.beforeNewestUnblocked != nil {
		if err := r.c.beforeNewestUnblocked(ctx); err != nil {
			return nil, nil, err
		}
	}
	return r.HandOverRows.NewestUnblocked(ctx)
}

func (r *recordedHandOver) Deliver(ctx context.Context, slot string, consistent relay.LSN, feed func(context.Context, []*relay.Event) error, fed func([]relay.AggregateKey), settled func(context.Context) error) (int64, error) {
	if r.c.beforeDeliver != nil {
		if err := r.c.beforeDeliver(ctx); err != nil {
			r.HandOverRows.Close()
			return 0, err
		}
	}
	if f := r.c.afterFeed; f != nil {
		inner := feed
		feed = func(ctx context.Context, events []*relay.Event) error {
			err := inner(ctx, events)
			f(ctx, events)
			return err
		}
	}
	if f := r.c.afterFed; f != nil {
		inner := fed
		fed = func(aggs []relay.AggregateKey) { inner(aggs); f(aggs) }
	}
	n, err := r.HandOverRows.Deliver(ctx, slot, consistent, feed, fed, settled)
	if err != nil {
		return n, err
	}
	r.c.mu.Lock()
	defer r.c.mu.Unlock()
	r.c.snapshots = append(r.c.snapshots, r.snapshot)
	r.c.counts = append(r.c.counts, n)
	r.c.consistents = append(r.c.consistents, consistent)
	return n, nil
}

func (r *recordedHandOver) Close() {
	r.HandOverRows.Close()
	r.pool.Close()
}

func (c *claimRecorder) calls() (snapshots []string, counts []int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.snapshots...), append([]int64(nil), c.counts...)
}

// waitCalls waits until n hand-overs have been marked and returns them:
// the marking runs beside the stream.
func (c *claimRecorder) waitCalls(t *testing.T, n int) (snapshots []string, counts []int64) {
	t.Helper()
	waitFor(t, 30*time.Second, fmt.Sprintf("%d hand-overs marked", n), func() bool {
		s, _ := c.calls()
		return len(s) >= n
	})
	return c.calls()
}

// handOverStub is a hand-over for configurations that never make a slot,
// or of an outbox without rows: it marks nothing, and every slot counts as
// handed over.
type handOverStub struct{}

func (handOverStub) BeginSlot(context.Context, string) error { return nil }
func (handOverStub) OpenHandOver(context.Context, string) (relay.HandOverRows, error) {
	return noRows{}, nil
}
func (handOverStub) HandedOver(context.Context, string) (bool, error) { return true, nil }

// noRows is a hand-over of nothing.
type noRows struct{}

func (noRows) Aggregates(context.Context) ([]relay.AggregateKey, error) { return nil, nil }
func (noRows) Len() int                                                 { return 0 }
func (noRows) Pending(context.Context, []relay.AggregateKey) ([]relay.AggregateKey, error) {
	return nil, nil
}
func (noRows) NewestUnblocked(context.Context) ([]*relay.Event, []relay.AggregateKey, error) {
	return nil, nil, nil
}
func (noRows) Deliver(context.Context, string, relay.LSN, func(context.Context, []*relay.Event) error, func([]relay.AggregateKey), func(context.Context) error) (int64, error) {
	return 0, nil
}
func (noRows) Close() {}

// testEnv is a migrated database with a fresh slot name.
type testEnv struct {
	url  string
	conn *pgx.Conn
	slot string
}

func newEnv(t *testing.T) *testEnv {
	t.Helper()
	url := pgtest.NewDatabase(t)
	conn := mustConnect(t, url)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return &testEnv{url: url, conn: conn, slot: "test_" + hex.EncodeToString(b[:])}
}

func (e *testEnv) config(t *testing.T, c relay.Consumer, cp relay.Checkpoint, claim *claimRecorder) replication.Config {
	return replication.Config{
		ConnString:  e.url,
		Slot:        e.slot,
		Publication: "outbox_relay",
		Outbox:      relay.QualifiedName{Name: "integration_outbox"},
		Consumer:    c,
		Checkpoint:  cp,
		HandOver:    claim,
		Logger:      testLogger(t),
	}
}

// confirmed returns the slot's confirmed_flush_lsn (0 when it is missing).
func (e *testEnv) confirmed(t *testing.T) relay.LSN {
	t.Helper()
	_, _, lsn, _, err := replication.SlotInfo(context.Background(), e.conn, e.slot)
	if err != nil {
		t.Fatalf("slot info: %v", err)
	}
	return lsn
}

// observer returns a fakeCheckpoint.observe that reads the slot's confirmed
// position on a connection of its own.
func (e *testEnv) observer(t *testing.T) func(ctx context.Context) relay.LSN {
	conn := mustConnect(t, e.url)
	var mu sync.Mutex
	return func(ctx context.Context) relay.LSN {
		mu.Lock()
		defer mu.Unlock()
		_, _, lsn, _, err := replication.SlotInfo(ctx, conn, e.slot)
		if err != nil {
			t.Errorf("observe slot: %v", err)
		}
		return lsn
	}
}

func (e *testEnv) currentLSN(t *testing.T) relay.LSN {
	t.Helper()
	var lsn relay.LSN
	if err := e.conn.QueryRow(context.Background(), "SELECT pg_current_wal_lsn()::text").Scan(&lsn); err != nil {
		t.Fatalf("pg_current_wal_lsn: %v", err)
	}
	return lsn
}

// insert inserts one outbox row per key in one transaction and returns
// pg_current_wal_lsn() read after the commit.
func (e *testEnv) insert(t *testing.T, keys ...string) relay.LSN {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.conn, func(tx pgx.Tx) error {
		for _, k := range keys {
			if _, err := tx.Exec(ctx, `INSERT INTO integration_outbox (event_key, event_type, aggregate_type, aggregate_id, payload)
			                           VALUES ($1, 'test.event', 'test', $1, jsonb_build_object('key', $1::text))`, k); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("insert %v: %v", keys, err)
	}
	return e.currentLSN(t)
}

func mustConnect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func mustExec(t *testing.T, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// running is a Source's Run on its own goroutine.
type running struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

// start runs a Source for cfg until the test ends or stop is called; Run
// must then return nil.
func start(t *testing.T, cfg replication.Config) *running {
	t.Helper()
	src, err := replication.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- src.Run(ctx) }()
	t.Cleanup(func() {
		if err := r.stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return r
}

func (r *running) stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(30 * time.Second):
			r.err = errors.New("Run did not return within 30s of cancellation")
		}
	})
	return r.err
}

// waitFor polls cond until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitStreaming waits until the source has restarted the consumer n times
// (it then starts streaming).
func waitStreaming(t *testing.T, c *fakeConsumer, n int) {
	t.Helper()
	waitFor(t, 30*time.Second, "the source to restart the consumer", func() bool { return c.restartCount() >= n })
}

// logBuffer collects log output for inspection, and copies it to the test log.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func testLogger(t *testing.T) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.DebugLevel).With().Timestamp().Logger()
}

// mustStore is ledger.New, failing the test on an error.
func mustStore(tb testing.TB, pool *pgxpool.Pool, cfg ledger.Config) *ledger.Store {
	tb.Helper()
	s, err := ledger.New(pool, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return s
}
