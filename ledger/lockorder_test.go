package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// waitForLockWaiters waits until n sessions of the test's database wait for
// a lock.
func waitForLockWaiters(tb testing.TB, db *claimDB, n int) {
	tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		err := db.pool.QueryRow(context.Background(), `
			SELECT count(*) FROM pg_stat_activity
			 WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		if err != nil {
			tb.Fatal(err)
		}
		if waiting >= n {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%d sessions wait for a lock after 10 s, want %d", waiting, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A claimed row's settlement and the renewal of its lease lock the ledger
// pair before the outbox row, both of them (docs/architecture.md "Lock
// order"): a renewal that took the outbox row first waited for the pair the
// settlement held while the settlement waited for the row, and PostgreSQL
// ended one of them with "deadlock detected". The third session holds the
// pair so that the settlement waits for it first and the renewal second.
func TestSettlementAndLeaseRenewalLockInOneOrder(t *testing.T) {
	ctx := context.Background()
	db := mustClaimDB(t)
	insertRows(t, db, 1, "a")
	owner := ledger.NewOwner()
	works, err := db.store.Claim(ctx, relay.ClaimQuery{All: true, Limit: 10, Owner: owner})
	if err != nil || len(works) != 1 {
		t.Fatalf("claim: %d rows, %v", len(works), err)
	}
	works[0].Pairs = []*relay.Pair{{Sink: "hook"}} // the engine's routing
	if err := db.store.PrepareClaim(ctx, works, owner, time.Minute); err != nil {
		t.Fatal(err)
	}
	w := works[0]
	if len(w.Pairs) != 1 || !w.Pairs[0].Claimed {
		t.Fatalf("pairs after PrepareClaim: %+v", w.Pairs)
	}
	w.Pairs[0].Outcome = relay.Outcome{Kind: relay.Delivered}
	w.Decision = relay.Decision{Kind: relay.Done}

	holder, err := db.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx) //nolint:errcheck // released below
	if _, err := holder.Exec(ctx, `SELECT FROM integration_idempotency WHERE event_key = $1 FOR UPDATE`, w.Event.EventKey); err != nil {
		t.Fatal(err)
	}

	settled := make(chan error, 1)
	go func() { _, err := db.store.SettleClaim(ctx, works, owner); settled <- err }()
	waitForLockWaiters(t, db, 1)
	renewed := make(chan error, 1)
	go func() { renewed <- db.store.ExtendLeases(ctx, []int64{w.Event.ID}, owner) }()
	waitForLockWaiters(t, db, 2)
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-settled; err != nil {
		t.Errorf("settle: %v", err)
	}
	if err := <-renewed; err != nil {
		t.Errorf("renew the lease: %v", err)
	}
	var status, state string
	err = db.pool.QueryRow(ctx, `
		SELECT o.status, l.state FROM integration_outbox AS o
		  JOIN integration_idempotency AS l ON l.event_key = o.event_key
		 WHERE o.id = $1`, w.Event.ID).Scan(&status, &state)
	if err != nil {
		t.Fatal(err)
	}
	if status != "done" || state != "delivered" {
		t.Errorf("row %s, ledger pair %s; want done, delivered", status, state)
	}
}

// TestSettleClaimReportsRowsDeletedSinceTheirClaim: a claimed row deleted
// before its outcome is written (by hand, or the application's cleanup) is
// reported by SettleClaim, whatever its outcome, so that the engine logs
// and counts it (docs/guarantees.md, "Deleted rows and invisible rows");
// the rows beside it are settled. Before, its outcome was dropped without
// a trace.
func TestSettleClaimReportsRowsDeletedSinceTheirClaim(t *testing.T) {
	ctx := context.Background()
	db := mustClaimDB(t)
	insertRows(t, db, 1, "a", "b", "c")
	owner := ledger.NewOwner()
	works, err := db.store.Claim(ctx, relay.ClaimQuery{All: true, Limit: 10, Owner: owner})
	if err != nil || len(works) != 3 {
		t.Fatalf("claim: %d rows, %v", len(works), err)
	}
	decisions := []relay.Decision{{Kind: relay.Done}, {Kind: relay.Later, At: time.Now().Add(time.Minute), Attempts: 1}, {Kind: relay.DeadLetter, Attempts: 1, Reason: "400"}}
	for i, w := range works {
		w.Pairs = []*relay.Pair{{Sink: "hook", Outcome: relay.Outcome{Kind: relay.Delivered}}}
		if decisions[i].Kind != relay.Done {
			w.Pairs[0].Outcome = relay.Outcome{Kind: relay.Retry}
		}
		w.Decision = decisions[i]
	}
	db.exec(t, `DELETE FROM integration_outbox WHERE id = ANY($1)`, []int64{works[0].Event.ID, works[1].Event.ID})
	gone, err := db.store.SettleClaim(ctx, works, owner)
	if err != nil {
		t.Fatalf("SettleClaim: %v", err)
	}
	if want := []int64{works[0].Event.ID, works[1].Event.ID}; fmt.Sprint(gone) != fmt.Sprint(want) {
		t.Errorf("SettleClaim reported %v, want the deleted rows %v", gone, want)
	}
	if n := db.exec(t, `SELECT FROM integration_outbox WHERE id = $1 AND status = 'failed'`, works[2].Event.ID); n != 1 {
		t.Errorf("the row beside them: %d rows failed, want its dead letter written", n)
	}
}
