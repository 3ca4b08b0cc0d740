package ledger_test

import (
	"context"
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// claimIDs claims for owner and returns the ids claimed, by aggregate id.
func claimIDs(tb testing.TB, db *claimDB, owner string, limit int) map[string][]int64 {
	tb.Helper()
	works, err := db.store.Claim(context.Background(), relay.ClaimQuery{All: true, Limit: limit, Owner: owner})
	if err != nil {
		tb.Fatalf("claim: %v", err)
	}
	out := map[string][]int64{}
	var all []int64
	for _, w := range works {
		all = append(all, w.Event.ID)
		agg := "-"
		if w.Event.AggregateID != nil {
			agg = *w.Event.AggregateID
		}
		out[agg] = append(out[agg], w.Event.ID)
	}
	if !slices.IsSorted(all) {
		tb.Errorf("claimed ids not in id order: %v", all)
	}
	return out
}

// insertRows inserts n pending due rows of each aggregate, interleaved, and
// returns their ids by aggregate in id order.
func insertRows(tb testing.TB, db *claimDB, n int, aggs ...string) map[string][]int64 {
	tb.Helper()
	ids := map[string][]int64{}
	for i := range n {
		for _, a := range aggs {
			var id int64
			err := db.pool.QueryRow(context.Background(), `
				INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at)
				VALUES ('order.placed', 'order', $1, $1 || '-' || $2::int, '{}', now() - interval '1 minute') RETURNING id`, a, i).Scan(&id)
			if err != nil {
				tb.Fatal(err)
			}
			ids[a] = append(ids[a], id)
		}
	}
	return ids
}

// insertBacklogAndRecent inserts n diverted rows over 100 aggregates, due
// an hour ago, and aggregate z's run: a row due 10 minutes ago and two due a
// second ago; it returns z's ids.
func insertBacklogAndRecent(tb testing.TB, db *claimDB, n int) []int64 {
	tb.Helper()
	ctx := context.Background()
	_, err := db.pool.Exec(ctx, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at, handoff_at)
		SELECT 'order.placed', 'order', 'a' || (i % 100), 'k' || i, '{}', now() - interval '1 hour' + i * interval '1 ms', now()
		  FROM generate_series(1, $1::int) AS i`, n)
	if err != nil {
		tb.Fatal(err)
	}
	var z []int64
	for i, at := range []string{"now() - interval '10 minutes'", "now() - interval '1 second'", "now() - interval '1 second'"} {
		var id int64
		err := db.pool.QueryRow(ctx, `
			INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at, handoff_at)
			VALUES ('order.placed', 'order', 'z', 'z-' || $1::int, '{}', `+at+`, now()) RETURNING id`, i).Scan(&id)
		if err != nil {
			tb.Fatal(err)
		}
		z = append(z, id)
	}
	return z
}

// A claim takes runs: several rows of a hot aggregate at once, in id order,
// shared among the aggregates (docs/guarantees.md "Claim
// runs"). The claim of one row per aggregate per round took 1 row of each.
func TestClaimTakesRunsOfAnAggregate(t *testing.T) {
	db := mustClaimDB(t)
	ids := insertRows(t, db, 40, "a", "b")
	got := claimIDs(t, db, ledger.NewOwner(), 50)
	if want := ids["a"][:25]; !slices.Equal(got["a"], want) {
		t.Errorf("aggregate a: claimed %v, want its first 25 rows %v", got["a"], want)
	}
	if want := ids["b"][:25]; !slices.Equal(got["b"], want) {
		t.Errorf("aggregate b: claimed %v, want its first 25 rows %v", got["b"], want)
	}
}

// A run never starts behind, nor passes, a row another relay claimed and
// has not settled: the claim reads processing rows in its ordering check
// and where a run stops, and a run ends before a row another claimer has
// locked.
func TestClaimRunRespectsTheOtherRelaysRows(t *testing.T) {
	db := mustClaimDB(t)
	ctx := context.Background()
	ids := insertRows(t, db, 10, "a")["a"]

	// Relay X has rows 3 and 4 of a (ids[2], ids[3]) in flight: a claim
	// takes only the rows before them.
	db.exec(t, `UPDATE integration_outbox SET status = 'processing', locked_at = now(), locked_by = 'outbox-relay:x' WHERE id = ANY($1)`, ids[2:4])
	if got := claimIDs(t, db, ledger.NewOwner(), 50)["a"]; !slices.Equal(got, ids[:2]) {
		t.Fatalf("claimed %v with rows %v in flight at another relay, want %v (the run stops before them)", got, ids[2:4], ids[:2])
	}
	// Rows 1-2 are now ours, in flight: the next claim takes nothing of a
	// (rows 5… are behind rows 1-4).
	if got := claimIDs(t, db, ledger.NewOwner(), 50)["a"]; len(got) != 0 {
		t.Fatalf("claimed %v behind rows in flight, want nothing", got)
	}
	db.exec(t, `UPDATE integration_outbox SET status = 'done', locked_at = NULL, locked_by = NULL WHERE id = ANY($1)`, ids[:4])

	// Another claimer holds row 7 (ids[6]) locked, its claim not
	// committed yet: the run ends before it.
	tx, err := db.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM integration_outbox WHERE id = $1 FOR UPDATE`, ids[6]); err != nil {
		t.Fatal(err)
	}
	if got := claimIDs(t, db, ledger.NewOwner(), 50)["a"]; !slices.Equal(got, ids[4:6]) {
		t.Fatalf("claimed %v with row %d locked by another claimer, want %v", got, ids[6], ids[4:6])
	}
	if err := tx.Rollback(ctx); err != nil && err != pgx.ErrTxClosed {
		t.Fatal(err)
	}
}

// A row not due yet (a retry's backoff, a scheduled row) ends its
// aggregate's run: the rows after it wait for it.
func TestClaimRunStopsAtARowNotDue(t *testing.T) {
	db := mustClaimDB(t)
	ids := insertRows(t, db, 6, "a")["a"]
	db.exec(t, `UPDATE integration_outbox SET available_at = now() + interval '1 hour' WHERE id = $1`, ids[3])
	if got := claimIDs(t, db, ledger.NewOwner(), 50)["a"]; !slices.Equal(got, ids[:3]) {
		t.Fatalf("claimed %v, want %v (the run stops before the row not due)", got, ids[:3])
	}
}

// Aggregates held back at the front of a backlog do not starve the rows
// behind them: a claim whose window is full of rows that must wait looks
// further on.
func TestClaimLooksPastAHeldBackFront(t *testing.T) {
	db := mustClaimDB(t)
	// 3,000 rows of aggregate h behind a held row, then one row of c.
	db.exec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, available_at)
		SELECT 'order.placed', 'order', 'h', 'h-' || g, '{}', CASE WHEN g = 1 THEN 'held' ELSE 'pending' END,
		       now() - interval '1 hour' + g * interval '1 millisecond'
		  FROM generate_series(1, 3000) AS g`)
	db.exec(t, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at)
		VALUES ('order.placed', 'order', 'c', 'c-1', '{}', now() - interval '1 minute')`)
	var got map[string][]int64
	for range 3 {
		if got = claimIDs(t, db, ledger.NewOwner(), 100); len(got["c"]) == 1 {
			break
		}
	}
	if len(got["c"]) != 1 || len(got["h"]) != 0 {
		t.Fatalf("claimed %v, want c's row and none of h's (held back)", got)
	}
}

// Rows written by concurrent transactions have available_at (their
// transaction's now()) out of id order: an aggregate's lower ids may be due
// later than its higher ones, outside the claim's window of the oldest due
// rows. The run still starts at the aggregate's lowest row (make bench's
// drain-claim, four writers: the claim took nothing, each aggregate's window
// head waiting behind its lower rows due a few milliseconds later).
func TestClaimRunStartsBelowTheWindow(t *testing.T) {
	db := mustClaimDB(t)
	ids := insertRows(t, db, 3000, "a")["a"]
	// The first 1,500 rows are due after the others.
	db.exec(t, `UPDATE integration_outbox SET available_at = now() - interval '1 second' WHERE id <= $1`, ids[1499])
	got := claimIDs(t, db, ledger.NewOwner(), 50)["a"]
	if !slices.Equal(got, ids[:50]) {
		t.Fatalf("claimed %v…, want the aggregate's first 50 rows %v…", got[:min(len(got), 5)], ids[:5])
	}
}

// A hand-over marks thousands of rows at once, and the planner's
// statistics of the diversion index then say it is empty. The claim's lock
// step must still reach the chosen rows by id: planned through that index
// it scanned every diverted row for each chosen row (make bench's
// slot-recreated: 30 s per claim over 200,000 rows).
func TestClaimLocksChosenRowsByIDAfterAHandOver(t *testing.T) {
	db := mustClaimDB(t)
	db.exec(t, `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, available_at)
		SELECT 'e', 'a', (g % 100)::text, 'k' || g, '{}', now() - interval '1 minute' FROM generate_series(1, 20000) AS g`)
	db.exec(t, `VACUUM ANALYZE integration_outbox`)
	db.exec(t, `UPDATE integration_outbox SET handoff_at = now()`) // the hand-over, not analyzed yet
	sql, args, err := db.store.ClaimStatement(500, ledger.NewOwner(), false)
	if err != nil {
		t.Fatal(err)
	}
	plan := explainClaim(t, db, "EXPLAIN (COSTS OFF) "+sql, args)
	// The lock step joins the chosen rows (c) to the outbox by its key.
	if !regexp.MustCompile(`Index Cond: \(id = c(_\d+)?\.id\)`).MatchString(plan) {
		t.Fatalf("the lock step does not reach the chosen rows by id:\n%s", plan)
	}
}

// A row claimed in poll mode is the claim path's from then on, as a row the
// stream diverted is (docs/guarantees.md "Claim runs"): its handoff_at is
// set, so a relay that streams next — a new leader after the poller was
// killed with runs in flight — diverts the aggregate's new events behind it
// instead of streaming them past it, and its re-stream check skips it.
func TestPollClaimMakesRowsTheClaimPaths(t *testing.T) {
	db := mustClaimDB(t)
	ctx := context.Background()
	ids := insertRows(t, db, 3, "a")["a"]
	if got := claimIDs(t, db, ledger.NewOwner(), 2)["a"]; !slices.Equal(got, ids[:2]) {
		t.Fatalf("claimed %v, want %v", got, ids[:2])
	}
	var withDivertedAt int
	if err := db.pool.QueryRow(ctx, `SELECT count(*) FROM integration_outbox WHERE handoff_at IS NOT NULL AND status = 'processing'`).Scan(&withDivertedAt); err != nil {
		t.Fatal(err)
	}
	if withDivertedAt != 2 {
		t.Fatalf("%d claimed rows with handoff_at set, want 2", withDivertedAt)
	}
	diverted, err := db.store.Diverted(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(diverted) != 1 || diverted[0].ID != "a" {
		t.Fatalf("diverted aggregates %v, want aggregate a", diverted)
	}
}

// With a backlog at the claim path in replication mode, each claim gives a
// share to the newest due diversions (docs/guarantees.md "Claim runs"): an
// aggregate the stream diverts behind one old row at the back of a large
// backlog — a slot recreated behind it — gets its run (the old row, then
// its fresh events) in the next claim, not once the whole backlog is
// through.
func TestClaimTakesTheNewestDiversionsDuringABacklog(t *testing.T) {
	db := mustClaimDB(t)
	ctx := context.Background()
	z := insertBacklogAndRecent(t, db, 5000)
	owner := ledger.NewOwner()
	claim := func() map[string][]int64 {
		works, err := db.store.Claim(ctx, relay.ClaimQuery{Limit: 100, Owner: owner})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]int64{}
		for _, w := range works {
			out[*w.Event.AggregateID] = append(out[*w.Event.AggregateID], w.Event.ID)
		}
		return out
	}
	first := claim() // finds the backlog
	if len(first["z"]) > 0 {
		t.Fatalf("the first claim took aggregate z %v before it knew of a backlog", first["z"])
	}
	if got := claim()["z"]; !slices.Equal(got, z) {
		t.Fatalf("the second claim took %v of aggregate z, want its run %v (old row first)", got, z)
	}
}

// A claim with DueSince takes only the runs of aggregates with rows due
// since then — each from the aggregate's oldest unsettled row — and nothing
// of the backlog behind it (docs/architecture.md, "The claim path yields to
// a lagging stream").
func TestClaimDueSinceTakesOnlyRecentAggregates(t *testing.T) {
	db := mustClaimDB(t)
	ctx := context.Background()
	z := insertBacklogAndRecent(t, db, 2000)
	works, err := db.store.Claim(ctx, relay.ClaimQuery{Limit: 100, Owner: ledger.NewOwner(), DueSince: time.Now().Add(-10 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for _, w := range works {
		if agg := *w.Event.AggregateID; agg != "z" {
			t.Errorf("claimed row %d of aggregate %s, whose rows are all due an hour ago", w.Event.ID, agg)
			continue
		}
		got = append(got, w.Event.ID)
	}
	if !slices.Equal(got, z) {
		t.Fatalf("claimed %v of aggregate z, want its run %v (the old row first)", got, z)
	}
}
