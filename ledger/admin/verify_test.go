package admin_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// verifySinks are the sinks the verify tests configure: nats takes every
// event, orders only order.* (so an invoice goes to nats alone).
func verifySinks() []admin.VerifySink {
	return []admin.VerifySink{
		{Name: "nats", Route: relay.Route{Events: []string{"*"}}},
		{Name: "orders", Route: relay.Route{Events: []string{"order.*"}}},
	}
}

// vrow is an outbox row for the verify tests: created (and due) age ago.
type vrow struct {
	key, eventType, status, lastError string
	age                               time.Duration
}

func (f *fixture) mustVerifyRow(tb testing.TB, r vrow) int64 {
	tb.Helper()
	var id int64
	err := f.pool.QueryRow(context.Background(), fmt.Sprintf(`
INSERT INTO %s (event_type, aggregate_type, aggregate_id, event_key, payload, status, last_error, created_at, available_at)
VALUES (NULLIF($1, ''), 'order', 'A1', $2, '{}', $3, NULLIF($4, ''), now() - $5 * interval '1 microsecond', now() - $5 * interval '1 microsecond')
RETURNING id`, f.tables.Outbox.Quoted()), r.eventType, r.key, r.status, r.lastError, r.age.Microseconds()).Scan(&id)
	if err != nil {
		tb.Fatalf("insert %s: %v", r.key, err)
	}
	return id
}

// gapIDs returns the ids (or, for orphans, keys) of the listed gaps of kind
// at sink.
func gapIDs(rep *admin.VerifyReport, kind admin.GapKind, sink string) []string {
	var out []string
	for _, g := range rep.Gaps {
		if g.Kind != kind || g.Sink != sink {
			continue
		}
		for _, x := range g.First {
			if x.ID != 0 {
				out = append(out, fmt.Sprint(x.ID))
			} else {
				out = append(out, x.EventKey)
			}
		}
	}
	slices.Sort(out)
	return out
}

func sortedIDs(ids ...int64) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = fmt.Sprint(id)
	}
	slices.Sort(out)
	return out
}

func gapGroup(rep *admin.VerifyReport, kind admin.GapKind, sink string) *admin.GapGroup {
	for _, g := range rep.Gaps {
		if g.Kind == kind && g.Sink == sink {
			return g
		}
	}
	return nil
}

// sqlRows runs a report's query and returns its first column, sorted.
func sqlRows(t *testing.T, f *fixture, sql string) []string {
	t.Helper()
	rows, err := f.pool.Query(context.Background(), sql)
	if err != nil {
		t.Fatalf("the report's query fails: %v\n%s", err, sql)
	}
	var out []string
	for rows.Next() {
		v, err := rows.Values()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprint(v[0]))
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("%v\n%s", err, sql)
	}
	slices.Sort(out)
	return out
}

// A window where every row is delivered, dead-lettered, held, discarded or
// on its way has no gap, and each sink's tally says which is which.
func TestVerify_CleanWindow(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	for _, r := range []vrow{
		{key: "order-done", eventType: "order.created", status: "done", age: time.Hour},
		{key: "invoice-done", eventType: "invoice.sent", status: "done", age: time.Hour},
		{key: "failed", eventType: "order.created", status: "failed", lastError: "HTTP 422", age: time.Hour},
		{key: "held", eventType: "order.created", status: "held", age: time.Hour},
		{key: "discarded", eventType: "order.created", status: "discarded", lastError: "HTTP 422", age: time.Hour},
		{key: "discarded-before", eventType: "order.created", status: "done", lastError: "discarded: HTTP 422", age: time.Hour}, // by an earlier version
		{key: "pending-fresh", eventType: "order.created", status: "pending"},
	} {
		f.mustVerifyRow(t, r)
	}
	for _, p := range [][2]string{{"order-done", "nats"}, {"order-done", "orders"}, {"invoice-done", "nats"},
		{"failed", "nats"}} {
		f.MustLedger(t, p[0], p[1], "delivered", 0)
	}
	f.MustLedger(t, "held", "orders", "unknown", 0)

	rep, err := admin.Verify(ctx, f.pool, f.tables, admin.VerifyOptions{
		Since: time.Now().Add(-2 * time.Hour), Sinks: verifySinks(), StuckAfter: 30 * time.Second,
		RetentionDoneAfter: 7 * 24 * time.Hour, Orphans: &admin.OrphanWalk{Since: time.Now().Add(-2 * time.Hour)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Clean() || rep.Rows != 7 {
		t.Fatalf("report: clean %v, rows %d, gaps %+v", rep.Clean(), rep.Rows, rep.Gaps)
	}
	want := map[string]admin.SinkTally{
		"nats":   {Sink: "nats", Routed: 7, Delivered: 3, DeadLettered: 0, Held: 1, Discarded: 2, OnItsWay: 1},
		"orders": {Sink: "orders", Routed: 6, Delivered: 1, DeadLettered: 1, Held: 1, Discarded: 2, OnItsWay: 1},
	}
	for _, got := range rep.Sinks {
		if *got != want[got.Sink] {
			t.Errorf("sink %s: %+v, want %+v", got.Sink, *got, want[got.Sink])
		}
	}
}

// Each kind of gap the database shows is found, listed, and listed again,
// all of it, by the query the report prints.
func TestVerify_FindsEachKindOfGap(t *testing.T) {
	for name, names := range map[string]migrations.Names{"default names": migrations.DefaultNames(), "hostile names": hostileNames()} {
		t.Run(name, func(t *testing.T) {
			f := MustFixtureNames(t, names)
			ctx := context.Background()
			ok := f.mustVerifyRow(t, vrow{key: "ok", eventType: "order.created", status: "done", age: time.Hour})
			missing := f.mustVerifyRow(t, vrow{key: "missing", eventType: "order.created", status: "done", age: time.Hour})
			stuck := f.mustVerifyRow(t, vrow{key: "stuck", eventType: "order.created", status: "pending", age: 10 * time.Minute})
			// Pending although every sink has it (an earlier version left its
			// status so): stuck by its status, for reconcile to settle.
			recorded := f.mustVerifyRow(t, vrow{key: "recorded", eventType: "order.created", status: "pending", age: 10 * time.Minute})
			fresh := f.mustVerifyRow(t, vrow{key: "fresh", eventType: "order.created", status: "pending"})
			invoice := f.mustVerifyRow(t, vrow{key: "invoice", eventType: "invoice.sent", status: "done", age: time.Hour})
			untyped := f.mustVerifyRow(t, vrow{key: "untyped", status: "done", age: time.Hour}) // NULL event_type
			for _, p := range [][2]string{{"ok", "nats"}, {"ok", "orders"}, {"missing", "nats"}, {"invoice", "nats"}, {"untyped", "nats"}, {"untyped", "orders"},
				{"recorded", "nats"}, {"recorded", "orders"}} {
				f.MustLedger(t, p[0], p[1], "delivered", 0)
			}
			f.MustLedger(t, "missing", "orders", "unknown", 0)   // not delivered: still missing
			f.MustLedger(t, "invoice", "orders", "delivered", 0) // orders takes no invoice: unrouted
			f.MustLedger(t, "ok", "gone-sink", "delivered", 0)   // a sink no longer configured
			f.MustLedger(t, "orphan", "nats", "delivered", time.Minute)
			f.MustLedger(t, "orphan-old", "nats", "delivered", 30*24*time.Hour) // retention may have pruned its row
			_ = ok

			opts := admin.VerifyOptions{
				Since: time.Now().Add(-2 * time.Hour), Sinks: verifySinks(), StuckAfter: 30 * time.Second,
				RetentionDoneAfter: 7 * 24 * time.Hour,
			}
			opts.Orphans = &admin.OrphanWalk{}
			rep, err := admin.Verify(ctx, f.pool, f.tables, opts)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range []struct {
				kind admin.GapKind
				sink string
				want []string
			}{
				{admin.GapMissing, "orders", []string{fmt.Sprint(missing)}},
				{admin.GapStuck, "", sortedIDs(stuck, recorded)},
				{admin.GapUnrouted, "orders", sortedIDs(invoice, untyped)},
				{admin.GapUnrouted, "gone-sink", []string{fmt.Sprint(ok)}},
				{admin.GapOrphaned, "nats", []string{"orphan"}},
			} {
				if got := gapIDs(rep, c.kind, c.sink); !slices.Equal(got, c.want) {
					t.Errorf("%s at %q: %v, want %v", c.kind, c.sink, got, c.want)
				}
				g := gapGroup(rep, c.kind, c.sink)
				if g == nil || g.SQL == "" {
					continue
				}
				if got := sqlRows(t, f, g.SQL); !slices.Equal(got, c.want) {
					t.Errorf("%s at %q: the report's query lists %v, want %v:\n%s", c.kind, c.sink, got, c.want, g.SQL)
				}
			}
			if n := len(rep.Gaps); n != 5 {
				t.Errorf("%d groups of gaps, want 5: %+v", n, rep.Gaps)
			}
			if gapIDs(rep, admin.GapStuck, "") == nil || slices.Contains(gapIDs(rep, admin.GapStuck, ""), fmt.Sprint(fresh)) {
				t.Errorf("a row pending for a moment is stuck: %v", gapIDs(rep, admin.GapStuck, ""))
			}

			// With retention off, nothing could have pruned the old orphan's
			// row.
			opts.RetentionDoneAfter, opts.Orphans = 0, &admin.OrphanWalk{}
			rep, err = admin.Verify(ctx, f.pool, f.tables, opts)
			if err != nil {
				t.Fatal(err)
			}
			if got := gapIDs(rep, admin.GapOrphaned, "nats"); !slices.Equal(got, []string{"orphan", "orphan-old"}) {
				t.Errorf("orphans with retention off: %v", got)
			}

			// --sink orders: only its pairs and its ledger rows.
			opts.Sink = "orders"
			rep, err = admin.Verify(ctx, f.pool, f.tables, opts)
			if err != nil {
				t.Fatal(err)
			}
			if n := rep.Count(admin.GapOrphaned) + rep.Count(admin.GapMissing) + rep.Count(admin.GapUnrouted); n != 3 || len(rep.Sinks) != 1 {
				t.Errorf("--sink orders: %d gaps, %d sinks: %+v", n, len(rep.Sinks), rep.Gaps)
			}
		})
	}
}

// A window of time starts at the first id created since its start, found
// by bisection; rows created earlier are neither read nor counted.
func TestVerify_SinceFindsTheFirstID(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	MustExec(t, f.pool, `INSERT INTO integration_outbox (event_type, event_key, payload, status, created_at)
		SELECT 'order.created', 'k-' || g, '{}', 'failed', now() - (1000 - g) * interval '1 minute' FROM generate_series(1, 1000) AS g`)
	// A gap in the ids, as rolled-back inserts leave.
	MustExec(t, f.pool, `DELETE FROM integration_outbox WHERE id BETWEEN 400 AND 700`)
	for _, c := range []struct {
		ago       time.Duration
		first     int64
		rows      int64
		wantEmpty bool
	}{
		{ago: 100*time.Minute - 30*time.Second, first: 901, rows: 100},
		{ago: 500*time.Minute - 30*time.Second, first: 701, rows: 300},
		{ago: 5000 * time.Minute, first: 1, rows: 699},
		{ago: 0, wantEmpty: true},
	} {
		rep, err := admin.Verify(ctx, f.pool, f.tables, admin.VerifyOptions{Since: time.Now().Add(-c.ago), Sinks: verifySinks(), StuckAfter: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		if c.wantEmpty {
			if rep.Rows != 0 || rep.IDsText != "" {
				t.Errorf("since now: %d rows, ids %q", rep.Rows, rep.IDsText)
			}
			continue
		}
		if rep.FirstID != c.first || rep.Rows != c.rows || rep.LastID != 1000 {
			t.Errorf("since %s ago: rows %d from %d to %d, want %d from %d", c.ago, rep.Rows, rep.FirstID, rep.LastID, c.rows, c.first)
		}
	}
	rep, err := admin.Verify(ctx, f.pool, f.tables, admin.VerifyOptions{IDs: []admin.IDRange{{5, 9}, {1, 2}, {8, 12}, {699, 702}}, Sinks: verifySinks()})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Rows != 2+8+2 || rep.IDsText != "1-2,5-12,699-702" {
		t.Errorf("--ids 1,2,5-9,8-12,699-702: %d rows, ids %q", rep.Rows, rep.IDsText)
	}
}

// The stream's audit: a delivered event without a copy is missing at the
// sink, unless a copy arrives by the catch-up or the stream's retention
// removed it; copies under two ids are a duplicate, under one id a repeat;
// a copy the ledger does not know is unrecorded; replays count apart.
func TestVerify_StreamAudit(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := map[string]int64{}
	for _, r := range []vrow{
		{key: "present", status: "done", age: time.Hour},
		{key: "lost", status: "done", age: time.Hour},
		{key: "late", status: "done", age: time.Hour},
		{key: "twice-two-ids", status: "done", age: time.Hour},
		{key: "twice-one-id", status: "done", age: time.Hour},
		{key: "replayed", status: "done", age: time.Hour},
		{key: "failed-but-stored", status: "failed", age: time.Hour},
		{key: "on-its-way", status: "pending", age: 0},
		{key: "old-removed", status: "done", age: 3 * time.Hour},
	} {
		r.eventType = "order.created"
		ids[r.key] = f.mustVerifyRow(t, r)
		if r.status == "done" {
			f.MustLedger(t, r.key, "nats", "delivered", 0)
		}
	}
	f.mustVerifyRow(t, vrow{key: "before-window", eventType: "order.created", status: "done", age: 10 * time.Hour})
	f.MustLedger(t, "before-window", "nats", "delivered", 0)
	beforeFailed := f.mustVerifyRow(t, vrow{key: "before-window-failed", eventType: "order.created", status: "failed", age: 10 * time.Hour})

	audit := admin.NewStreamAudit()
	audit.RemovedBefore = time.Now().Add(-2 * time.Hour)
	for _, c := range []admin.StreamCopy{
		{EventKey: "present", MsgID: "present"},
		{EventKey: "twice-two-ids", MsgID: "twice-two-ids"},
		{EventKey: "twice-two-ids", MsgID: "dep2:twice-two-ids"},
		{EventKey: "twice-one-id", MsgID: "twice-one-id"},
		{EventKey: "twice-one-id", MsgID: "twice-one-id"},
		{EventKey: "replayed", MsgID: "replayed"},
		{EventKey: "replayed", Replay: 1, MsgID: "replayed~r1"},
		{EventKey: "failed-but-stored", MsgID: "failed-but-stored"},
		{EventKey: "on-its-way", MsgID: "on-its-way"},
		{EventKey: "before-window", MsgID: "before-window"},
		{EventKey: "before-window-failed", MsgID: "before-window-failed"},
		{EventKey: "never-in-the-outbox", MsgID: "never-in-the-outbox"},
		// Its row and ledger rows pruned by retention since.
		{EventKey: "pruned", MsgID: "pruned", Stored: time.Now().Add(-8 * 24 * time.Hour)},
	} {
		if c.Stored.IsZero() {
			c.Stored = time.Now()
		}
		audit.Add(c)
	}
	audit.CatchUp = func(context.Context) error {
		audit.Add(admin.StreamCopy{EventKey: "late", MsgID: "late", Stored: time.Now()})
		return nil
	}
	sinks := verifySinks()[:1]
	sinks[0].Stream = audit
	rep, err := admin.Verify(ctx, f.pool, f.tables, admin.VerifyOptions{Since: time.Now().Add(-4 * time.Hour), Sinks: sinks, StuckAfter: time.Minute,
		RetentionDoneAfter: 7 * 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	unrecorded := []string{fmt.Sprint(ids["failed-but-stored"]), fmt.Sprint(beforeFailed), "never-in-the-outbox"}
	slices.Sort(unrecorded)
	for _, c := range []struct {
		kind admin.GapKind
		want []string
	}{
		{admin.GapMissingAtSink, []string{fmt.Sprint(ids["lost"])}},
		{admin.GapDuplicate, []string{fmt.Sprint(ids["twice-two-ids"])}},
		{admin.GapUnrecorded, unrecorded},
	} {
		if got := gapIDs(rep, c.kind, "nats"); !slices.Equal(got, c.want) {
			t.Errorf("%s: %v, want %v", c.kind, got, c.want)
		}
	}
	if g := gapGroup(rep, admin.GapDuplicate, "nats"); g == nil || g.SQL != "" {
		t.Errorf("a deep gap has no query: %+v", g)
	}
	tally := rep.Sinks[0].Stream
	if tally.Read != 14 || tally.Replays != 1 || tally.Repeats != 1 || tally.NotCheckable != 1 {
		t.Errorf("stream tally %+v, want 14 read, 1 replay, 1 repeat, 1 not checkable", *tally)
	}
}

// A webhook receiver's own table: an event the ledger shows delivered that
// the receiver query does not return is missing there.
func TestVerify_ReceiverQuery(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	MustExec(t, f.pool, `CREATE TABLE n8n_processed_events (event_key text PRIMARY KEY, claimed_at timestamptz NOT NULL DEFAULT now(), done_at timestamptz)`)
	var want []string
	for _, key := range []string{"applied", "claimed-only", "absent"} {
		id := f.mustVerifyRow(t, vrow{key: key, eventType: "order.created", status: "done", age: time.Minute})
		f.MustLedger(t, key, "n8n", "delivered", 0)
		if key != "applied" {
			want = append(want, fmt.Sprint(id))
		}
	}
	MustExec(t, f.pool, `INSERT INTO n8n_processed_events (event_key, done_at) VALUES ('applied', now()), ('claimed-only', NULL)`)
	sinks := []admin.VerifySink{{Name: "n8n", Route: relay.Route{Events: []string{"*"}},
		ReceiverQuery: `SELECT event_key FROM n8n_processed_events WHERE event_key = ANY($1) AND done_at IS NOT NULL`}}
	rep, err := admin.Verify(ctx, f.pool, f.tables, admin.VerifyOptions{Since: time.Now().Add(-time.Hour), Sinks: sinks, StuckAfter: time.Minute, Slice: 2})
	if err != nil {
		t.Fatal(err)
	}
	if got := gapIDs(rep, admin.GapMissingAtSink, "n8n"); !slices.Equal(got, want) {
		t.Errorf("missing at the receiver: %v, want %v", got, want)
	}
	if n := *rep.Sinks[0].Receiver; n != 3 {
		t.Errorf("receiver checked %d keys, want 3", n)
	}

	sinks[0].ReceiverQuery = `SELECT 1 FROM n8n_processed_events WHERE event_key = ANY($1)`
	if _, err := admin.Verify(ctx, f.pool, f.tables, admin.VerifyOptions{Since: time.Now().Add(-time.Hour), Sinks: sinks}); err == nil ||
		!strings.Contains(err.Error(), "sink n8n") || !strings.Contains(err.Error(), "first column") {
		t.Errorf("a receiver query returning no key: %v", err)
	}
}

// The continuous verify walks the ledger a budget at a time; a whole walk
// takes several passes, and a pass reports the orphans of the last whole
// walk (or of the walk under way, when it has found more).
func TestVerify_OrphanWalkAcrossPasses(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	MustExec(t, f.pool, `INSERT INTO integration_idempotency (event_key, action, state, delivered_at)
		SELECT 'gone-' || lpad(g::text, 4, '0'), 'nats', 'delivered', now() FROM generate_series(1, 250) AS g`)
	f.mustVerifyRow(t, vrow{key: "row", eventType: "order.created", status: "done", age: time.Minute})
	walk := &admin.OrphanWalk{Budget: 100}
	opts := admin.VerifyOptions{Since: time.Now().Add(-time.Hour), Sinks: verifySinks(), Orphans: walk, Slice: 100}
	var counts []int64
	for range 5 {
		rep, err := admin.Verify(ctx, f.pool, f.tables, opts)
		if err != nil {
			t.Fatal(err)
		}
		counts = append(counts, rep.Count(admin.GapOrphaned))
	}
	// 100, 200, then the whole walk (250); the next walk's first part
	// finds fewer than the last whole one.
	if want := []int64{100, 200, 250, 250, 250}; !slices.Equal(counts, want) {
		t.Errorf("orphans per pass: %v, want %v", counts, want)
	}
}

func TestMergeRanges(t *testing.T) {
	got := admin.MergeRanges([]admin.IDRange{{9, 9}, {1, 3}, {4, 5}, {7, 8}, {2, 2}, {20, 30}})
	want := []admin.IDRange{{1, 5}, {7, 9}, {20, 30}}
	if !slices.Equal(got, want) {
		t.Fatalf("MergeRanges = %v, want %v", got, want)
	}
}

// TestVerify_PlansUseIndexes: every statement verify runs reads the outbox
// and the ledger by their keys: no sequential scan of either, whatever the
// window, on tables large enough for the planner to care.
func TestVerify_PlansUseIndexes(t *testing.T) {
	if testing.Short() {
		t.Skip("200,000 rows: skipped with -short")
	}
	f := MustFixture(t)
	ctx := context.Background()
	MustExec(t, f.pool, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, created_at)
		SELECT 'order.created', 'order', 'a' || (g % 1000), 'k-' || g, '{}', 'done', now() - (200000 - g) * interval '10 milliseconds'
		  FROM generate_series(1, 200000) AS g`)
	MustExec(t, f.pool, `INSERT INTO integration_idempotency (event_key, action, state, delivered_at)
		SELECT o.event_key, s.name, 'delivered', now() FROM integration_outbox o, (VALUES ('nats'), ('orders')) AS s(name)`)
	MustExec(t, f.pool, `VACUUM ANALYZE integration_outbox`)
	MustExec(t, f.pool, `VACUUM ANALYZE integration_idempotency`)

	plans := admin.VerifyStatementsForTest(f.tables)
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = fmt.Sprintf("k-%d", 100_000+i)
	}
	for _, c := range []struct {
		name    string
		sql     string
		args    []any
		indexes []string
	}{
		{"a slice of the window", plans.Slice, []any{int64(1), int64(200_000), 10_000, []string{"nats", "orders"}, true}, []string{"integration_outbox_pkey", "integration_idempotency_pkey"}},
		{"a probe of the bisection", plans.FirstAfter, []any{int64(100_000)}, []string{"integration_outbox_pkey"}},
		{"a slice of the ledger for orphans", plans.OrphansNext, []any{"k-5", "nats", 10_000, time.Now().Add(-time.Hour), nil},
			[]string{"integration_idempotency_pkey", "integration_outbox_event_key_key"}},
		{"the stream's events outside the window", plans.Unrecorded, []any{keys, "nats"},
			[]string{"integration_outbox_event_key_key", "integration_idempotency_pkey"}},
	} {
		var plan []string
		rows, err := f.pool.Query(ctx, "EXPLAIN (COSTS OFF) "+c.sql, c.args...)
		if err == nil {
			plan, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		text := strings.Join(plan, "\n")
		t.Logf("%s:\n%s", c.name, text)
		if strings.Contains(text, "Seq Scan") {
			t.Errorf("%s: a sequential scan", c.name)
		}
		for _, idx := range c.indexes {
			if !strings.Contains(text, idx) {
				t.Errorf("%s: the plan does not use %s", c.name, idx)
			}
		}
	}
}
