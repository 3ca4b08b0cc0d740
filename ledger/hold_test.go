package ledger_test

import (
	"context"
	"sync"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
)

func TestClaimSending(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	key := relay.LedgerKey{EventKey: "e1", Action: "erp"}

	// Two owners race for the same pair: exactly one wins.
	owners := []string{"relay-a", "relay-b"}
	won := make([]bool, len(owners))
	var wg sync.WaitGroup
	for i, owner := range owners {
		wg.Go(func() {
			ok, err := f.store.ClaimSending(ctx, key, owner)
			if err != nil {
				t.Errorf("ClaimSending(%s): %v", owner, err)
			}
			won[i] = ok
		})
	}
	wg.Wait()
	if won[0] == won[1] {
		t.Fatalf("ClaimSending results %v, want exactly one winner", won)
	}
	winner := owners[0]
	if won[1] {
		winner = owners[1]
	}
	got := f.MustLedger(t, "e1")["erp"]
	if got.State != "sending" || got.Owner == nil || *got.Owner != winner || got.Attempts != 1 {
		t.Errorf("ledger = %+v, want sending by %s, 1 attempt", got, winner)
	}

	// The owner itself cannot claim again: its earlier send's outcome would
	// be unknown.
	if ok, err := f.store.ClaimSending(ctx, key, winner); err != nil || ok {
		t.Errorf("ClaimSending(again, %s) = %v, %v; want false", winner, ok, err)
	}

	// Held (unknown), then claimed again: attempts count on.
	ids := f.MustInsert(t, row{Key: "e1"})
	if err := f.store.Hold(ctx, ids[0], key, "no answer"); err != nil {
		t.Fatalf("Hold: %v", err)
	}
	if ok, err := f.store.ClaimSending(ctx, key, "relay-c"); err != nil || !ok {
		t.Fatalf("ClaimSending(after hold) = %v, %v; want true", ok, err)
	}
	if got := f.MustLedger(t, "e1")["erp"]; got.State != "sending" || *got.Owner != "relay-c" || got.Attempts != 2 {
		t.Errorf("ledger = %+v, want sending by relay-c, 2 attempts", got)
	}

	// A delivered pair is never claimed.
	if _, err := f.store.Settle(ctx, relay.Settlement{Delivered: []relay.LedgerKey{key}}); err != nil {
		t.Fatalf("Settle: %v", err)
	}
	if ok, err := f.store.ClaimSending(ctx, key, "relay-d"); err != nil || ok {
		t.Errorf("ClaimSending(delivered) = %v, %v; want false", ok, err)
	}
	if got := f.MustLedger(t, "e1")["erp"]; got.State != "delivered" {
		t.Errorf("state = %s, want delivered", got.State)
	}
}

func TestHold(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "pending", AggType: ptr("order"), AggID: ptr("7")},
		row{Key: "done", Status: "done"},
		row{Key: "delivered"},
	)
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts) VALUES ('delivered', 'erp', 'delivered', 1)`)

	for range 2 { // safe to repeat
		if err := f.store.Hold(ctx, ids[0], relay.LedgerKey{EventKey: "pending", Action: "erp"}, "no answer in 30s"); err != nil {
			t.Fatalf("Hold: %v", err)
		}
	}
	got := f.MustRow(t, ids[0])
	if got.Status != "held" || got.LastError == nil || *got.LastError != "no answer in 30s" {
		t.Errorf("held row = %+v, want held with the reason", got)
	}
	l := f.MustLedger(t, "pending")["erp"]
	if l.State != "unknown" || l.Detail == nil || *l.Detail != "no answer in 30s" {
		t.Errorf("ledger = %+v, want unknown with the reason", l)
	}
	if div, err := f.store.Diverted(ctx); err != nil || len(div) != 1 || div[0] != (relay.AggregateKey{Type: "order", ID: "7"}) {
		t.Errorf("Diverted = %v, %v; want the held row's aggregate", div, err)
	}

	// A row no longer pending keeps its status.
	if err := f.store.Hold(ctx, ids[1], relay.LedgerKey{EventKey: "done", Action: "erp"}, "late"); err != nil {
		t.Fatalf("Hold(done): %v", err)
	}
	if got := f.MustRow(t, ids[1]); got.Status != "done" || got.LastError != nil {
		t.Errorf("done row = %+v, want untouched", got)
	}

	// A delivered pair has a known outcome: nothing changes.
	if err := f.store.Hold(ctx, ids[2], relay.LedgerKey{EventKey: "delivered", Action: "erp"}, "late"); err != nil {
		t.Fatalf("Hold(delivered): %v", err)
	}
	if l := f.MustLedger(t, "delivered")["erp"]; l.State != "delivered" || l.Detail != nil {
		t.Errorf("delivered pair = %+v, want delivered, untouched", l)
	}
	if got := f.MustRow(t, ids[2]); got.Status != "pending" {
		t.Errorf("row of a delivered pair = %+v, want pending", got)
	}
}
