package ledger_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

func TestSettleDelivered(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()

	first := relay.Settlement{Delivered: []relay.LedgerKey{
		{EventKey: "e1", Action: "webhook"},
		{EventKey: "e1", Action: "nats"},
		{EventKey: "e2", Action: "webhook"},
		{EventKey: "e2", Action: "webhook"}, // the same pair twice in one batch
	}}
	if _, err := f.store.Settle(ctx, first); err != nil {
		t.Fatalf("Settle: %v", err)
	}
	before := f.MustLedger(t, "e1")["webhook"]
	if before.State != "delivered" || before.Attempts != 1 || before.DeliveredAt == nil {
		t.Fatalf("e1/webhook = %+v, want delivered, 1 attempt, delivered_at set", before)
	}

	// Settling the same pairs again (a re-streamed duplicate) is fine, leaves
	// one row per pair and does not touch the delivered rows.
	if _, err := f.store.Settle(ctx, first); err != nil {
		t.Fatalf("Settle again: %v", err)
	}
	if n := f.MustCount(t, "SELECT count(*) FROM integration_idempotency"); n != 3 {
		t.Errorf("%d ledger rows, want 3", n)
	}
	after := f.MustLedger(t, "e1")["webhook"]
	if !after.DeliveredAt.Equal(*before.DeliveredAt) || after.Attempts != 1 {
		t.Errorf("delivered row overwritten: before %+v, after %+v", before, after)
	}
}

func TestSettleDeliveredTakesOverClaims(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, owner, claimed_at)
		VALUES ('e1', 'hold-sink', 'sending', 2, 'relay-a', now()), ('e2', 'hold-sink', 'unknown', 1, NULL, NULL)`)

	_, err := f.store.Settle(ctx, relay.Settlement{Delivered: []relay.LedgerKey{
		{EventKey: "e1", Action: "hold-sink"}, {EventKey: "e2", Action: "hold-sink"},
	}})
	if err != nil {
		t.Fatalf("Settle: %v", err)
	}
	for _, key := range []string{"e1", "e2"} {
		got := f.MustLedger(t, key)["hold-sink"]
		if got.State != "delivered" || got.DeliveredAt == nil {
			t.Errorf("%s = %+v, want delivered", key, got)
		}
	}
	if got := f.MustLedger(t, "e1")["hold-sink"]; got.Attempts != 2 {
		t.Errorf("e1 attempts = %d, want the claim's 2 kept", got.Attempts)
	}
}

func TestSettleHandOff(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "pending", Attempts: 1},
		row{Key: "done", Status: "done"},
		row{Key: "handed-off", HandedOff: true, LastError: ptr("earlier")},
		row{Key: "processing", Status: "processing", HandedOff: true},
		row{Key: "due-now", LastError: ptr("kept")},
	)
	pending, done, handedOff, processing, dueNow := ids[0], ids[1], ids[2], ids[3], ids[4]
	before := map[int64]outboxRow{}
	for _, id := range ids {
		before[id] = f.MustRow(t, id)
	}

	later := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	var handOffs []relay.HandOff
	for _, id := range ids[:4] {
		handOffs = append(handOffs, relay.HandOff{ID: id, AvailableAt: later, LastError: "timeout", Attempts: 2})
	}
	// No time and no error: due now, and the previous error is kept.
	handOffs = append(handOffs, relay.HandOff{ID: dueNow})
	start := time.Now()
	if _, err := f.store.Settle(ctx, relay.Settlement{HandOffs: handOffs}); err != nil {
		t.Fatalf("Settle: %v", err)
	}

	got := f.MustRow(t, pending)
	if got.Status != "pending" || got.HandoffAt == nil || !got.AvailableAt.Equal(later) ||
		got.LastError == nil || *got.LastError != "timeout" || got.Attempts != 3 {
		t.Errorf("pending row after hand-off = %+v, want pending, handoff_at set, available_at %v, last_error timeout, attempts 3", got, later)
	}
	got = f.MustRow(t, dueNow)
	if got.HandoffAt == nil || got.AvailableAt.Before(start.Add(-time.Minute)) || got.AvailableAt.After(time.Now().Add(time.Minute)) ||
		got.LastError == nil || *got.LastError != "kept" || got.Attempts != 0 {
		t.Errorf("due-now row after hand-off = %+v, want available now, last_error kept, attempts 0", got)
	}
	for name, id := range map[string]int64{"done": done, "handed-off": handedOff, "processing": processing} {
		if got := f.MustRow(t, id); got.String() != before[id].String() {
			t.Errorf("%s row changed by a hand-off: before %v, after %v", name, before[id], got)
		}
	}
}

func TestSettleDeadLetter(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "pending"},
		row{Key: "handed-off", HandedOff: true},
		row{Key: "done", Status: "done"},
		row{Key: "processing", Status: "processing"},
	)
	var dead []relay.DeadLetter
	for _, id := range ids {
		dead = append(dead, relay.DeadLetter{ID: id, LastError: "payload too large"})
	}
	if _, err := f.store.Settle(ctx, relay.Settlement{DeadLetters: dead}); err != nil {
		t.Fatalf("Settle: %v", err)
	}
	for i, want := range []string{"failed", "failed", "done", "processing"} {
		got := f.MustRow(t, ids[i])
		if got.Status != want {
			t.Errorf("row %d status = %s, want %s", i, got.Status, want)
		}
		if want == "failed" && (got.LastError == nil || *got.LastError != "payload too large" || got.ProcessedAt == nil) {
			t.Errorf("row %d = %+v, want last_error and processed_at", i, got)
		}
		if want != "failed" && got.LastError != nil {
			t.Errorf("row %d last_error = %q, want untouched", i, *got.LastError)
		}
	}
}

func TestSettleEmpty(t *testing.T) {
	f := MustFixture(t)
	// A cancelled context would fail any round trip: nothing is sent.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := f.store.Settle(ctx, relay.Settlement{}); err != nil {
		t.Errorf("Settle(empty) = %v, want nil", err)
	}
}

func TestSettleIsAtomic(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "ok"}, row{Key: "overflow", Attempts: 2147483647})
	_, err := f.store.Settle(ctx, relay.Settlement{
		Delivered:   []relay.LedgerKey{{EventKey: "ok", Action: "webhook"}},
		HandOffs:    []relay.HandOff{{ID: ids[1], Attempts: 1}}, // integer out of range
		DeadLetters: []relay.DeadLetter{{ID: ids[0], LastError: "x"}},
	})
	if err == nil || !strings.Contains(err.Error(), "hand off 1 rows") {
		t.Fatalf("Settle = %v, want the hand-off's error", err)
	}
	if n := f.MustCount(t, "SELECT count(*) FROM integration_idempotency"); n != 0 {
		t.Errorf("%d ledger rows after a failed Settle, want 0", n)
	}
	if got := f.MustRow(t, ids[0]); got.Status != "pending" {
		t.Errorf("status = %s after a failed Settle, want pending", got.Status)
	}
}

// TestSettleOneTransaction settles 5,000 pairs with hand-offs and dead
// letters and checks they were written by one transaction (one xmin).
func TestSettleOneTransaction(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsertPending(t, "big", 200)
	var st relay.Settlement
	for i := range 5000 {
		st.Delivered = append(st.Delivered, relay.LedgerKey{EventKey: fmt.Sprintf("big-%d", i), Action: "webhook"})
	}
	for _, id := range ids[:100] {
		st.HandOffs = append(st.HandOffs, relay.HandOff{ID: id, LastError: "circuit open"})
	}
	for _, id := range ids[100:] {
		st.DeadLetters = append(st.DeadLetters, relay.DeadLetter{ID: id, LastError: "rejected"})
	}
	start := time.Now()
	if _, err := f.store.Settle(ctx, st); err != nil {
		t.Fatalf("Settle: %v", err)
	}
	t.Logf("Settle of 5,000 delivered pairs, 100 hand-offs and 100 dead letters took %v", time.Since(start))

	n := f.MustCount(t, `SELECT count(DISTINCT x) FROM (
		SELECT xmin::text AS x FROM integration_idempotency
		UNION ALL SELECT xmin::text FROM integration_outbox) t`)
	if n != 1 {
		t.Errorf("rows written by %d transactions, want 1", n)
	}
	if n := f.MustCount(t, "SELECT count(*) FROM integration_idempotency WHERE state = 'delivered'"); n != 5000 {
		t.Errorf("%d delivered rows, want 5000", n)
	}
}

// TestSettleCommitSettingIsLocal checks that synchronous_commit = off does
// not outlive the Settle transaction on its pooled connection.
func TestSettleCommitSettingIsLocal(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, f.url+"&pool_max_conns=1")
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	defer pool.Close()
	store := ledger.New(pool, ledger.DefaultConfig())
	if _, err := store.Settle(ctx, relay.Settlement{Delivered: []relay.LedgerKey{{EventKey: "e", Action: "a"}}}); err != nil {
		t.Fatalf("Settle: %v", err)
	}
	if _, err := store.MarkDone(ctx, []int64{1}); err != nil {
		t.Fatalf("MarkDone: %v", err)
	}
	var setting string
	if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if setting != "on" {
		t.Errorf("synchronous_commit = %s after Settle on the same connection, want on", setting)
	}
}

func TestRestreamed(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "owned"},
		row{Key: "handed-off", HandedOff: true},
		row{Key: "done", Status: "done"},
		row{Key: "held", Status: "held"},
		row{Key: "owned-fresh"},
	)
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts) VALUES
		('owned', 'webhook', 'delivered', 1), ('owned', 'nats', 'delivered', 1), ('owned', 'hold', 'sending', 1),
		('done', 'webhook', 'delivered', 1)`)
	missing := int64(999_999)

	var events []*relay.Event
	for _, id := range append(ids, missing) {
		events = append(events, &relay.Event{ID: id})
	}
	got, err := f.store.Restreamed(ctx, events)
	if err != nil {
		t.Fatalf("Restreamed: %v", err)
	}
	want := map[int64]relay.RowState{
		ids[0]: {Owned: true, Delivered: []string{"nats", "webhook"}},
		ids[1]: {Owned: false},
		ids[2]: {Owned: false, Delivered: []string{"webhook"}},
		ids[3]: {Owned: false},
		ids[4]: {Owned: true},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Restreamed = %v, want %v", got, want)
	}
	if _, ok := got[missing]; ok {
		t.Errorf("missing id %d reported", missing)
	}

	if got, err := f.store.Restreamed(ctx, nil); err != nil || len(got) != 0 {
		t.Errorf("Restreamed(nil) = %v, %v; want empty", got, err)
	}
}

// TestRestreamedHugeTransaction crosses the per-query chunk size.
func TestRestreamedHugeTransaction(t *testing.T) {
	f := MustFixture(t)
	ids := f.MustInsertPending(t, "huge", 25_001)
	events := make([]*relay.Event, len(ids))
	for i, id := range ids {
		events[i] = &relay.Event{ID: id}
	}
	got, err := f.store.Restreamed(context.Background(), events)
	if err != nil {
		t.Fatalf("Restreamed: %v", err)
	}
	if len(got) != len(ids) {
		t.Fatalf("Restreamed returned %d rows, want %d", len(got), len(ids))
	}
	for _, id := range ids {
		if !got[id].Owned {
			t.Fatalf("row %d not owned", id)
		}
	}
}

func TestMarkDone(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "owned"},
		row{Key: "handed-off", HandedOff: true},
		row{Key: "failed", Status: "failed"},
		row{Key: "held", Status: "held"},
	)
	for range 2 { // safe to repeat
		if _, err := f.store.MarkDone(ctx, append(ids, 999_999)); err != nil {
			t.Fatalf("MarkDone: %v", err)
		}
	}
	for i, want := range []string{"done", "pending", "failed", "held"} {
		got := f.MustRow(t, ids[i])
		if got.Status != want {
			t.Errorf("row %d status = %s, want %s", i, got.Status, want)
		}
		if want == "done" && got.ProcessedAt == nil {
			t.Errorf("row %d processed_at not set", i)
		}
	}
	if _, err := f.store.MarkDone(ctx, nil); err != nil {
		t.Errorf("MarkDone(nil) = %v", err)
	}
}

func TestDiverted(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	agg := func(id string) (*string, *string) { return ptr("order"), ptr(id) }
	var rows []row
	add := func(r row, id string) {
		if id != "" {
			r.AggType, r.AggID = agg(id)
		}
		rows = append(rows, r)
	}
	add(row{Key: "a1", HandedOff: true}, "A")
	add(row{Key: "a2", HandedOff: true}, "A") // the same aggregate twice
	add(row{Key: "b1", Status: "held"}, "B")
	add(row{Key: "c1"}, "C")                                        // owned by the stream
	add(row{Key: "d1", Status: "done", HandedOff: true}, "D")       // settled
	add(row{Key: "e1", Status: "processing", HandedOff: true}, "E") // claimed
	add(row{Key: "f1", Status: "failed", HandedOff: true}, "F")     // dead letter
	add(row{Key: "n1", HandedOff: true}, "")                        // unordered
	rows = append(rows, row{Key: "t1", AggType: ptr("order"), HandedOff: true})
	f.MustInsert(t, rows...)

	got, err := f.store.Diverted(ctx)
	if err != nil {
		t.Fatalf("Diverted: %v", err)
	}
	slices.SortFunc(got, func(a, b relay.AggregateKey) int { return strings.Compare(a.ID, b.ID) })
	want := []relay.AggregateKey{{Type: "order", ID: "A"}, {Type: "order", ID: "B"}, {Type: "order", ID: "E"}}
	if !slices.Equal(got, want) {
		t.Errorf("Diverted = %v, want %v", got, want)
	}
}

// TestQuotedNames runs the store against tables whose names need quoting.
func TestQuotedNames(t *testing.T) {
	names := migrations.DefaultNames()
	names.Outbox = relay.QualifiedName{Schema: "app data", Name: `my "outbox"`}
	names.Ledger = relay.QualifiedName{Schema: "app data", Name: "ledger; DROP TABLE x"}
	names.Checkpoint = relay.QualifiedName{Schema: "app data", Name: "Checkpoint"}
	names.Conflicts = relay.QualifiedName{Schema: "app data", Name: "conflicts"}
	names.PublishFunction = relay.QualifiedName{Schema: "app data", Name: "publish"}
	names.Publication = "quoted_pub"
	f := MustFixtureNames(t, names, `CREATE SCHEMA "app data"`)
	ctx := context.Background()

	ids := f.MustInsert(t, row{Key: "k1", AggType: ptr("t"), AggID: ptr("1")}, row{Key: "k2"}, row{Key: "k3"})
	_, err := f.store.Settle(ctx, relay.Settlement{
		Delivered:   []relay.LedgerKey{{EventKey: "k1", Action: "webhook"}},
		HandOffs:    []relay.HandOff{{ID: ids[0]}},
		DeadLetters: []relay.DeadLetter{{ID: ids[1], LastError: "bad"}},
	})
	if err != nil {
		t.Fatalf("Settle: %v", err)
	}
	if _, err := f.store.MarkDone(ctx, ids); err != nil {
		t.Fatalf("MarkDone: %v", err)
	}
	states, err := f.store.Restreamed(ctx, []*relay.Event{{ID: ids[0]}})
	if err != nil || len(states[ids[0]].Delivered) != 1 {
		t.Fatalf("Restreamed = %v, %v", states, err)
	}
	if got, err := f.store.Diverted(ctx); err != nil || len(got) != 1 {
		t.Fatalf("Diverted = %v, %v", got, err)
	}
	if err := f.store.SaveCheckpoint(ctx, "s", 42); err != nil {
		t.Fatalf("SaveCheckpoint: %v", err)
	}
	if lsn, err := f.store.LoadCheckpoint(ctx, "s"); err != nil || lsn != 42 {
		t.Fatalf("LoadCheckpoint = %v, %v", lsn, err)
	}
	if _, err := f.store.MarkDeliveredDone(ctx, []string{"webhook"}); err != nil {
		t.Fatalf("MarkDeliveredDone: %v", err)
	}
	if _, err := f.store.ClaimSending(ctx, relay.LedgerKey{EventKey: "k9", Action: "hold"}, "me"); err != nil {
		t.Fatalf("ClaimSending: %v", err)
	}
	if err := f.store.Hold(ctx, ids[2], relay.LedgerKey{EventKey: "k3", Action: "hold"}, "no answer"); err != nil {
		t.Fatalf("Hold: %v", err)
	}
	if got := f.MustRow(t, ids[2]); got.Status != "done" {
		t.Errorf("k3 status = %s, want done (MarkDone ran first)", got.Status)
	}
}

func BenchmarkSettle(b *testing.B) {
	f := MustFixture(b)
	ctx := context.Background()
	const pairs = 1000
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		st := relay.Settlement{Delivered: make([]relay.LedgerKey, pairs)}
		for i := range st.Delivered {
			st.Delivered[i] = relay.LedgerKey{EventKey: fmt.Sprintf("bench-%d", n), Action: "webhook"}
			n++
		}
		if _, err := f.store.Settle(ctx, st); err != nil {
			b.Fatalf("Settle: %v", err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(n), "ns/pair")
}

// TestSettleReportsInvisibleRows: a row another session cannot see yet (here
// an uncommitted insert; in production a transaction the walsender sent
// before its backend left the proc array) is reported, not silently skipped.
func TestSettleReportsInvisibleRows(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	tx, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO integration_outbox (event_key, payload) VALUES ('invisible', '{}') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	invisible, err := f.store.Settle(ctx, relay.Settlement{HandOffs: []relay.HandOff{{ID: id, LastError: "503"}}})
	if err != nil || len(invisible) != 1 || invisible[0] != id {
		t.Fatalf("Settle reported %v (%v), want [%d]", invisible, err, id)
	}
	if invisible, err = f.store.MarkDone(ctx, []int64{id}); err != nil || len(invisible) != 1 {
		t.Fatalf("MarkDone reported %v (%v), want [%d]", invisible, err, id)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if invisible, err = f.store.Settle(ctx, relay.Settlement{HandOffs: []relay.HandOff{{ID: id, LastError: "503"}}}); err != nil || len(invisible) != 0 {
		t.Fatalf("after commit: %v (%v)", invisible, err)
	}
}
