package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

func TestSettleDelivered(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()

	done := relay.Decision{Kind: relay.Done}
	first := []*relay.Work{
		streamWork(1, "e1", done, outcomePair("webhook", relay.Delivered), outcomePair("nats", relay.Delivered)),
		streamWork(2, "e2", done, outcomePair("webhook", relay.Delivered)),
		streamWork(2, "e2", done, outcomePair("webhook", relay.Delivered)), // the same pair twice in one batch
	}
	if _, err := f.store.SettleStream(ctx, first, "relay-a"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	before := f.MustLedger(t, "e1")["webhook"]
	if before.State != "delivered" || before.Attempts != 1 || before.DeliveredAt == nil {
		t.Fatalf("e1/webhook = %+v, want delivered, 1 attempt, delivered_at set", before)
	}

	// Settling the same pairs again (a re-streamed duplicate) is fine, leaves
	// one row per pair and does not touch the delivered rows.
	if _, err := f.store.SettleStream(ctx, first, "relay-a"); err != nil {
		t.Fatalf("SettleStream again: %v", err)
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

	done := relay.Decision{Kind: relay.Done}
	_, err := f.store.SettleStream(ctx, []*relay.Work{
		streamWork(1, "e1", done, outcomePair("hold-sink", relay.Delivered)),
		streamWork(2, "e2", done, outcomePair("hold-sink", relay.Delivered)),
	}, "relay-b")
	if err != nil {
		t.Fatalf("SettleStream: %v", err)
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

func TestSettleDivert(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "pending", Attempts: 1},
		row{Key: "done", Status: "done"},
		row{Key: "diverted", Diverted: true, LastError: ptr("earlier")},
		row{Key: "processing", Status: "processing", Diverted: true},
		row{Key: "due-now", LastError: ptr("kept")},
		row{Key: "more-attempts", Attempts: 5},
	)
	pending, done, diverted, processing, dueNow, moreAttempts := ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]
	before := map[int64]outboxRow{}
	for _, id := range ids {
		before[id] = f.MustRow(t, id)
	}

	later := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	var works []*relay.Work
	for i, id := range []int64{pending, done, diverted, processing, moreAttempts} {
		works = append(works, streamWork(id, fmt.Sprint("k", i), relay.Decision{Kind: relay.Later, At: later, Reason: "timeout", Attempts: 2}))
	}
	// No time and no error: due now, and the previous error is kept.
	works = append(works, streamWork(dueNow, "due-now", relay.Decision{Kind: relay.Later}))
	start := time.Now()
	if _, err := f.store.SettleStream(ctx, works, "relay-a"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}

	// Decision.Attempts is the row's count after this pass (the policy
	// adds this pass's attempts to Event.Attempts), so it is stored with
	// GREATEST, never added: the old Settle added Divert.Attempts (1 + 2
	// = 3); the same pass now stores 2.
	got := f.MustRow(t, pending)
	if got.Status != "pending" || got.DivertedAt == nil || !got.AvailableAt.Equal(later) ||
		got.LastError == nil || *got.LastError != "timeout" || got.Attempts != 2 {
		t.Errorf("pending row after diversion = %+v, want pending, handoff_at set, available_at %v, last_error timeout, attempts 2", got, later)
	}
	if got := f.MustRow(t, moreAttempts); got.DivertedAt == nil || got.Attempts != 5 {
		t.Errorf("row with 5 attempts after a diversion of 2 = %+v, want diverted, attempts kept at 5", got)
	}
	got = f.MustRow(t, dueNow)
	if got.DivertedAt == nil || got.AvailableAt.Before(start.Add(-time.Minute)) || got.AvailableAt.After(time.Now().Add(time.Minute)) ||
		got.LastError == nil || *got.LastError != "kept" || got.Attempts != 0 {
		t.Errorf("due-now row after diversion = %+v, want available now, last_error kept, attempts 0", got)
	}
	for name, id := range map[string]int64{"done": done, "diverted": diverted, "processing": processing} {
		if got := f.MustRow(t, id); got.String() != before[id].String() {
			t.Errorf("%s row changed by a diversion: before %v, after %v", name, before[id], got)
		}
	}
}

func TestSettleDeadLetter(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "pending"},
		row{Key: "diverted", Diverted: true},
		row{Key: "done", Status: "done"},
		row{Key: "processing", Status: "processing"},
	)
	var dead []*relay.Work
	for i, id := range ids {
		dead = append(dead, streamWork(id, fmt.Sprint("k", i), relay.Decision{Kind: relay.DeadLetter, Reason: "payload too large", Attempts: 1}))
	}
	if _, err := f.store.SettleStream(ctx, dead, "relay-a"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	// The diverted row stays pending: it is the claim path's, and every
	// stream row change is now conditional on the row being the stream's
	// (pending and not diverted). The old Settle dead-lettered any
	// pending row, racing the claim path for a row it owned.
	for i, want := range []string{"failed", "pending", "done", "processing"} {
		got := f.MustRow(t, ids[i])
		if got.Status != want {
			t.Errorf("row %d status = %s, want %s", i, got.Status, want)
		}
		if want == "failed" && (got.LastError == nil || *got.LastError != "payload too large" || got.ProcessedAt == nil || got.Attempts != 1) {
			t.Errorf("row %d = %+v, want last_error, processed_at and 1 attempt", i, got)
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
	if _, err := f.store.SettleStream(ctx, nil, "relay-a"); err != nil {
		t.Errorf("SettleStream(nil) = %v, want nil", err)
	}
}

func TestSettleIsAtomic(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	// Attempts are no longer added (GREATEST), so the old overflow of
	// 2147483647 + 1 cannot happen: a CHECK constraint refuses the
	// diversion instead.
	f.MustExec(t, `ALTER TABLE integration_outbox ADD CONSTRAINT few_attempts CHECK (attempts < 1000)`)
	ids := f.MustInsert(t, row{Key: "ok"}, row{Key: "refused"})
	_, err := f.store.SettleStream(ctx, []*relay.Work{
		streamWork(0, "ok", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered)),
		streamWork(ids[1], "refused", relay.Decision{Kind: relay.Later, Attempts: 1000}),
		streamWork(ids[0], "ok", relay.Decision{Kind: relay.DeadLetter, Reason: "x"}),
	}, "relay-a")
	if err == nil || !strings.Contains(err.Error(), "divert 1 rows") {
		t.Fatalf("SettleStream = %v, want the diversion's error", err)
	}
	if n := f.MustCount(t, "SELECT count(*) FROM integration_idempotency"); n != 0 {
		t.Errorf("%d ledger rows after a failed Settle, want 0", n)
	}
	if got := f.MustRow(t, ids[0]); got.Status != "pending" {
		t.Errorf("status = %s after a failed Settle, want pending", got.Status)
	}
}

// TestSettleOneTransaction settles 5,000 delivered pairs of 100 rows, with
// diversions and dead letters, and checks they were written by one
// transaction (one xmin): the rows' done status with their ledger rows.
func TestSettleOneTransaction(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsertPending(t, "big", 300)
	var works []*relay.Work
	for i, id := range ids[:100] {
		var pairs []*relay.Pair
		for s := range 50 {
			pairs = append(pairs, outcomePair(fmt.Sprint("sink-", s), relay.Delivered))
		}
		works = append(works, streamWork(id, fmt.Sprint("big-", i+1), relay.Decision{Kind: relay.Done}, pairs...))
	}
	for _, id := range ids[100:200] {
		works = append(works, streamWork(id, fmt.Sprint("h", id), relay.Decision{Kind: relay.Later, Reason: "circuit open"}))
	}
	for _, id := range ids[200:] {
		works = append(works, streamWork(id, fmt.Sprint("d", id), relay.Decision{Kind: relay.DeadLetter, Reason: "rejected"}))
	}
	start := time.Now()
	if _, err := f.store.SettleStream(ctx, works, "relay-a"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	t.Logf("SettleStream of 5,000 delivered pairs of 100 rows, 100 diversions and 100 dead letters took %v", time.Since(start))

	n := f.MustCount(t, `SELECT count(DISTINCT x) FROM (
		SELECT xmin::text AS x FROM integration_idempotency
		UNION ALL SELECT xmin::text FROM integration_outbox) t`)
	if n != 1 {
		t.Errorf("rows written by %d transactions, want 1", n)
	}
	if n := f.MustCount(t, "SELECT count(*) FROM integration_idempotency WHERE state = 'delivered'"); n != 5000 {
		t.Errorf("%d delivered rows, want 5000", n)
	}
	if n := f.MustCount(t, "SELECT count(*) FROM integration_outbox WHERE status = 'done' AND processed_at IS NOT NULL"); n != 100 {
		t.Errorf("%d rows done, want 100", n)
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
	store := mustStore(t, pool, ledger.DefaultConfig())
	w := streamWork(0, "e", relay.Decision{Kind: relay.Done}, outcomePair("a", relay.Delivered))
	if _, err := store.SettleStream(ctx, []*relay.Work{w}, "relay-a"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	var setting string
	if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if setting != "on" {
		t.Errorf("synchronous_commit = %s after SettleStream on the same connection, want on", setting)
	}
}

func TestRestreamed(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "owned"},
		row{Key: "diverted", Diverted: true},
		row{Key: "done", Status: "done"},
		row{Key: "held", Status: "held"},
		row{Key: "owned-fresh"},
	)
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts) VALUES
		('owned', 'webhook', 'delivered', 1), ('owned', 'nats', 'delivered', 1), ('owned', 'hold', 'sending', 1),
		('done', 'webhook', 'delivered', 1)`)
	missing := int64(999_999)

	keys := []string{"owned", "diverted", "done", "held", "owned-fresh", "missing"}
	var works []*relay.Work
	for i, id := range append(ids, missing) {
		// "hold" is not a hold sink here: a 'sending' claim is not a
		// delivery, and nothing is claimed.
		works = append(works, streamWork(id, keys[i], relay.Decision{},
			&relay.Pair{Sink: "hold"}, &relay.Pair{Sink: "nats"}, &relay.Pair{Sink: "webhook"}))
	}
	// The missing row is a streamed one whose transaction is not visible
	// yet (an xid far ahead); a row without a transaction id was read from
	// the table, and missing it is gone (TestGoneTellsADeletedRowReadFromTheTable).
	var xid int64
	if err := f.pool.QueryRow(ctx, `SELECT xmin::text::bigint FROM integration_outbox WHERE id = $1`, ids[0]).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	works[len(works)-1].Event.Xid = uint32(xid + 1_000_000)
	if err := f.store.PrepareStream(ctx, works, true, "relay-a"); err != nil {
		t.Fatalf("PrepareStream: %v", err)
	}
	// What Restreamed reported as Owned and Delivered, PrepareStream now
	// writes into the works: Skip for a row no longer owned, PairDelivered
	// for a sink in Delivered. A missing row not visible yet is left as it
	// is.
	got := map[string]string{}
	for _, w := range works {
		got[w.Event.EventKey] = prepared(w)
	}
	want := map[string]string{
		"owned":       "hold:send nats:delivered webhook:delivered",
		"diverted":    "skip hold:send nats:send webhook:send",
		"done":        "skip hold:send nats:send webhook:delivered",
		"held":        "skip hold:send nats:send webhook:send",
		"owned-fresh": "hold:send nats:send webhook:send",
		"missing":     "hold:send nats:send webhook:send",
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("PrepareStream(restreamed) = %v, want %v", got, want)
	}

	if err := f.store.PrepareStream(ctx, nil, true, "relay-a"); err != nil {
		t.Errorf("PrepareStream(nil) = %v; want nil", err)
	}
}

// prepared renders what Prepare set on w: "skip" and each pair's
// sink:state, with claimed and prev=owner when set.
func prepared(w *relay.Work) string {
	var parts []string
	if w.Skip {
		parts = append(parts, "skip")
	}
	for _, p := range w.Pairs {
		s := p.Sink + ":" + map[relay.PairState]string{
			relay.PairSend: "send", relay.PairDelivered: "delivered", relay.PairBlocked: "blocked", relay.PairUnknown: "unknown",
		}[p.State]
		if p.Claimed {
			s += ",claimed"
		}
		if p.PrevOwner != "" {
			s += ",prev=" + p.PrevOwner
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, " ")
}

// TestRestreamedHugeTransaction crosses the per-query chunk size.
func TestRestreamedHugeTransaction(t *testing.T) {
	f := MustFixture(t)
	ids := f.MustInsertPending(t, "huge", 25_001)
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts)
		SELECT 'huge-' || g, 'webhook', 'delivered', 1 FROM generate_series(1, 25001, 5000) g`)
	f.MustExec(t, `UPDATE integration_outbox SET status = 'done' WHERE event_key = 'huge-25001'`)
	works := make([]*relay.Work, len(ids))
	for i, id := range ids {
		works[i] = streamWork(id, fmt.Sprintf("huge-%d", i+1), relay.Decision{}, &relay.Pair{Sink: "webhook"})
	}
	if err := f.store.PrepareStream(context.Background(), works, true, "relay-a"); err != nil {
		t.Fatalf("PrepareStream: %v", err)
	}
	var skipped, delivered []string
	for _, w := range works {
		if w.Skip {
			skipped = append(skipped, w.Event.EventKey)
		}
		if w.Pairs[0].State == relay.PairDelivered {
			delivered = append(delivered, w.Event.EventKey)
		}
	}
	// One row in each chunk of 10,000 has a delivered pair; the last,
	// in the third chunk, is also done.
	if fmt.Sprint(skipped) != "[huge-25001]" {
		t.Errorf("skipped %v, want [huge-25001]", skipped)
	}
	if want := "[huge-1 huge-5001 huge-10001 huge-15001 huge-20001 huge-25001]"; fmt.Sprint(delivered) != want {
		t.Errorf("delivered %v, want %s", delivered, want)
	}
}

// TestSettleStreamWritesDone: an event decided done gets its status in the
// settlement that writes its delivered ledger rows — also when every pair
// was delivered before (a re-streamed row whose status an earlier version
// left pending) — on a row still the stream's only; a row another owner
// holds is left to it, and a row the statement cannot see is reported.
func TestSettleStreamWritesDone(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "owned"},
		row{Key: "diverted", Diverted: true},
		row{Key: "failed", Status: "failed"},
		row{Key: "held", Status: "held"},
		row{Key: "recorded"},
	)
	recorded := outcomePair("webhook", relay.Delivered)
	recorded.State = relay.PairDelivered
	works := []*relay.Work{
		streamWork(ids[0], "owned", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered)),
		streamWork(ids[1], "diverted", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered)),
		streamWork(ids[2], "failed", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered)),
		streamWork(ids[3], "held", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered)),
		streamWork(ids[4], "recorded", relay.Decision{Kind: relay.Done}, recorded),
		streamWork(999_999, "gone", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered)),
	}
	for range 2 { // safe to repeat
		invisible, err := f.store.SettleStream(ctx, works, "relay-a")
		if err != nil || fmt.Sprint(invisible) != "[999999]" {
			t.Fatalf("SettleStream = %v, %v; want the missing row reported", invisible, err)
		}
	}
	for i, want := range []string{"done", "pending", "failed", "held", "done"} {
		got := f.MustRow(t, ids[i])
		if got.Status != want {
			t.Errorf("row %d status = %s, want %s", i, got.Status, want)
		}
		if want == "done" && got.ProcessedAt == nil {
			t.Errorf("row %d processed_at not set", i)
		}
	}
	if got := f.MustLedger(t, "owned")["webhook"]; got.State != "delivered" {
		t.Errorf("owned/webhook = %+v, want delivered", got)
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
	add(row{Key: "a1", Diverted: true}, "A")
	add(row{Key: "a2", Diverted: true}, "A") // the same aggregate twice
	add(row{Key: "b1", Status: "held"}, "B")
	add(row{Key: "c1"}, "C")                                       // owned by the stream
	add(row{Key: "d1", Status: "done", Diverted: true}, "D")       // settled
	add(row{Key: "e1", Status: "processing", Diverted: true}, "E") // claimed
	add(row{Key: "f1", Status: "failed", Diverted: true}, "F")     // dead letter
	add(row{Key: "n1", Diverted: true}, "")                        // unordered
	rows = append(rows, row{Key: "t1", AggType: ptr("order"), Diverted: true})
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
	_, err := f.store.SettleStream(ctx, []*relay.Work{
		streamWork(ids[0], "k1", relay.Decision{Kind: relay.Later}, outcomePair("webhook", relay.Delivered), outcomePair("nats", relay.Deferred)),
		streamWork(ids[1], "k2", relay.Decision{Kind: relay.DeadLetter, Reason: "bad"}, outcomePair("webhook", relay.Failed)),
	}, "relay-a")
	if err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	done := streamWork(ids[2], "k3", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered))
	if _, err := f.store.SettleStream(ctx, []*relay.Work{done}, "relay-a"); err != nil {
		t.Fatalf("SettleStream(done): %v", err)
	}
	restreamed := []*relay.Work{streamWork(ids[0], "k1", relay.Decision{}, &relay.Pair{Sink: "webhook"})}
	if err := f.store.PrepareStream(ctx, restreamed, true, "relay-a"); err != nil || !restreamed[0].Skip || restreamed[0].Pairs[0].State != relay.PairDelivered {
		t.Fatalf("PrepareStream(restreamed) = %v, %s", err, prepared(restreamed[0]))
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
	if err := f.store.BeginSlot(ctx, "s"); err != nil {
		t.Fatalf("BeginSlot: %v", err)
	}
	if done, err := f.store.HandedOver(ctx, "s"); err != nil || done {
		t.Fatalf("HandedOver after BeginSlot = %v, %v", done, err)
	}
	claims := []*relay.Work{streamWork(0, "k9", relay.Decision{}, &relay.Pair{Sink: "hold", Hold: true})}
	if err := f.store.PrepareStream(ctx, claims, false, "me"); err != nil || !claims[0].Pairs[0].Claimed {
		t.Fatalf("PrepareStream(hold claim) = %v, %s", err, prepared(claims[0]))
	}
	held := &relay.Pair{Sink: "hold", Hold: true, Claimed: true, Outcome: relay.Outcome{Kind: relay.Held, Reason: "no answer"}}
	if _, err := f.store.SettleStream(ctx, []*relay.Work{streamWork(ids[2], "k3", relay.Decision{Kind: relay.Hold, Reason: "no answer"}, held)}, "me"); err != nil {
		t.Fatalf("SettleStream(hold): %v", err)
	}
	if got := f.MustRow(t, ids[2]); got.Status != "done" {
		t.Errorf("k3 status = %s, want done (its settlement ran first)", got.Status)
	}
	if got := f.MustLedger(t, "k3")["hold"]; got.State != "unknown" {
		t.Errorf("k3/hold = %+v, want unknown", got)
	}
}

func BenchmarkSettle(b *testing.B) {
	for _, pairs := range []int{5, 1000} {
		b.Run(fmt.Sprint(pairs, "-pairs"), func(b *testing.B) { benchmarkSettle(b, pairs) })
	}
}

func benchmarkSettle(b *testing.B, pairs int) {
	f := MustFixture(b)
	ctx := context.Background()
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		works := make([]*relay.Work, pairs)
		for i := range works {
			works[i] = streamWork(0, fmt.Sprintf("bench-%d", n), relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered))
			n++
		}
		if _, err := f.store.SettleStream(ctx, works, "relay-a"); err != nil {
			b.Fatalf("SettleStream: %v", err)
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
	divert := []*relay.Work{streamWork(id, "invisible", relay.Decision{Kind: relay.Later, Reason: "503"})}
	invisible, err := f.store.SettleStream(ctx, divert, "relay-a")
	if err != nil || len(invisible) != 1 || invisible[0] != id {
		t.Fatalf("SettleStream reported %v (%v), want [%d]", invisible, err, id)
	}
	done := []*relay.Work{streamWork(id, "invisible", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered))}
	if invisible, err = f.store.SettleStream(ctx, done, "relay-a"); err != nil || len(invisible) != 1 {
		t.Fatalf("SettleStream(done) reported %v (%v), want [%d]", invisible, err, id)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if invisible, err = f.store.SettleStream(ctx, divert, "relay-a"); err != nil || len(invisible) != 0 {
		t.Fatalf("after commit: %v (%v)", invisible, err)
	}
}

// TestPrepareStream: restreamed works whose row is no longer the stream's
// are Skip and the ledger's delivered pairs PairDelivered; pairs of hold
// sinks are claimed for the owner, or found delivered, or found claimed by
// another (PairUnknown, with the previous owner). Skipped works claim
// nothing.
func TestPrepareStream(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "a"}, row{Key: "b", Status: "done"}, row{Key: "c"}, row{Key: "d"}, row{Key: "e"})
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, owner) VALUES
		('c', 'erp', 'delivered', 1, NULL), ('d', 'erp', 'sending', 1, 'relay-x'), ('e', 'erp', 'unknown', 1, 'relay-y'),
		('f', 'erp', 'delivered', 1, NULL)`)
	works := []*relay.Work{
		streamWork(ids[0], "a", relay.Decision{}, holdPair("erp"), &relay.Pair{Sink: "webhook"}),
		streamWork(ids[1], "b", relay.Decision{}, holdPair("erp")),
		streamWork(ids[2], "c", relay.Decision{}, holdPair("erp")),
		streamWork(ids[3], "d", relay.Decision{}, holdPair("erp")),
		streamWork(ids[4], "e", relay.Decision{}, holdPair("erp")),
	}
	if err := f.store.PrepareStream(ctx, works, true, "relay-a"); err != nil {
		t.Fatalf("PrepareStream: %v", err)
	}
	want := []string{
		"erp:send,claimed webhook:send", // claimed; the other sink is not a hold sink
		"skip erp:send",                 // done before the restart: not claimed
		"erp:delivered",                 // the ledger shows it delivered
		"erp:unknown,prev=relay-x",      // relay-x's claim: outcome unknown
		"erp:send,claimed",              // unknown (released by dlq retry): claimed again
	}
	for i, w := range works {
		if got := prepared(w); got != want[i] {
			t.Errorf("%s: %s, want %s", w.Event.EventKey, got, want[i])
		}
	}
	if l := f.MustLedger(t, "e")["erp"]; l.State != "sending" || *l.Owner != "relay-a" || l.Attempts != 2 {
		t.Errorf("e/erp = %+v, want sending by relay-a, 2 attempts", l)
	}
	if l := f.MustLedger(t, "d")["erp"]; l.State != "sending" || *l.Owner != "relay-x" {
		t.Errorf("d/erp = %+v, want relay-x's claim kept", l)
	}
	if l, ok := f.MustLedger(t, "b")["erp"]; ok {
		t.Errorf("b/erp = %+v, want no claim for a skipped work", l)
	}

	// Not restreamed: rows are not read, so a done row's work is not
	// skipped; a delivered pair is found by its refused claim.
	works = []*relay.Work{
		streamWork(ids[1], "b", relay.Decision{}, holdPair("erp")),
		streamWork(0, "f", relay.Decision{}, holdPair("erp")),
	}
	if err := f.store.PrepareStream(ctx, works, false, "relay-a"); err != nil {
		t.Fatalf("PrepareStream: %v", err)
	}
	if got := prepared(works[0]) + " | " + prepared(works[1]); got != "erp:send,claimed | erp:delivered" {
		t.Errorf("PrepareStream(not restreamed) = %s, want erp:send,claimed | erp:delivered", got)
	}

	// Nothing to check or claim: no round trip (a cancelled context would
	// fail it).
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	plain := []*relay.Work{streamWork(ids[0], "a", relay.Decision{}, &relay.Pair{Sink: "webhook"})}
	if err := f.store.PrepareStream(cancelled, plain, false, "relay-a"); err != nil {
		t.Errorf("PrepareStream(no hold pairs) = %v, want nil", err)
	}
}

// TestSettleStreamPairs: a pair's outcome decides its ledger row. Delivered:
// delivered (insert-only). A claim whose outcome is unknown: 'unknown', with
// the reason (held) or "outcome unknown: reason". A claim whose send is
// known not to have reached the sink (deferred, refused): withdrawn, only
// when it is the owner's. A pair never claimed and not delivered: nothing.
func TestSettleStreamPairs(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	keys := []string{"deferred", "failed", "other-owner", "unknown", "held", "delivered", "not-claimed", "delivered-held"}
	var rows []row
	for _, k := range keys {
		rows = append(rows, row{Key: k})
	}
	ids := f.MustInsert(t, rows...)
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, owner, claimed_at) VALUES
		('deferred', 'erp', 'sending', 1, 'relay-a', now()), ('failed', 'erp', 'sending', 1, 'relay-a', now()),
		('other-owner', 'erp', 'sending', 1, 'relay-b', now()), ('unknown', 'erp', 'sending', 1, 'relay-a', now()),
		('held', 'erp', 'sending', 1, 'relay-a', now()), ('delivered', 'erp', 'sending', 3, 'relay-a', now()),
		('delivered-held', 'erp', 'delivered', 1, NULL, NULL)`)
	claimed := func(o relay.Outcome) *relay.Pair {
		return &relay.Pair{Sink: "erp", Hold: true, Claimed: true, Outcome: o}
	}
	later := relay.Decision{Kind: relay.Later, Reason: "sink erp: x", Attempts: 1}
	works := []*relay.Work{
		streamWork(ids[0], keys[0], later, claimed(relay.Outcome{Kind: relay.Deferred, Reason: "circuit open"})),
		streamWork(ids[1], keys[1], relay.Decision{Kind: relay.DeadLetter, Reason: "400"}, claimed(relay.Outcome{Kind: relay.Failed, Reason: "400"})),
		streamWork(ids[2], keys[2], later, claimed(relay.Outcome{Kind: relay.Deferred, Reason: "lane full"})),
		streamWork(ids[3], keys[3], later, claimed(relay.Outcome{Kind: relay.Retry, Reason: "timeout", Unknown: true})),
		streamWork(ids[4], keys[4], relay.Decision{Kind: relay.Hold, Reason: "no answer"}, claimed(relay.Outcome{Kind: relay.Held, Reason: "no answer", Unknown: true})),
		streamWork(ids[5], keys[5], relay.Decision{Kind: relay.Done}, claimed(relay.Outcome{Kind: relay.Delivered})),
		streamWork(ids[6], keys[6], later, &relay.Pair{Sink: "erp", Hold: true, Outcome: relay.Outcome{Kind: relay.Deferred}}),
		streamWork(ids[7], keys[7], relay.Decision{Kind: relay.Hold, Reason: "no answer"}, claimed(relay.Outcome{Kind: relay.Held, Reason: "no answer", Unknown: true})),
	}
	if _, err := f.store.SettleStream(ctx, works, "relay-a"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	want := map[string]string{
		"deferred":       "none",
		"failed":         "none",
		"other-owner":    "sending owner=relay-b detail=NULL",
		"unknown":        "unknown owner=relay-a detail=outcome unknown: timeout",
		"held":           "unknown owner=relay-a detail=no answer",
		"delivered":      "delivered owner=relay-a detail=NULL",
		"not-claimed":    "none",
		"delivered-held": "delivered owner=NULL detail=NULL",
	}
	for _, k := range keys {
		got := "none"
		if l, ok := f.MustLedger(t, k)["erp"]; ok {
			got = fmt.Sprintf("%s owner=%s detail=%s", l.State, deref(l.Owner), deref(l.Detail))
		}
		if got != want[k] {
			t.Errorf("%s/erp: %s, want %s", k, got, want[k])
		}
	}
	if l := f.MustLedger(t, "delivered")["erp"]; l.Attempts != 3 || l.DeliveredAt == nil {
		t.Errorf("delivered/erp = %+v, want the claim's 3 attempts and delivered_at", l)
	}
}

// TestSettleStreamOnlyStreamRows: every row change of every decision kind
// is conditional on the row being the stream's (pending, not diverted).
func TestSettleStreamOnlyStreamRows(t *testing.T) {
	decisions := map[string]relay.Decision{
		"later":       {Kind: relay.Later, Reason: "503", Attempts: 4},
		"dead letter": {Kind: relay.DeadLetter, Reason: "400", Attempts: 4},
		"hold":        {Kind: relay.Hold, Reason: "no answer", Attempts: 4},
	}
	for name, d := range decisions {
		t.Run(name, func(t *testing.T) {
			f := MustFixture(t)
			ctx := context.Background()
			ids := f.MustInsert(t,
				row{Key: "pending"},
				row{Key: "diverted", Diverted: true},
				row{Key: "processing", Status: "processing", Diverted: true},
				row{Key: "done", Status: "done"},
				row{Key: "failed", Status: "failed"},
				row{Key: "held", Status: "held"},
			)
			before := map[int64]outboxRow{}
			var works []*relay.Work
			for _, id := range ids {
				before[id] = f.MustRow(t, id)
				works = append(works, streamWork(id, fmt.Sprint("k", id), d))
			}
			for range 2 { // safe to repeat
				if invisible, err := f.store.SettleStream(ctx, works, "relay-a"); err != nil || len(invisible) != 0 {
					t.Fatalf("SettleStream = %v, %v", invisible, err)
				}
			}
			got := f.MustRow(t, ids[0])
			if got.Attempts != 4 || got.LastError == nil || *got.LastError != d.Reason {
				t.Errorf("pending row = %v, want 4 attempts and last_error %q", got, d.Reason)
			}
			for _, id := range ids[1:] {
				if got := f.MustRow(t, id); got.String() != before[id].String() {
					t.Errorf("row %d changed: before %v, after %v", id, before[id], got)
				}
			}
		})
	}
}

// TestSettleStreamRowDataError: PostgreSQL refusing a row's data (SQLSTATE
// class 22 or 23) comes back wrapping relay.ErrRowData, naming the step, and
// nothing of the batch is written; a lost connection does not wrap it.
func TestSettleStreamRowDataError(t *testing.T) {
	tests := []struct {
		name  string
		setup string
		d     relay.Decision
		step  string
		data  bool
	}{
		{
			name:  "status refuses held",
			setup: `ALTER TABLE integration_outbox ADD CONSTRAINT never_held CHECK (status <> 'held')`,
			d:     relay.Decision{Kind: relay.Hold, Reason: "no answer"},
			step:  "hold 1 rows",
			data:  true,
		},
		{
			name:  "last_error longer than its varchar",
			setup: `ALTER TABLE integration_outbox ALTER COLUMN last_error TYPE varchar(20)`,
			d:     relay.Decision{Kind: relay.DeadLetter, Reason: strings.Repeat("too long ", 10)},
			step:  "dead-letter 1 rows",
			data:  true,
		},
		{
			name: "connection lost",
			setup: `CREATE FUNCTION cut() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); RETURN NEW; END $$;
				CREATE TRIGGER cut BEFORE UPDATE ON integration_outbox FOR EACH ROW EXECUTE FUNCTION cut()`,
			d:    relay.Decision{Kind: relay.Later, Reason: "503"},
			step: "divert 1 rows",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := MustFixture(t)
			ctx := context.Background()
			f.MustExec(t, tt.setup)
			ids := f.MustInsert(t, row{Key: "refused"})
			works := []*relay.Work{
				streamWork(0, "other", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered)),
				streamWork(ids[0], "refused", tt.d),
			}
			_, err := f.store.SettleStream(ctx, works, "relay-a")
			if err == nil {
				t.Fatal("SettleStream = nil, want an error")
			}
			t.Logf("SettleStream: %v", err)
			if errors.Is(err, relay.ErrRowData) != tt.data {
				t.Errorf("errors.Is(%v, ErrRowData) = %v, want %v", err, !tt.data, tt.data)
			}
			if tt.data && !strings.Contains(err.Error(), tt.step) {
				t.Errorf("error %v does not name the step %q", err, tt.step)
			}
			if n := f.MustCount(t, "SELECT count(*) FROM integration_idempotency"); n != 0 {
				t.Errorf("%d ledger rows after a failed SettleStream, want 0", n)
			}
			if got := f.MustRow(t, ids[0]); got.Status != "pending" || got.DivertedAt != nil || got.LastError != nil {
				t.Errorf("row after a failed SettleStream = %v, want untouched", got)
			}
		})
	}
}

// TestSettleStreamReportsInvisibleRowsOfEveryKind: diversions, dead letters
// and holds of rows inserted by a transaction not yet committed change
// nothing and return those ids; once it commits, the same call writes them.
func TestSettleStreamReportsInvisibleRowsOfEveryKind(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	visible := f.MustInsert(t, row{Key: "visible"})
	tx, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, `INSERT INTO integration_outbox (event_key, payload)
		SELECT k, '{}' FROM unnest(ARRAY['later', 'dead', 'held']) AS k RETURNING id`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	works := []*relay.Work{
		streamWork(ids[0], "later", relay.Decision{Kind: relay.Later, Reason: "503", Attempts: 1}),
		streamWork(ids[1], "dead", relay.Decision{Kind: relay.DeadLetter, Reason: "400", Attempts: 1}),
		streamWork(ids[2], "held", relay.Decision{Kind: relay.Hold, Reason: "no answer", Attempts: 1}),
		streamWork(visible[0], "visible", relay.Decision{Kind: relay.Later, Reason: "503", Attempts: 1}),
	}
	invisible, err := f.store.SettleStream(ctx, works, "relay-a")
	slices.Sort(invisible)
	if err != nil || !slices.Equal(invisible, ids) {
		t.Fatalf("SettleStream = %v, %v; want the uncommitted rows %v", invisible, err, ids)
	}
	if got := f.MustRow(t, visible[0]); got.DivertedAt == nil {
		t.Errorf("visible row = %v, want diverted beside the invisible ones", got)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if invisible, err := f.store.SettleStream(ctx, works, "relay-a"); err != nil || len(invisible) != 0 {
		t.Fatalf("after commit: SettleStream = %v, %v; want nothing invisible", invisible, err)
	}
	for i, want := range []string{"pending diverted", "failed", "held"} {
		got := f.MustRow(t, ids[i])
		status := got.Status
		if got.DivertedAt != nil {
			status += " diverted"
		}
		if status != want || got.Attempts != 1 {
			t.Errorf("%s row = %v, want %s with 1 attempt", works[i].Event.EventKey, got, want)
		}
	}
}

// TestSettleStreamStoresAnyReason: a reason PostgreSQL's text would refuse
// (a NUL byte, invalid UTF-8) or too long for a column is stored as
// relay.ShortError makes it, for every decision kind and a held pair's
// detail, instead of failing the batch.
func TestSettleStreamStoresAnyReason(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "later"}, row{Key: "dead"}, row{Key: "held"})
	reason := "bad\x00byte\xff " + strings.Repeat("é", 400)
	held := &relay.Pair{Sink: "erp", Hold: true, Claimed: true, Outcome: relay.Outcome{Kind: relay.Held, Reason: reason, Unknown: true}}
	works := []*relay.Work{
		streamWork(ids[0], "later", relay.Decision{Kind: relay.Later, Reason: reason}),
		streamWork(ids[1], "dead", relay.Decision{Kind: relay.DeadLetter, Reason: reason}),
		streamWork(ids[2], "held", relay.Decision{Kind: relay.Hold, Reason: reason}, held),
	}
	if _, err := f.store.SettleStream(ctx, works, "relay-a"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	want := relay.ShortError(reason)
	if len(want) > 500 || strings.ContainsRune(want, 0) || !utf8.ValidString(want) {
		t.Fatalf("ShortError(reason) = %q, not storable", want)
	}
	for i, id := range ids {
		if got := f.MustRow(t, id); got.LastError == nil || *got.LastError != want {
			t.Errorf("%s: last_error = %q, want %q", works[i].Event.EventKey, deref(got.LastError), want)
		}
	}
	if l := f.MustLedger(t, "held")["erp"]; l.Detail == nil || *l.Detail != want {
		t.Errorf("held/erp detail = %q, want %q", deref(l.Detail), want)
	}
}

// TestPendingScanSeesOnlyTheStreamsRows: the pending scan (Stuck, Stats)
// finds the rows pending and not diverted — and only those — among many
// the stream settled, by their status alone: a pending row is watched even
// when the ledger shows it delivered (an earlier version left its status
// pending; reconcile hands it to the claim path), and a row leaves the
// watch list once its status is written.
func TestPendingScanSeesOnlyTheStreamsRows(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	store := f.store
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := f.pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// 120,000 rows an hour old, all done but 5, of which 2 are handed
	// off; a young one.
	exec(`INSERT INTO integration_outbox (event_key, payload, created_at, available_at, status, processed_at)
		SELECT 'k' || g, '{}', now() - interval '1 hour', now() - interval '1 hour',
		       CASE WHEN g IN (7, 8, 9, 60001, 119999) THEN 'pending' ELSE 'done' END,
		       CASE WHEN g NOT IN (7, 8, 9, 60001, 119999) THEN now() END
		  FROM generate_series(1, 120000) g`)
	exec(`INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		SELECT event_key, 'nats', 'delivered', 1, now() FROM integration_outbox WHERE id = 60001`)
	exec(`UPDATE integration_outbox SET handoff_at = now() WHERE id IN (8, 9)`)
	exec(`INSERT INTO integration_outbox (event_key, payload) VALUES ('young', '{}')`)

	var rows int64
	var err error
	for step := 0; step < 3; step++ { // a first walk of 120,000 ids takes a step
		if rows, _, err = store.Stuck(ctx, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	if rows != 3 {
		t.Fatalf("Stuck = %d rows, want 3 (ids 7, 60001, 119999)", rows)
	}
	st, err := store.Stats(ctx, "outbox_relay", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if st.Rows["pending"] != 6 || st.Stuck != 3 {
		t.Fatalf("Stats: pending %d, stuck %d; want 6 (3 stuck, 2 diverted, 1 young) and 3", st.Rows["pending"], st.Stuck)
	}
	// Settled at last: no longer watched.
	exec(`UPDATE integration_outbox SET status = 'done', processed_at = now() WHERE id IN (7, 60001, 119999)`)
	if rows, _, err = store.Stuck(ctx, time.Minute); err != nil || rows != 0 {
		t.Fatalf("Stuck after settling = %d, %v; want 0", rows, err)
	}
}

// TestRestreamSeesDeliveriesSettledAsynchronously: a stream event settled
// as delivered has its ledger rows as soon as SettleStream returns (an
// asynchronous commit is visible at once, before the checkpoint makes it
// durable): when the slot sends it again after a reconnect, every pair is
// found delivered and nothing is sent again. Before, the stream's
// deliveries waited in memory (the delivered record) and a re-stream that
// met such an id skipped it without counting it, so the slot was
// acknowledged past it with no synchronous write (issue: one record of
// delivery).
func TestRestreamSeesDeliveriesSettledAsynchronously(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "sent"}, row{Key: "not-sent"})
	done := relay.Decision{Kind: relay.Done}
	if _, err := f.store.SettleStream(ctx, []*relay.Work{
		streamWork(ids[0], "sent", done, outcomePair("webhook", relay.Delivered), outcomePair("nats", relay.Delivered)),
	}, "relay-a"); err != nil {
		t.Fatal(err)
	}
	again := []*relay.Work{
		streamWork(ids[0], "sent", relay.Decision{}, &relay.Pair{Sink: "webhook"}, &relay.Pair{Sink: "nats"}),
		streamWork(ids[1], "not-sent", relay.Decision{}, &relay.Pair{Sink: "webhook"}, &relay.Pair{Sink: "nats"}),
	}
	if err := f.store.PrepareStream(ctx, again, true, "relay-a"); err != nil {
		t.Fatalf("PrepareStream: %v", err)
	}
	for _, p := range again[0].Pairs {
		if p.State != relay.PairDelivered {
			t.Errorf("the delivered event, re-streamed: %s; want every pair delivered", prepared(again[0]))
		}
	}
	for _, p := range again[1].Pairs {
		if again[1].Skip || p.State != relay.PairSend {
			t.Errorf("the undelivered event, re-streamed: %s; want it sent", prepared(again[1]))
		}
	}
	for _, key := range []string{"sent"} {
		for sink, l := range f.MustLedger(t, key) {
			if l.State != "delivered" {
				t.Errorf("%s/%s = %+v, want delivered", key, sink, l)
			}
		}
	}
}

// TestPendingScanKeepsARetriedRow: in poll mode every pending row is the
// claim path's and none is diverted. A row on the scan's watch list that
// the claim path takes (processing) and puts back (a retry) must be
// counted pending again: the walk never revisits ids below its floor, so
// before, such a row was lost to the gauges — pending 0, done +1, oldest
// pending age 0 — and the oldest-pending alert never fired during a sink
// outage in poll mode.
func TestPendingScanKeepsARetriedRow(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "retried"})
	f.MustExec(t, `UPDATE integration_outbox SET created_at = now() - interval '10 minutes', available_at = now() - interval '10 minutes'`)
	stats := func() ledger.Stats {
		t.Helper()
		st, err := f.store.Stats(ctx, "no_slot", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	if st := stats(); st.Rows["pending"] != 1 || st.Stuck != 1 {
		t.Fatalf("a pending row: %+v", st)
	}
	f.MustExec(t, `UPDATE integration_outbox SET status = 'processing', locked_by = 'outbox-relay:x', locked_at = now() WHERE id = $1`, ids[0])
	if st := stats(); st.Rows["processing"] != 1 || st.Rows["pending"] != 0 {
		t.Fatalf("the row claimed: %+v", st)
	}
	f.MustExec(t, `UPDATE integration_outbox SET status = 'pending', locked_by = NULL, locked_at = NULL, attempts = 1 WHERE id = $1`, ids[0])
	st := stats()
	if st.Rows["pending"] != 1 || st.Rows["done"] != 0 || st.OldestPendingAge < 9*time.Minute || st.Stuck != 1 {
		t.Fatalf("the row back to pending after a retry: pending %d, done %d, oldest pending %v, stuck %d; want 1, 0, about 10m, 1",
			st.Rows["pending"], st.Rows["done"], st.OldestPendingAge, st.Stuck)
	}
}

// TestRestreamedRowPrunedIsSkipped: after a crash of PostgreSQL a slot may
// send again transactions it had confirmed before its last checkpoint
// (the confirmed position is saved with the slot at checkpoints), and
// retention may have pruned those rows meanwhile: it goes by the position
// it saw. An event re-streamed whose row was deleted (its inserting
// transaction is visible, the row is not) was delivered and pruned, or
// deleted by its owner: it is skipped, never sent again (make chaos, full
// profile: about 2,000 events re-sent to both sinks after a postgres-restart,
// each with a second delivered ledger row beside the pruned one). A row
// not visible yet is still sent (docs/guarantees.md, "A key published
// again after its row was pruned is a new event").
func TestRestreamedRowPrunedIsSkipped(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "pruned", Status: "done"}, row{Key: "kept"})
	var xid int64
	if err := f.pool.QueryRow(ctx, `SELECT xmin::text::bigint FROM integration_outbox WHERE id = $1`, ids[0]).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	f.MustExec(t, `DELETE FROM integration_outbox WHERE id = $1`, ids[0])

	pruned := streamWork(ids[0], "pruned", relay.Decision{}, &relay.Pair{Sink: "nats"}, &relay.Pair{Sink: "webhook"})
	pruned.Event.Xid = uint32(xid)
	kept := streamWork(ids[1], "kept", relay.Decision{}, &relay.Pair{Sink: "nats"}, &relay.Pair{Sink: "webhook"})
	// A row whose transaction is not visible yet (an xid far ahead): sent.
	unseen := streamWork(999_999, "unseen", relay.Decision{}, &relay.Pair{Sink: "nats"})
	unseen.Event.Xid = uint32(xid + 1_000_000)
	if err := f.store.PrepareStream(ctx, []*relay.Work{pruned, kept, unseen}, true, "relay-a"); err != nil {
		t.Fatalf("PrepareStream: %v", err)
	}
	got := map[string]string{"pruned": prepared(pruned), "kept": prepared(kept), "unseen": prepared(unseen)}
	want := map[string]string{"pruned": "skip nats:send webhook:send", "kept": "nats:send webhook:send", "unseen": "nats:send"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("PrepareStream(restreamed) = %v, want %v", got, want)
	}
}

// TestGoneTellsADeletedRowReadFromTheTable: a row read from the table — a
// new slot's hand-over, the claim path — carries no transaction id
// (Event.Xid 0); it was visible when read, so if it cannot be found now it
// was deleted: Gone reports it, and PrepareStream skips it as it skips a
// re-streamed row that was pruned. A streamed row whose transaction is not
// visible yet is not reported. Before, Gone left every row without a
// transaction id out, and a hand-over's row deleted before its outcome was
// written was written again every second, forever.
func TestGoneTellsADeletedRowReadFromTheTable(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "read-then-deleted"}, row{Key: "kept"})
	var xid int64
	if err := f.pool.QueryRow(ctx, `SELECT xmin::text::bigint FROM integration_outbox WHERE id = $1`, ids[1]).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	f.MustExec(t, `DELETE FROM integration_outbox WHERE id = $1`, ids[0])

	deleted := streamWork(ids[0], "read-then-deleted", relay.Decision{}, &relay.Pair{Sink: "nats"})
	kept := streamWork(ids[1], "kept", relay.Decision{}, &relay.Pair{Sink: "nats"})
	unseen := streamWork(999_999, "unseen", relay.Decision{}, &relay.Pair{Sink: "nats"})
	unseen.Event.Xid = uint32(xid + 1_000_000) // committed, not visible yet
	gone, err := f.store.Gone(ctx, []*relay.Work{deleted, kept, unseen})
	if err != nil {
		t.Fatalf("Gone: %v", err)
	}
	if !slices.Equal(gone, []int64{ids[0]}) {
		t.Errorf("Gone = %v, want [%d]: the row read from the table and deleted since", gone, ids[0])
	}
	if err := f.store.PrepareStream(ctx, []*relay.Work{deleted, kept}, true, "relay-a"); err != nil {
		t.Fatalf("PrepareStream: %v", err)
	}
	if got := prepared(deleted) + " / " + prepared(kept); got != "skip nats:send / nats:send" {
		t.Errorf("PrepareStream(restreamed) = %s, want the deleted row skipped and the other sent", got)
	}
}
