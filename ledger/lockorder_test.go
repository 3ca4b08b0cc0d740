package ledger_test

import (
	"context"
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
	db := mustClaimDB(t, ledger.Sink{Name: "hook"})
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
	go func() { settled <- db.store.SettleClaim(ctx, works, owner) }()
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
