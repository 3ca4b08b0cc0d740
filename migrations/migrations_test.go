package migrations_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// seedSQL is the table n8n pollers use, as users already have it.
const seedSQL = `
CREATE TABLE integration_outbox (
  id bigserial PRIMARY KEY, event_type text, aggregate_type text, aggregate_id text,
  event_key text NOT NULL UNIQUE, payload jsonb, status text DEFAULT 'pending',
  attempts int DEFAULT 0, available_at timestamptz DEFAULT now(), locked_at timestamptz,
  locked_by text, last_error text, created_at timestamptz DEFAULT now(), processed_at timestamptz);
CREATE INDEX idx_outbox_status ON integration_outbox (status, available_at, created_at);
CREATE INDEX idx_outbox_aggregate ON integration_outbox (aggregate_type, aggregate_id, created_at);
INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, attempts)
SELECT 'lead.created', 'lead', 'L' || (g % 7), 'seed-' || g, jsonb_build_object('n', g),
       (ARRAY['pending','processing','done','failed'])[1 + g % 4], g % 3
  FROM generate_series(1, 200) g;`

func mustConnect(tb testing.TB, url string) *pgx.Conn {
	tb.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	tb.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func mustExec(tb testing.TB, conn *pgx.Conn, sql string, args ...any) {
	tb.Helper()
	if _, err := conn.Exec(context.Background(), sql, args...); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
}

func mustMigrate(tb testing.TB, conn *pgx.Conn, opts migrations.Options) migrations.Result {
	tb.Helper()
	if opts.Names == (migrations.Names{}) {
		opts.Names = migrations.DefaultNames()
	}
	res, err := migrations.Migrate(context.Background(), conn, opts)
	if err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	return res
}

// catalogState is everything migrate could change, as text: the relations,
// their indexes and validity, the function, the publication and its tables.
func catalogState(tb testing.TB, conn *pgx.Conn) string {
	tb.Helper()
	var state string
	err := conn.QueryRow(context.Background(), `
		SELECT concat_ws(E'\n',
		  (SELECT string_agg(c.oid || ' ' || c.relname || ' ' || c.relkind::text || ' ' || c.relfilenode || ' ' || c.xmin, E'\n' ORDER BY c.relname)
		     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname NOT IN ('pg_catalog','information_schema','pg_toast')),
		  (SELECT string_agg(i.indexrelid::regclass || ' ' || i.indisvalid, E'\n' ORDER BY i.indexrelid::regclass::text) FROM pg_index i
		     JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public'),
		  (SELECT string_agg(p.oid || ' ' || p.proname || ' ' || p.xmin, E'\n' ORDER BY p.proname) FROM pg_proc p
		     JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public'),
		  (SELECT string_agg(pubname || ' ' || p.xmin, E'\n' ORDER BY pubname) FROM pg_publication p),
		  (SELECT string_agg(tablename, E'\n' ORDER BY tablename) FROM pg_publication_tables))`).Scan(&state)
	if err != nil {
		tb.Fatalf("read catalog: %v", err)
	}
	return state
}

// outboxRows returns every row with its xmin: an UPDATE, even one writing the
// same values, gives a row a new xmin.
func outboxRows(tb testing.TB, conn *pgx.Conn) string {
	tb.Helper()
	var rows string
	err := conn.QueryRow(context.Background(),
		`SELECT coalesce(string_agg(o.xmin || ' ' || (o.id, o.event_type, o.aggregate_type, o.aggregate_id, o.event_key, o.payload,
		   o.status, o.attempts, o.available_at, o.locked_at, o.locked_by, o.last_error, o.created_at, o.processed_at)::text, E'\n' ORDER BY o.id), '')
		   FROM integration_outbox o`).Scan(&rows)
	if err != nil {
		tb.Fatalf("read outbox: %v", err)
	}
	return rows
}

func TestMigrate_EmptyDatabase(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))

	res := mustMigrate(t, conn, migrations.Options{})
	if latest := migrations.Latest(); res.From != 0 || res.To != latest || len(res.Applied) != int(latest) {
		t.Fatalf("first run: from %d to %d applied %v, want 0 → %d, every migration", res.From, res.To, res.Applied, latest)
	}
	if !res.PublicationCreated || res.PublicationSkipped != "" {
		t.Fatalf("publication: created=%v skipped=%q", res.PublicationCreated, res.PublicationSkipped)
	}

	for _, rel := range []string{"integration_outbox", "integration_idempotency", "relay_checkpoint",
		"integration_outbox_conflicts", "integration_outbox_relay_version",
		"integration_outbox_relay_unsettled_idx", "integration_outbox_relay_claim_idx",
		"integration_outbox_status_available_at_created_at_idx", "integration_outbox_aggregate_created_at_idx"} {
		var ok bool
		if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", rel).Scan(&ok); err != nil || !ok {
			t.Errorf("%s missing (err %v)", rel, err)
		}
	}
	var handoff bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'integration_outbox'::regclass
		AND attname = 'handoff_at' AND NOT attnotnull)`).Scan(&handoff); err != nil || !handoff {
		t.Errorf("nullable handoff_at column missing (err %v)", err)
	}
	var replays bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'integration_outbox'::regclass
		AND attname = 'replays' AND atttypid = 'int4'::regtype AND NOT attnotnull AND NOT atthasdef)`).Scan(&replays); err != nil || !replays {
		t.Errorf("nullable replays int column without default missing (err %v)", err)
	}
	var orderDef string
	if err := conn.QueryRow(ctx, "SELECT pg_get_indexdef('integration_outbox_relay_unsettled_idx'::regclass)").Scan(&orderDef); err != nil {
		t.Fatal(err)
	}
	// A NULL status is pending: the order index holds such rows too.
	if !strings.Contains(orderDef, "(aggregate_type, aggregate_id, id)") || !strings.Contains(orderDef, "'pending'::text, 'processing'::text, 'held'::text") ||
		!strings.Contains(orderDef, "OR (status IS NULL)") {
		t.Errorf("ordering index: %s", orderDef)
	}
	var pubInsert, pubUpdate, pubDelete bool
	if err := conn.QueryRow(ctx, `SELECT pubinsert, pubupdate, pubdelete FROM pg_publication p
		JOIN pg_publication_tables t ON t.pubname = p.pubname AND t.tablename = 'integration_outbox'
		WHERE p.pubname = 'outbox_relay'`).Scan(&pubInsert, &pubUpdate, &pubDelete); err != nil {
		t.Fatalf("publication: %v", err)
	}
	if !pubInsert || pubUpdate || pubDelete {
		t.Errorf("publication publishes insert=%v update=%v delete=%v, want inserts only", pubInsert, pubUpdate, pubDelete)
	}

	before := catalogState(t, conn)
	res = mustMigrate(t, conn, migrations.Options{})
	if latest := migrations.Latest(); res.From != latest || res.To != latest || len(res.Applied) != 0 || res.PublicationCreated || res.Retries != 0 {
		t.Fatalf("second run is not a no-op: %+v", res)
	}
	if after := catalogState(t, conn); after != before {
		t.Fatalf("second run changed the catalog:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

func TestMigrate_SeedTableRowsSurvive(t *testing.T) {
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustExec(t, conn, seedSQL)
	before := outboxRows(t, conn)

	var log bytes.Buffer
	res := mustMigrate(t, conn, migrations.Options{Logger: zerolog.New(&log)})
	if after := outboxRows(t, conn); after != before {
		t.Fatalf("migrate changed existing rows")
	}
	// The log and the result say the table was adopted, not created.
	if !res.Adopted || !strings.Contains(log.String(), `"message":"adopting the existing table: `) ||
		strings.Contains(log.String(), `"migration":"001_outbox_table","table":"public.integration_outbox","message":"applying migration"`) {
		t.Errorf("adopted %v; log:\n%s", res.Adopted, log.String())
	}
	// The user's own indexes stay; the seed-shaped ones are not duplicated.
	var indexes string
	if err := conn.QueryRow(context.Background(), `SELECT string_agg(indexrelid::regclass::text || ':' || indisvalid, ' ' ORDER BY indexrelid::regclass::text)
		FROM pg_index WHERE indrelid = 'integration_outbox'::regclass`).Scan(&indexes); err != nil {
		t.Fatal(err)
	}
	want := "idx_outbox_aggregate:true idx_outbox_status:true integration_outbox_event_key_key:true integration_outbox_pkey:true " +
		"integration_outbox_relay_claim_idx:true integration_outbox_relay_dead_idx:true integration_outbox_relay_handoff_idx:true integration_outbox_relay_unsettled_idx:true"
	if indexes != want {
		t.Fatalf("indexes:\n got %s\nwant %s", indexes, want)
	}
	var n int
	if err := conn.QueryRow(context.Background(), "SELECT outbox_publish('lead.created', 'lead', 'L1', 'seed-1', '{\"n\": 1}')").Scan(new(string)); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(context.Background(), "SELECT count(*) FROM integration_outbox").Scan(&n); err != nil || n != 200 {
		t.Fatalf("rows after publishing an existing key: %d (err %v)", n, err)
	}
}

func TestMigrate_RefusesOtherShapes(t *testing.T) {
	tests := []struct {
		name   string
		create string
		column string
	}{
		{"missing column", `CREATE TABLE integration_outbox (id bigserial PRIMARY KEY, event_type text, aggregate_type text,
			aggregate_id text, payload jsonb, status text, attempts int, available_at timestamptz, locked_at timestamptz,
			locked_by text, last_error text, created_at timestamptz, processed_at timestamptz)`, "event_key"},
		{"json not jsonb", `CREATE TABLE integration_outbox (id bigserial PRIMARY KEY, event_type text, aggregate_type text,
			aggregate_id text, event_key text NOT NULL UNIQUE, payload json, status text, attempts int, available_at timestamptz,
			locked_at timestamptz, locked_by text, last_error text, created_at timestamptz, processed_at timestamptz)`, "payload"},
		{"timestamp without time zone", `CREATE TABLE integration_outbox (id bigserial PRIMARY KEY, event_type text, aggregate_type text,
			aggregate_id text, event_key text NOT NULL UNIQUE, payload jsonb, status text, attempts int, available_at timestamptz,
			locked_at timestamptz, locked_by text, last_error text, created_at timestamp, processed_at timestamptz)`, "created_at"},
		{"event_key not unique", `CREATE TABLE integration_outbox (id bigserial PRIMARY KEY, event_type text, aggregate_type text,
			aggregate_id text, event_key text NOT NULL, payload jsonb, status text, attempts int, available_at timestamptz,
			locked_at timestamptz, locked_by text, last_error text, created_at timestamptz, processed_at timestamptz)`, "event_key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			conn := mustConnect(t, pgtest.NewDatabase(t))
			mustExec(t, conn, tt.create)
			_, err := migrations.Migrate(context.Background(), conn, migrations.Options{Names: migrations.DefaultNames()})
			var shape *migrations.ShapeError
			if !errors.As(err, &shape) || len(shape.Problems) != 1 || shape.Problems[0].Column != tt.column {
				t.Fatalf("err = %v, want a ShapeError naming %q", err, tt.column)
			}
			if !strings.Contains(err.Error(), `"`+tt.column+`"`) {
				t.Fatalf("error %q does not name the column", err)
			}
		})
	}
}

// TestMigrate_ListsEveryDifference: a table that differs from the seed shape
// in several ways is refused once, with every difference and the statement
// that fixes each; run as written, those statements make the next migrate
// adopt the table.
func TestMigrate_ListsEveryDifference(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustExec(t, conn, `CREATE TABLE integration_outbox (id bigserial PRIMARY KEY, event_type text, aggregate_type text,
		aggregate_id text, event_key text NOT NULL UNIQUE, payload text, status text DEFAULT 'pending', attempts int DEFAULT 0,
		available_at timestamptz DEFAULT now(), locked_at timestamptz, last_error text, created_at timestamp DEFAULT now(),
		processed_at timestamptz)`)
	mustExec(t, conn, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		VALUES ('order.placed', 'order', '1', 'k1', '{"n": 1}')`)

	_, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()})
	var shape *migrations.ShapeError
	if !errors.As(err, &shape) {
		t.Fatalf("err = %v, want a ShapeError", err)
	}
	t.Logf("migrate: %v", err)
	want := map[string]string{
		"payload":    `ALTER TABLE "public"."integration_outbox" ALTER COLUMN "payload" TYPE jsonb USING "payload"::jsonb;`,
		"locked_by":  `ALTER TABLE "public"."integration_outbox" ADD COLUMN "locked_by" text;`,
		"created_at": `ALTER TABLE "public"."integration_outbox" ALTER COLUMN "created_at" TYPE timestamptz USING "created_at" AT TIME ZONE 'UTC';`,
	}
	if len(shape.Problems) != len(want) {
		t.Errorf("%d problems, want %d: %+v", len(shape.Problems), len(want), shape.Problems)
	}
	for _, p := range shape.Problems {
		fix, ok := want[p.Column]
		if !ok || p.Fix != fix {
			t.Errorf("column %q (%s): fix %q, want %q", p.Column, p.Reason, p.Fix, fix)
		}
	}
	for _, w := range []string{`column "payload" has type text, want jsonb`, `column "locked_by" is missing`,
		want["payload"], want["locked_by"], want["created_at"], "rewrites the table"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("the error does not say %q", w)
		}
	}

	for _, p := range shape.Problems {
		mustExec(t, conn, p.Fix)
	}
	res := mustMigrate(t, conn, migrations.Options{})
	if !res.Adopted || res.To != migrations.Latest() {
		t.Fatalf("after the fixes: %+v, want the table adopted and migrated", res)
	}
	var payload string
	if err := conn.QueryRow(ctx, `SELECT payload->>'n' FROM integration_outbox WHERE event_key = 'k1'`).Scan(&payload); err != nil || payload != "1" {
		t.Fatalf("the row after the fixes: %q, %v", payload, err)
	}
}

// TestMigrate_HostileNames shows that names with quotes, semicolons and spaces
// are used as quoted identifiers: nothing is injected, and everything works.
func TestMigrate_HostileNames(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustExec(t, conn, `CREATE SCHEMA "my schema"`)
	mustExec(t, conn, `CREATE TABLE canary (x int)`)

	names := migrations.Names{
		Outbox:          relay.MustParseQualifiedName(`my schema.out"; DROP TABLE canary; --`),
		Ledger:          relay.MustParseQualifiedName(`my schema.led $relay$ ger`),
		Checkpoint:      relay.MustParseQualifiedName(`check'point`),
		Conflicts:       relay.MustParseQualifiedName(`my schema.con$relay$flicts`),
		PublishFunction: relay.MustParseQualifiedName(`my schema.pub"lish`),
		Publication:     `pub"; DROP TABLE canary; --`,
	}
	mustMigrate(t, conn, migrations.Options{Names: names, NotifyTrigger: true})
	mustMigrate(t, conn, migrations.Options{Names: names, NotifyTrigger: true})

	var result string
	if err := conn.QueryRow(ctx, `SELECT "my schema"."pub""lish"('t', 'a', '1', 'k1', '{}')`).Scan(&result); err != nil || result != "inserted" {
		t.Fatalf("publish: %q %v", result, err)
	}
	if err := conn.QueryRow(ctx, `SELECT "my schema"."pub""lish"('t', 'a', '1', 'k1', '{"x":1}')`).Scan(&result); err != nil || result != "conflict" {
		t.Fatalf("publish conflict: %q %v", result, err)
	}
	if err := conn.QueryRow(ctx, `SELECT "my schema"."pub""lish"('t', 'a', '1', 'k2', '{}', '{"traceparent":"x"}')`).Scan(&result); err != nil || result != "inserted" {
		t.Fatalf("publish with a trace context: %q %v", result, err)
	}
	var n int
	if err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM canary) + (SELECT count(*) FROM "my schema"."con$relay$flicts")`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("canary or conflicts table: n=%d err=%v", n, err)
	}
}

func TestMigrate_RebuildsInvalidIndex(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	conn := mustConnect(t, url)
	mustMigrate(t, conn, migrations.Options{})

	// What an interrupted CREATE INDEX CONCURRENTLY leaves: the index is in
	// the catalog but not valid, so IF NOT EXISTS alone would keep it.
	mustExec(t, conn, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'integration_outbox_relay_claim_idx'::regclass`)
	mustExec(t, conn, `UPDATE integration_outbox_relay_version SET version = 2`)
	var oldOID uint32
	if err := conn.QueryRow(ctx, "SELECT 'integration_outbox_relay_claim_idx'::regclass::oid").Scan(&oldOID); err != nil {
		t.Fatal(err)
	}

	res := mustMigrate(t, conn, migrations.Options{})
	if res.From != 2 || res.To != migrations.Latest() {
		t.Fatalf("from %d to %d, want 2 → %d", res.From, res.To, migrations.Latest())
	}
	var valid bool
	var newOID uint32
	if err := conn.QueryRow(ctx, `SELECT indisvalid, indexrelid FROM pg_index WHERE indexrelid = 'integration_outbox_relay_claim_idx'::regclass`).Scan(&valid, &newOID); err != nil {
		t.Fatal(err)
	}
	if !valid || newOID == oldOID {
		t.Fatalf("index valid=%v rebuilt=%v, want a new valid index", valid, newOID != oldOID)
	}
}

// TestMigrate_DoesNotBlockWriters runs migrate on a seed table while a writer
// keeps inserting and another session holds a transaction open on the table.
// The DDL that needs a strong lock waits at most lock_timeout, so no insert
// waits longer than that; migrate retries and completes after the long
// transaction ends.
func TestMigrate_DoesNotBlockWriters(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	conn := mustConnect(t, url)
	mustExec(t, conn, seedSQL)

	const lockTimeout = 500 * time.Millisecond
	const holdFor = 4 * time.Second

	// A reader that keeps its transaction (and ACCESS SHARE lock) open.
	long := mustConnect(t, url)
	mustExec(t, long, "BEGIN")
	mustExec(t, long, "SELECT count(*) FROM integration_outbox")
	var longEnded atomic.Int64
	longDone := make(chan struct{})
	go func() {
		defer close(longDone)
		time.Sleep(holdFor)
		longEnded.Store(time.Now().UnixNano())
		long.Exec(ctx, "COMMIT")
	}()
	// The connection's cleanup must not close it under the COMMIT.
	defer func() { <-longDone }()

	writer := mustConnect(t, url)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var inserts, failures atomic.Int64
	var maxWait atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			start := time.Now()
			_, err := writer.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
				VALUES ('w', 'w', 'w', $1, '{}')`, fmt.Sprintf("writer-%d", i))
			if err != nil {
				failures.Add(1)
				t.Errorf("insert %d: %v", i, err)
				continue
			}
			inserts.Add(1)
			if d := int64(time.Since(start)); d > maxWait.Load() {
				maxWait.Store(d)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()

	time.Sleep(200 * time.Millisecond)
	res, err := migrations.Migrate(ctx, conn, migrations.Options{
		Names: migrations.DefaultNames(), LockTimeout: lockTimeout, Timeout: time.Minute,
		Logger: zerolog.New(zerolog.NewTestWriter(t)),
	})
	finished := time.Now()
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if res.Retries == 0 {
		t.Fatalf("migrate never hit the lock timeout: the test did not exercise the retry")
	}
	if ended := longEnded.Load(); ended == 0 || finished.UnixNano() < ended {
		t.Fatalf("migrate finished before the long transaction ended")
	}
	if failures.Load() != 0 || inserts.Load() < 50 {
		t.Fatalf("inserts: %d ok, %d failed", inserts.Load(), failures.Load())
	}
	// A little slack over lock_timeout for the insert itself and scheduling.
	if w := time.Duration(maxWait.Load()); w > lockTimeout+300*time.Millisecond {
		t.Fatalf("an insert waited %v, longer than lock_timeout %v", w, lockTimeout)
	}
	t.Logf("migrate retried %d times; %d inserts, longest %v", res.Retries, inserts.Load(), time.Duration(maxWait.Load()))
}

func publish(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, key, payload string) (string, error) {
	var result string
	err := q.QueryRow(ctx, "SELECT outbox_publish('lead.created', 'lead', 'L1', $1, $2::jsonb)", key, payload).Scan(&result)
	return result, err
}

// TestOutboxPublish_Protocol is the receiver protocol: inserted, duplicate,
// conflict.
func TestOutboxPublish_Protocol(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustMigrate(t, conn, migrations.Options{})

	steps := []struct {
		name, key, payload, want string
	}{
		{"D1 new key", "A", `{"lead":"L1"}`, "inserted"},
		{"D2 same key and payload", "A", `{"lead":"L1"}`, "duplicate"},
		{"D3 same key, other payload", "A", `{"lead":"OTHER"}`, "conflict"},
		{"D4 other key", "B", `{"lead":"L2"}`, "inserted"},
		{"jsonb equality is semantic", "C", `{"n": 1.0, "a": [1]}`, "inserted"},
		{"1.0 equals 1, key order ignored", "C", `{"a": [1], "n": 1}`, "duplicate"},
	}
	for _, s := range steps {
		got, err := publish(ctx, conn, s.key, s.payload)
		if err != nil || got != s.want {
			t.Fatalf("%s: got %q (err %v), want %q", s.name, got, err, s.want)
		}
	}

	var rows, conflicts int
	var storedA string
	if err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM integration_outbox WHERE event_key IN ('A','B')),
		(SELECT count(*) FROM integration_outbox_conflicts WHERE event_key = 'A' AND payload = '{"lead":"OTHER"}'),
		(SELECT payload->>'lead' FROM integration_outbox WHERE event_key = 'A')`).Scan(&rows, &conflicts, &storedA); err != nil {
		t.Fatal(err)
	}
	if rows != 2 || conflicts != 1 || storedA != "L1" {
		t.Fatalf("after D1–D4: %d rows (want 2), %d conflict rows (want 1), stored A payload %q (want L1)", rows, conflicts, storedA)
	}

	// NULL fields compare with IS NOT DISTINCT FROM; a conflict rolls back
	// with its caller's transaction.
	var got string
	if err := conn.QueryRow(ctx, "SELECT outbox_publish(NULL, NULL, NULL, 'N', NULL)").Scan(&got); err != nil || got != "inserted" {
		t.Fatalf("null insert: %q %v", got, err)
	}
	if err := conn.QueryRow(ctx, "SELECT outbox_publish(NULL, NULL, NULL, 'N', NULL)").Scan(&got); err != nil || got != "duplicate" {
		t.Fatalf("null duplicate: %q %v", got, err)
	}
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if got, err := publish(ctx, tx, "N", "{}"); err != nil || got != "conflict" {
			return fmt.Errorf("in tx: %q %v", got, err)
		}
		return errors.New("roll back")
	})
	if err == nil || err.Error() != "roll back" {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM integration_outbox_conflicts WHERE event_key = 'N'").Scan(&conflicts); err != nil || conflicts != 0 {
		t.Fatalf("conflict row survived its transaction's rollback: %d %v", conflicts, err)
	}
}

// TestOutboxPublish_ConcurrentCallers: two callers with the same new key, at
// READ COMMITTED, race many times; exactly one wins each round.
func TestOutboxPublish_ConcurrentCallers(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	setup := mustConnect(t, url)
	mustMigrate(t, setup, migrations.Options{})
	a, b := mustConnect(t, url), mustConnect(t, url)

	for round := range 60 {
		key := fmt.Sprintf("race-%d", round)
		results := make([]string, 2)
		errs := make([]error, 2)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, conn := range []*pgx.Conn{a, b} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				results[i], errs[i] = publish(ctx, conn, key, `{"round": 1}`)
			}()
		}
		close(start)
		wg.Wait()
		if errs[0] != nil || errs[1] != nil {
			t.Fatalf("round %d: %v %v", round, errs[0], errs[1])
		}
		if !(results[0] == "inserted" && results[1] == "duplicate" || results[0] == "duplicate" && results[1] == "inserted") {
			t.Fatalf("round %d: results %v, want one inserted and one duplicate", round, results)
		}
	}
	var n int
	if err := setup.QueryRow(ctx, "SELECT count(*) FROM integration_outbox WHERE event_key LIKE 'race-%'").Scan(&n); err != nil || n != 60 {
		t.Fatalf("rows: %d (err %v), want one per round", n, err)
	}
}

// TestOutboxPublish_SecondCallerWaits shows the wait explicitly: the second
// caller is blocked (an ungranted lock in pg_locks) behind the first caller's
// uncommitted insert, and answers 'duplicate' once the first commits. At
// REPEATABLE READ the same wait ends in a retryable serialization failure.
func TestOutboxPublish_SecondCallerWaits(t *testing.T) {
	for _, iso := range []string{"READ COMMITTED", "REPEATABLE READ"} {
		t.Run(iso, func(t *testing.T) {
			ctx := context.Background()
			url := pgtest.NewDatabase(t)
			first := mustConnect(t, url)
			mustMigrate(t, first, migrations.Options{})
			second := mustConnect(t, url)
			observer := mustConnect(t, url)

			mustExec(t, first, "BEGIN")
			if got, err := publish(ctx, first, "K", `{"v": 1}`); err != nil || got != "inserted" {
				t.Fatalf("first: %q %v", got, err)
			}
			mustExec(t, second, "BEGIN ISOLATION LEVEL "+iso)
			mustExec(t, second, "SELECT 1") // take the snapshot now, before the first commits
			var secondPID uint32
			if err := second.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&secondPID); err != nil {
				t.Fatal(err)
			}

			type answer struct {
				result string
				err    error
			}
			done := make(chan answer, 1)
			go func() {
				r, err := publish(ctx, second, "K", `{"v": 1}`)
				done <- answer{r, err}
			}()

			deadline := time.Now().Add(10 * time.Second)
			for {
				var waiting bool
				if err := observer.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)", secondPID).Scan(&waiting); err != nil {
					t.Fatal(err)
				}
				if waiting {
					break
				}
				select {
				case a := <-done:
					t.Fatalf("second caller returned %q (%v) without waiting for the first", a.result, a.err)
				default:
				}
				if time.Now().After(deadline) {
					t.Fatal("second caller never showed up waiting in pg_locks")
				}
				time.Sleep(20 * time.Millisecond)
			}

			mustExec(t, first, "COMMIT")
			a := <-done
			if iso == "READ COMMITTED" {
				if a.err != nil || a.result != "duplicate" {
					t.Fatalf("second: %q %v, want duplicate", a.result, a.err)
				}
				mustExec(t, second, "COMMIT")
				return
			}
			var pgErr *pgconn.PgError
			if !errors.As(a.err, &pgErr) || pgErr.Code != "40001" {
				t.Fatalf("second at REPEATABLE READ: %q %v, want SQLSTATE 40001", a.result, a.err)
			}
			mustExec(t, second, "ROLLBACK")
		})
	}
}

// TestMigrate_NotifyTrigger: the opt-in wake-up is a statement-level trigger
// with an empty payload — one notification per INSERT statement, not per
// row; migrate installs it once and removes it when switched off.
func TestMigrate_NotifyTrigger(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	conn := mustConnect(t, url)
	res := mustMigrate(t, conn, migrations.Options{NotifyTrigger: true})
	if res.NotifyTrigger != "installed" {
		t.Fatalf("first run: %q", res.NotifyTrigger)
	}
	if res := mustMigrate(t, conn, migrations.Options{NotifyTrigger: true}); res.NotifyTrigger != "" {
		t.Fatalf("second run changed the trigger: %q", res.NotifyTrigger)
	}

	listener := mustConnect(t, url)
	channel := migrations.NotifyChannel(relay.QualifiedName{Name: "integration_outbox"})
	mustExec(t, listener, "LISTEN "+relay.QuoteIdentifier(channel))
	mustExec(t, conn, `INSERT INTO integration_outbox (event_key, payload) SELECT 'n' || g, '{}' FROM generate_series(1, 50) g`)
	waitCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := listener.WaitForNotification(waitCtx)
	if err != nil || n.Channel != channel || n.Payload != "" {
		t.Fatalf("notification %+v, %v", n, err)
	}
	short, cancel2 := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel2()
	if extra, err := listener.WaitForNotification(short); err == nil {
		t.Fatalf("a 50-row INSERT sent more than one notification: %+v", extra)
	}

	if res := mustMigrate(t, conn, migrations.Options{NotifyTrigger: false}); res.NotifyTrigger != "removed" {
		t.Fatalf("switching off: %q", res.NotifyTrigger)
	}
	var triggers int
	conn.QueryRow(ctx, "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'integration_outbox'::regclass AND NOT tgisinternal AND tgname LIKE '%notify%'").Scan(&triggers)
	if triggers != 0 {
		t.Fatalf("%d triggers left", triggers)
	}
}

// TestOutboxPublish_TraceContext: the sixth argument stores the trace
// context; five-argument calls, positional or named, keep working with
// none; the trace context is not part of the event, so a publish of the
// same event from another trace is a duplicate and changes nothing.
func TestOutboxPublish_TraceContext(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustMigrate(t, conn, migrations.Options{})

	const tc1 = `{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "congo=t61rcWkgMzE"}`
	const tc2 = `{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`
	publish6 := func(key, payload string, tc any) string {
		t.Helper()
		var got string
		if err := conn.QueryRow(ctx, "SELECT outbox_publish('lead.created', 'lead', 'L1', $1, $2::jsonb, $3::jsonb)", key, payload, tc).Scan(&got); err != nil {
			t.Fatalf("publish %s: %v", key, err)
		}
		return got
	}
	stored := func(table, key string) *string {
		t.Helper()
		var tc *string
		if err := conn.QueryRow(ctx, "SELECT trace_context::text FROM "+table+" WHERE event_key = $1", key).Scan(&tc); err != nil {
			t.Fatalf("read %s %s: %v", table, key, err)
		}
		return tc
	}

	if got := publish6("T", `{"n": 1}`, tc1); got != "inserted" {
		t.Fatalf("first publish: %s", got)
	}
	if got := publish6("T", `{"n": 1}`, tc2); got != "duplicate" {
		t.Fatalf("same event from another trace: %s, want duplicate", got)
	}
	if got := publish6("T", `{"n": 1}`, nil); got != "duplicate" {
		t.Fatalf("same event without a trace: %s, want duplicate", got)
	}
	if tc := stored("integration_outbox", "T"); tc == nil || !strings.Contains(*tc, "4bf92f3577b34da6a3ce929d0e0e4736") {
		t.Fatalf("stored trace context %v, want the first call's", tc)
	}
	if got := publish6("T", `{"n": 2}`, tc2); got != "conflict" {
		t.Fatalf("other payload: %s, want conflict", got)
	}
	if tc := stored("integration_outbox_conflicts", "T"); tc == nil || !strings.Contains(*tc, "0af7651916cd43dd8448eb211c80319c") {
		t.Fatalf("conflict's trace context %v, want the conflicting call's", tc)
	}

	// Five arguments, positional and named: no trace context.
	var got string
	if err := conn.QueryRow(ctx, "SELECT outbox_publish('lead.created', 'lead', 'L1', 'F', '{}')").Scan(&got); err != nil || got != "inserted" {
		t.Fatalf("five-argument publish: %q %v", got, err)
	}
	if err := conn.QueryRow(ctx, `SELECT outbox_publish(p_event_type => 'lead.created', p_aggregate_type => 'lead',
		p_aggregate_id => 'L1', p_event_key => 'G', p_payload => '{}')`).Scan(&got); err != nil || got != "inserted" {
		t.Fatalf("named five-argument publish: %q %v", got, err)
	}
	if err := conn.QueryRow(ctx, `SELECT outbox_publish(p_event_type => 'lead.created', p_aggregate_type => 'lead',
		p_aggregate_id => 'L1', p_event_key => 'H', p_payload => '{}', p_trace_context => $1::jsonb)`, tc2).Scan(&got); err != nil || got != "inserted" {
		t.Fatalf("named six-argument publish: %q %v", got, err)
	}
	if stored("integration_outbox", "F") != nil || stored("integration_outbox", "G") != nil || stored("integration_outbox", "H") == nil {
		t.Fatal("trace contexts of F, G (none) and H (one) not as published")
	}
	// Any JSON is stored: a bad trace context never fails the business
	// transaction (the relay drops it).
	if got := publish6("J", `{}`, `"not an object"`); got != "inserted" {
		t.Fatalf("publish with a malformed trace context: %s", got)
	}
}

// TestMigrate_TraceContextKeepsPublishGrants: a REVOKE FROM PUBLIC on
// outbox_publish carries over to the six-argument signature migration 008
// adds, with the grants the old one had.
func TestMigrate_TraceContextKeepsPublishGrants(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustMigrate(t, conn, migrations.Options{})
	// Back to the state before 008, with locked-down grants.
	mustExec(t, conn, "DROP FUNCTION outbox_publish(text, text, text, text, jsonb, jsonb)")
	mustExec(t, conn, "UPDATE integration_outbox_relay_version SET version = 7")
	// Roles are the cluster's: one of this test's own, dropped at its end
	// (before conn closes: cleanups run last first).
	var db string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	role := relay.QuoteIdentifier(db + "_publish_app")
	mustExec(t, conn, "CREATE ROLE "+role)
	t.Cleanup(func() {
		conn.Exec(context.Background(), "DROP OWNED BY "+role)
		conn.Exec(context.Background(), "DROP ROLE "+role)
	})
	mustExec(t, conn, "REVOKE ALL ON FUNCTION outbox_publish(text, text, text, text, jsonb) FROM PUBLIC")
	mustExec(t, conn, "GRANT EXECUTE ON FUNCTION outbox_publish(text, text, text, text, jsonb) TO "+role)

	res := mustMigrate(t, conn, migrations.Options{})
	if len(res.Applied) == 0 || res.Applied[0] != "008_trace_context" {
		t.Fatalf("applied %v, want 008 and the later ones", res.Applied)
	}
	var public, app bool
	if err := conn.QueryRow(ctx, `SELECT has_function_privilege('public', 'outbox_publish(text, text, text, text, jsonb, jsonb)', 'EXECUTE'),
		has_function_privilege($1, 'outbox_publish(text, text, text, text, jsonb, jsonb)', 'EXECUTE')`, db+"_publish_app").Scan(&public, &app); err != nil {
		t.Fatal(err)
	}
	if public || !app {
		t.Fatalf("six-argument outbox_publish: PUBLIC may execute = %v (want false), the app's role = %v (want true)", public, app)
	}
}

// TestMigrate_TraceContextOfAnotherType: an existing trace_context column
// that is not jsonb stops migrate with the fix.
func TestMigrate_TraceContextOfAnotherType(t *testing.T) {
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustExec(t, conn, seedSQL)
	mustExec(t, conn, "ALTER TABLE integration_outbox ADD COLUMN trace_context text")
	_, err := migrations.Migrate(context.Background(), conn, migrations.Options{Names: migrations.DefaultNames()})
	if err == nil || !strings.Contains(err.Error(), "trace_context") || !strings.Contains(err.Error(), "jsonb") {
		t.Fatalf("err = %v, want one naming trace_context and jsonb", err)
	}
}

// TestMigrate_FoldsTheOldDeliveredRecord: a database migrated by the
// version that kept the stream's deliveries in <outbox>_delivered (009)
// has rows the stream delivered still pending. Migration 011 marks exactly
// those rows done (pending, not diverted, their id in the record), drops
// the record, and CheckSchema refuses to run against a database that still
// has it.
func TestMigrate_FoldsTheOldDeliveredRecord(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustMigrate(t, conn, migrations.Options{})
	exec := func(sql string) {
		t.Helper()
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// The state migration 010 left: the record, and rows of every kind.
	exec(`CREATE TABLE integration_outbox_delivered (id bigint PRIMARY KEY)`)
	exec(`UPDATE integration_outbox_relay_version SET version = 10`)
	exec(`INSERT INTO integration_outbox (id, event_key, status, handoff_at) VALUES
		(1, 'delivered', 'pending', NULL), (2, 'diverted', 'pending', now()), (3, 'failed', 'failed', NULL),
		(4, 'waiting', 'pending', NULL)`)
	exec(`INSERT INTO integration_outbox_delivered (id) VALUES (1), (2), (3), (99)`)
	if err := migrations.CheckSchema(ctx, conn, migrations.DefaultNames()); err == nil || !strings.Contains(err.Error(), "run outbox-relay migrate") {
		t.Fatalf("CheckSchema with the old record = %v, want: run migrate", err)
	}

	res := mustMigrate(t, conn, migrations.Options{})
	if res.From != 10 || res.To != migrations.Latest() || !slices.Contains(res.Applied, "011_fold_delivered_record") {
		t.Fatalf("migrate from 10: %+v", res)
	}
	for id, want := range map[int]string{1: "done", 2: "pending", 3: "failed", 4: "pending"} {
		var status string
		var processed bool
		if err := conn.QueryRow(ctx, `SELECT status, processed_at IS NOT NULL FROM integration_outbox WHERE id = $1`, id).Scan(&status, &processed); err != nil {
			t.Fatal(err)
		}
		if status != want || (want == "done") != processed {
			t.Errorf("row %d: %s (processed_at set: %v), want %s", id, status, processed, want)
		}
	}
	var gone bool
	if err := conn.QueryRow(ctx, `SELECT to_regclass('integration_outbox_delivered') IS NULL`).Scan(&gone); err != nil || !gone {
		t.Errorf("the old record is still there (err %v)", err)
	}
	if err := migrations.CheckSchema(ctx, conn, migrations.DefaultNames()); err != nil {
		t.Errorf("CheckSchema after migrate: %v", err)
	}
}

// TestMigrate_MsgIDScope: migration 014 records, once, the first outbox id
// whose NATS message id carries the deployment: one past the highest id
// when it runs (the earlier version may have published every row below
// under its bare key), 1 on a new outbox. Every role may read it (run's
// role needs no new GRANT); CheckSchema refuses a database without it.
func TestMigrate_MsgIDScope(t *testing.T) {
	ctx := context.Background()
	scopedFrom := func(conn *pgx.Conn) int64 {
		t.Helper()
		var n int64
		if err := conn.QueryRow(ctx, `SELECT scoped_from FROM integration_outbox_msgid_scope`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	url := pgtest.NewDatabase(t)
	conn := mustConnect(t, url)
	mustMigrate(t, conn, migrations.Options{})
	if got := scopedFrom(conn); got != 1 {
		t.Fatalf("a new outbox scopes from id %d, want 1", got)
	}

	// The state migration 011 left: no scope, rows published by the
	// version that sent bare keys, and a role.
	mustExec(t, conn, `DROP TABLE integration_outbox_msgid_scope`)
	mustExec(t, conn, `UPDATE integration_outbox_relay_version SET version = 11`)
	mustExec(t, conn, `INSERT INTO integration_outbox (id, event_key) VALUES (3, 'a'), (7, 'b')`)
	mustExec(t, conn, `DROP ROLE IF EXISTS msgid_reader`)
	mustExec(t, conn, `CREATE ROLE msgid_reader LOGIN`)
	t.Cleanup(func() {
		c := mustConnect(t, url)
		mustExec(t, c, `DROP OWNED BY msgid_reader`)
		mustExec(t, c, `DROP ROLE msgid_reader`)
	})
	if err := migrations.CheckSchema(ctx, conn, migrations.DefaultNames()); err == nil || !strings.Contains(err.Error(), "run outbox-relay migrate") {
		t.Fatalf("CheckSchema without the scope = %v, want: run migrate", err)
	}

	res := mustMigrate(t, conn, migrations.Options{})
	if res.From != 11 || !slices.Contains(res.Applied, "014_msgid_scope") {
		t.Fatalf("migrate from 11: %+v", res)
	}
	if got := scopedFrom(conn); got != 8 {
		t.Fatalf("scoped from id %d, want 8 (one past the rows that existed)", got)
	}
	if err := migrations.CheckSchema(ctx, conn, migrations.DefaultNames()); err != nil {
		t.Fatalf("CheckSchema after migrate: %v", err)
	}
	var readable bool
	if err := conn.QueryRow(ctx, `SELECT has_table_privilege('msgid_reader', 'integration_outbox_msgid_scope', 'SELECT')`).Scan(&readable); err != nil || !readable {
		t.Fatalf("a role without grants cannot read the scope (%v)", err)
	}

	// Later rows and later migrations leave it as it was.
	mustExec(t, conn, `INSERT INTO integration_outbox (id, event_key) VALUES (20, 'c')`)
	mustExec(t, conn, `UPDATE integration_outbox_relay_version SET version = 11`)
	mustMigrate(t, conn, migrations.Options{})
	if got := scopedFrom(conn); got != 8 {
		t.Fatalf("a second run moved the scope to %d", got)
	}
}
