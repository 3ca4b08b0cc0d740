package claim_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
)

// TestMain fails the package when a test leaves a goroutine behind
// (docs/architecture.md, "Goroutines and their owners").
func TestMain(m *testing.M) { goleak.VerifyTestMain(pgtest.Wrap(m)) }

// fixture is a fresh migrated database and a pool on it.
type fixture struct {
	url  string
	pool *pgxpool.Pool
}

// MustFixture creates a database on the package's shared cluster and
// migrates it with the default names.
func MustFixture(tb testing.TB) *fixture {
	tb.Helper()
	return MustFixtureAt(tb, pgtest.NewDatabase(tb))
}

// MustFixtureAt migrates the database at url and opens a pool on it.
func MustFixtureAt(tb testing.TB, url string) *fixture {
	tb.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		tb.Fatalf("pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	return &fixture{url: url, pool: pool}
}

// MustExec runs sql.
func (f *fixture) MustExec(tb testing.TB, sql string, args ...any) int64 {
	tb.Helper()
	tag, err := f.pool.Exec(context.Background(), sql, args...)
	if err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	return tag.RowsAffected()
}

// MustInt runs a query returning one integer.
func (f *fixture) MustInt(tb testing.TB, sql string, args ...any) int64 {
	tb.Helper()
	var n int64
	if err := f.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
	return n
}

// event is an outbox row to insert. Empty fields take these defaults:
// event_type 'order.placed', payload '{}', status pending, not diverted.
type event struct {
	Key      string
	Type     *string
	NullType bool
	AggType  string // "" inserts NULL aggregate fields
	AggID    string
	Payload  string
	Status   string
	Diverted bool
	Age      time.Duration // created_at = available_at = now() - Age
}

func ptr[T any](v T) *T { return &v }

// MustInsert inserts events in order and returns their ids.
func (f *fixture) MustInsert(tb testing.TB, events ...event) []int64 {
	tb.Helper()
	ids := make([]int64, len(events))
	for i, e := range events {
		typ := e.Type
		if typ == nil && !e.NullType {
			typ = ptr("order.placed")
		}
		var aggType, aggID *string
		if e.AggType != "" {
			aggType, aggID = &e.AggType, &e.AggID
		}
		payload, status := e.Payload, e.Status
		if payload == "" {
			payload = "{}"
		}
		if status == "" {
			status = "pending"
		}
		err := f.pool.QueryRow(context.Background(), `
			INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, handoff_at,
			                                created_at, available_at)
			VALUES ($1, $2, $3, $4, $5::jsonb, $6, CASE WHEN $7 THEN now() END,
			        now() - $8::bigint * interval '1 millisecond', now() - $8::bigint * interval '1 millisecond')
			RETURNING id`,
			typ, aggType, aggID, e.Key, payload, status, e.Diverted, e.Age.Milliseconds()).Scan(&ids[i])
		if err != nil {
			tb.Fatalf("insert %s: %v", e.Key, err)
		}
	}
	return ids
}

// MustInsertMany inserts n pending rows keyed prefix-1 … prefix-n over aggs
// aggregates (row g belongs to aggregate agg-(g % aggs); 0 aggs: NULL
// aggregate), in one statement.
func (f *fixture) MustInsertMany(tb testing.TB, prefix string, n, aggs int, diverted bool) {
	tb.Helper()
	f.MustExec(tb, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, handoff_at)
		SELECT 'order.placed',
		       CASE WHEN $3 > 0 THEN 'order' END,
		       CASE WHEN $3 > 0 THEN 'agg-' || (g % $3) END,
		       $1 || '-' || g, jsonb_build_object('n', g), CASE WHEN $4 THEN now() END
		  FROM generate_series(1, $2::int) AS g ORDER BY g`, prefix, n, aggs, diverted)
}

// row is what the tests check of an outbox row.
type row struct {
	ID        int64
	Key       string
	Status    string
	Attempts  int
	LastError *string
	Diverted  bool
	LockedBy  *string
}

// MustRows returns the outbox rows by event_key.
func (f *fixture) MustRows(tb testing.TB) map[string]row {
	tb.Helper()
	rows, err := f.pool.Query(context.Background(), `
		SELECT id, event_key, status, attempts, last_error, handoff_at IS NOT NULL, locked_by FROM integration_outbox`)
	if err != nil {
		tb.Fatalf("read rows: %v", err)
	}
	out := map[string]row{}
	var r row
	_, err = pgx.ForEachRow(rows, []any{&r.ID, &r.Key, &r.Status, &r.Attempts, &r.LastError, &r.Diverted, &r.LockedBy}, func() error {
		out[r.Key] = r
		return nil
	})
	if err != nil {
		tb.Fatalf("read rows: %v", err)
	}
	return out
}

// MustRow returns one outbox row.
func (f *fixture) MustRow(tb testing.TB, key string) row {
	tb.Helper()
	r, ok := f.MustRows(tb)[key]
	if !ok {
		tb.Fatalf("no row %s", key)
	}
	return r
}

// ledgerPair is a ledger row.
type ledgerPair struct {
	State    string
	Attempts int
	Owner    *string
	Detail   *string
}

// MustLedger returns the ledger by (event_key, action).
func (f *fixture) MustLedger(tb testing.TB) map[relay.LedgerKey]ledgerPair {
	tb.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT event_key, action, state, attempts, owner, detail FROM integration_idempotency`)
	if err != nil {
		tb.Fatalf("read ledger: %v", err)
	}
	out := map[relay.LedgerKey]ledgerPair{}
	var k relay.LedgerKey
	var p ledgerPair
	_, err = pgx.ForEachRow(rows, []any{&k.EventKey, &k.Action, &p.State, &p.Attempts, &p.Owner, &p.Detail}, func() error {
		out[k] = p
		return nil
	})
	if err != nil {
		tb.Fatalf("read ledger: %v", err)
	}
	return out
}

// MustStatusCount counts rows with status.
func (f *fixture) MustStatusCount(tb testing.TB, status string) int64 {
	tb.Helper()
	return f.MustInt(tb, `SELECT count(*) FROM integration_outbox WHERE status = $1`, status)
}

// call is one Send the fake sink received.
type call struct {
	ID      int64
	Key     string
	Attempt int
	Replay  int
	At      time.Time
	Body    []byte
	Err     error
}

// fakeSink answers each Send with send (nil: delivered) on its own
// goroutine, at most 32 at a time, and records every call.
type fakeSink struct {
	name   string
	send   func(d *relay.Delivery) error
	window chan struct{}

	mu    sync.Mutex
	calls []call
}

var _ relay.Sink = (*fakeSink)(nil)

func newFakeSink(name string, send func(d *relay.Delivery) error) *fakeSink {
	if send == nil {
		send = func(*relay.Delivery) error { return nil }
	}
	return &fakeSink{name: name, send: send, window: make(chan struct{}, 32)}
}

func (s *fakeSink) Name() string { return s.name }

func (s *fakeSink) Send(ctx context.Context, d *relay.Delivery, done func(error)) {
	select {
	case s.window <- struct{}{}:
	case <-ctx.Done():
		done(relay.TransientError(fmt.Errorf("%s: not sent: %w", s.name, ctx.Err()), 0))
		return
	}
	go func() {
		at := time.Now()
		err := s.send(d)
		s.mu.Lock()
		s.calls = append(s.calls, call{ID: d.Event.ID, Key: d.Event.EventKey, Attempt: d.Attempt, Replay: d.Replay, At: at,
			Body: slices.Clone(d.Body), Err: err})
		s.mu.Unlock()
		<-s.window
		done(err)
	}()
}

func (s *fakeSink) Close(context.Context) error { return nil }

// Calls returns a copy of the calls so far.
func (s *fakeSink) Calls() []call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

// Delivered counts successful calls by event_key.
func (s *fakeSink) Delivered() map[string]int {
	out := map[string]int{}
	for _, c := range s.Calls() {
		if c.Err == nil {
			out[c.Key]++
		}
	}
	return out
}

// testLogger writes warnings and errors to the test log.
func testLogger(tb testing.TB) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(tb)).Level(zerolog.WarnLevel).With().Timestamp().Logger()
}

// options configures the relay under test: what cmd/outbox-relay builds
// from the configuration (a ledger.Store, a relay.Engine and a
// claim.Source over them). Zero values take the defaults of each part.
type options struct {
	// Routes are the sinks; the store's ordering check routes with the
	// same globs.
	Routes []relay.Route
	// The claim source (claim.Config).
	All          bool
	BatchSize    int
	PollInterval time.Duration
	// LockTimeout is the lease of the source's sweeper and of the engine's
	// ledger claims (source.lock_timeout sets both).
	LockTimeout time.Duration
	SweepAfter  time.Duration
	// Owner is the engine's and the source's owner [ledger.NewOwner()].
	Owner  string
	Notify string
	// The engine and the store.
	Unordered      bool
	InlineAttempts int
	MaxAttempts    int
	Backoff        []time.Duration
	LaneCapacity   int
	MaxUnsettled   int
}

// rig is the relay under test: a store, an engine running until the test
// ends and, from MustStart, a claim source running over them.
type rig struct {
	*claim.Source // nil from MustEngine
	Engine        *relay.Engine
	Store         *ledger.Store
	opts          options
	lsn           atomic.Uint64 // the last stream position MustStream used
}

// Owner is the owner id of the engine and its source.
func (r *rig) Owner() string { return r.opts.Owner }

// newRig builds the store and the engine on f's pool, logging to the test;
// nothing runs yet.
func newRig(tb testing.TB, f *fixture, o options) *rig {
	tb.Helper()
	if o.Owner == "" {
		o.Owner = ledger.NewOwner()
	}
	lcfg := ledger.DefaultConfig()
	lcfg.Unordered = o.Unordered
	store := mustStore(tb, f.pool, lcfg)
	engine, err := relay.NewEngine(relay.EngineConfig{
		Routes:       o.Routes,
		Policy:       relay.Policy{InlineAttempts: o.InlineAttempts, MaxAttempts: o.MaxAttempts, Backoff: o.Backoff},
		Unordered:    o.Unordered,
		LaneCapacity: o.LaneCapacity,
		MaxUnsettled: o.MaxUnsettled,
		Stream:       store,
		Claim:        store,
		Owner:        o.Owner,
		ClaimLease:   o.LockTimeout,
		Logger:       testLogger(tb),
	})
	if err != nil {
		tb.Fatalf("new engine: %v", err)
	}
	return &rig{Engine: engine, Store: store, opts: o}
}

// SourceConfig is the claim source's configuration for this rig, on store
// (nil: the rig's).
func (r *rig) SourceConfig(tb testing.TB, store claim.Store) claim.Config {
	if store == nil {
		store = r.Store
	}
	o := r.opts
	return claim.Config{Engine: r.Engine, Store: store, All: o.All, BatchSize: o.BatchSize, PollInterval: o.PollInterval,
		LockTimeout: o.LockTimeout, SweepAfter: o.SweepAfter, Owner: o.Owner, Notify: o.Notify, Logger: testLogger(tb)}
}

// runEngine runs the engine until the test ends; cleanup drains it (every
// outcome written), then stops it, as the supervisor ends a term. It is
// registered before the source's cleanup, so it runs after it.
func (r *rig) runEngine(tb testing.TB) {
	tb.Helper()
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Engine.Run(ctx) }()
	tb.Cleanup(func() {
		drainCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := r.Engine.Drain(drainCtx); err != nil {
			tb.Errorf("engine drain: %v", err)
		}
		stop()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			tb.Errorf("engine run: %v", err)
		}
	})
}

// runSource runs src until the test ends; cleanup cancels it and waits for
// Run, which returns once the engine has settled every row it claimed.
func runSource(tb testing.TB, src *claim.Source) {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	tb.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			tb.Errorf("claim source run: %v", err)
		}
	})
}

// MustEngine builds the store and the engine on f's pool and runs the
// engine until the test ends, without a claim source.
func MustEngine(tb testing.TB, f *fixture, o options) *rig {
	tb.Helper()
	r := newRig(tb, f, o)
	r.runEngine(tb)
	return r
}

// MustStart builds the relay's claim path on f's pool — store, engine and
// claim source — and runs it until the test ends. Cleanup stops it in the
// supervisor's order: the source (after its claimed rows settle), then the
// engine's drain, then the engine.
func MustStart(tb testing.TB, f *fixture, o options) *rig {
	tb.Helper()
	r := newRig(tb, f, o)
	r.mustStartOn(tb, nil)
	return r
}

// mustStartOn runs r's engine and a claim source of r on store (nil: the
// rig's) until the test ends.
func (r *rig) mustStartOn(tb testing.TB, store claim.Store) {
	tb.Helper()
	// Before the engine runs: New registers the source's wake-up with it.
	src, err := claim.New(r.SourceConfig(tb, store))
	if err != nil {
		tb.Fatalf("new claim source: %v", err)
	}
	r.Source = src
	r.runEngine(tb)
	runSource(tb, src)
}

// mustEvent reads row key as the stream would decode it.
func (f *fixture) mustEvent(tb testing.TB, key string) *relay.Event {
	tb.Helper()
	ev := &relay.Event{}
	var created, avail pgtype.Timestamptz
	err := f.pool.QueryRow(context.Background(), `SELECT id, event_key, event_type, aggregate_type, aggregate_id, payload::text,
		created_at, available_at FROM integration_outbox WHERE event_key = $1`, key).Scan(&ev.ID, &ev.EventKey, &ev.EventType,
		&ev.AggregateType, &ev.AggregateID, &ev.Payload, &created, &avail)
	if err != nil {
		tb.Fatalf("read %s: %v", key, err)
	}
	ev.CreatedAt, ev.AvailableAt = created.Time, avail.Time
	return ev
}

// MustStream inserts one pending row per key (aggregate order/agg, payload
// {"k": key}) and submits them to the engine's stream Consumer as one
// transaction, as the replication source would decode it.
func (r *rig) MustStream(tb testing.TB, f *fixture, agg string, keys ...string) {
	tb.Helper()
	var events []event
	for _, k := range keys {
		events = append(events, event{Key: k, AggType: "order", AggID: agg, Payload: `{"k": "` + k + `"}`})
	}
	f.MustInsert(tb, events...)
	lsn := relay.LSN(r.lsn.Add(1000))
	var evs []*relay.Event
	for _, k := range keys {
		ev := f.mustEvent(tb, k)
		ev.CommitLSN, ev.CommitTime = lsn, time.Now()
		evs = append(evs, ev)
	}
	if err := r.Engine.Stream().Submit(context.Background(), evs); err != nil {
		tb.Fatalf("submit %v to the stream: %v", keys, err)
	}
	r.Engine.Stream().Commit(lsn + 1)
}

// waitFor polls cond every 20 ms until it holds, failing tb after timeout.
func waitFor(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// routes wraps sinks in routes that take every event.
func routes(sinks ...relay.Sink) []relay.Route {
	out := make([]relay.Route, len(sinks))
	for i, s := range sinks {
		out[i] = relay.Route{Sink: s}
	}
	return out
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
