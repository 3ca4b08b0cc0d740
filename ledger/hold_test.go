package ledger_test

import (
	"context"
	"sync"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
)

// A sink with on_unknown: hold has its pairs claimed in the ledger before
// they are sent (PrepareStream), and an unknown outcome held (SettleStream).
// These tests were ClaimSending's and Hold's, which PrepareStream and
// SettleStream replaced.

// holdPair is a pair of a hold sink, as Prepare gets it.
func holdPair(sink string) *relay.Pair { return &relay.Pair{Sink: sink, Hold: true} }

// heldWork is the settlement of a hold pair whose outcome is unknown.
func heldWork(id int64, key, sink, reason string) *relay.Work {
	p := &relay.Pair{Sink: sink, Hold: true, Claimed: true, Outcome: relay.Outcome{Kind: relay.Held, Reason: reason, Unknown: true}}
	return streamWork(id, key, relay.Decision{Kind: relay.Hold, Reason: reason, Attempts: 1}, p)
}

func TestClaimSending(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	prepare := func(owner string) *relay.Pair {
		t.Helper()
		w := streamWork(0, "e1", relay.Decision{}, holdPair("erp"))
		if err := f.store.PrepareStream(ctx, []*relay.Work{w}, false, owner); err != nil {
			t.Fatalf("PrepareStream(%s): %v", owner, err)
		}
		return w.Pairs[0]
	}

	// Two owners race for the same pair: exactly one wins; the other
	// learns who holds it.
	owners := []string{"relay-a", "relay-b"}
	got := make([]*relay.Pair, len(owners))
	var wg sync.WaitGroup
	for i, owner := range owners {
		wg.Go(func() {
			w := streamWork(0, "e1", relay.Decision{}, holdPair("erp"))
			if err := f.store.PrepareStream(ctx, []*relay.Work{w}, false, owner); err != nil {
				t.Errorf("PrepareStream(%s): %v", owner, err)
			}
			got[i] = w.Pairs[0]
		})
	}
	wg.Wait()
	if got[0] == nil || got[1] == nil || got[0].Claimed == got[1].Claimed {
		t.Fatalf("claims %v, %v; want exactly one winner", got[0], got[1])
	}
	winner, loser := 0, 1
	if got[1].Claimed {
		winner, loser = 1, 0
	}
	if l := got[loser]; l.State != relay.PairUnknown || l.PrevOwner != owners[winner] {
		t.Errorf("loser's pair = %+v, want PairUnknown, previous owner %s", l, owners[winner])
	}
	l := f.MustLedger(t, "e1")["erp"]
	if l.State != "sending" || l.Owner == nil || *l.Owner != owners[winner] || l.Attempts != 1 {
		t.Errorf("ledger = %+v, want sending by %s, 1 attempt", l, owners[winner])
	}

	// The owner itself cannot claim again: its earlier send's outcome would
	// be unknown.
	if p := prepare(owners[winner]); p.Claimed || p.State != relay.PairUnknown || p.PrevOwner != owners[winner] {
		t.Errorf("PrepareStream(again, %s) = %+v; want PairUnknown, not claimed", owners[winner], p)
	}
	// Preparing the same works again keeps the claim they hold, without
	// claiming afresh.
	w := streamWork(0, "e1", relay.Decision{}, got[winner])
	if err := f.store.PrepareStream(ctx, []*relay.Work{w}, false, owners[winner]); err != nil || !w.Pairs[0].Claimed || w.Pairs[0].State != relay.PairSend {
		t.Errorf("PrepareStream(same works) = %v, %+v; want the claim kept", err, w.Pairs[0])
	}
	if l := f.MustLedger(t, "e1")["erp"]; l.Attempts != 1 {
		t.Errorf("attempts = %d after preparing the same works again, want 1", l.Attempts)
	}

	// Held (unknown), then claimed again: attempts count on.
	ids := f.MustInsert(t, row{Key: "e1"})
	if _, err := f.store.SettleStream(ctx, []*relay.Work{heldWork(ids[0], "e1", "erp", "no answer")}, owners[winner]); err != nil {
		t.Fatalf("SettleStream(hold): %v", err)
	}
	if p := prepare("relay-c"); !p.Claimed || p.State != relay.PairSend {
		t.Fatalf("PrepareStream(after hold) = %+v; want claimed", p)
	}
	if l := f.MustLedger(t, "e1")["erp"]; l.State != "sending" || *l.Owner != "relay-c" || l.Attempts != 2 {
		t.Errorf("ledger = %+v, want sending by relay-c, 2 attempts", l)
	}

	// A delivered pair is never claimed.
	delivered := &relay.Pair{Sink: "erp", Hold: true, Claimed: true, Outcome: relay.Outcome{Kind: relay.Delivered}}
	if _, err := f.store.SettleStream(ctx, []*relay.Work{streamWork(ids[0], "e1", relay.Decision{Kind: relay.Done}, delivered)}, "relay-c"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	if p := prepare("relay-d"); p.Claimed || p.State != relay.PairDelivered {
		t.Errorf("PrepareStream(delivered) = %+v; want PairDelivered, not claimed", p)
	}
	if l := f.MustLedger(t, "e1")["erp"]; l.State != "delivered" {
		t.Errorf("state = %s, want delivered", l.State)
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
		if _, err := f.store.SettleStream(ctx, []*relay.Work{heldWork(ids[0], "pending", "erp", "no answer in 30s")}, "relay-a"); err != nil {
			t.Fatalf("SettleStream(hold): %v", err)
		}
	}
	got := f.MustRow(t, ids[0])
	if got.Status != "held" || got.LastError == nil || *got.LastError != "no answer in 30s" || got.Attempts != 1 {
		t.Errorf("held row = %+v, want held with the reason and 1 attempt", got)
	}
	l := f.MustLedger(t, "pending")["erp"]
	if l.State != "unknown" || l.Detail == nil || *l.Detail != "no answer in 30s" {
		t.Errorf("ledger = %+v, want unknown with the reason", l)
	}
	if div, err := f.store.Diverted(ctx); err != nil || len(div) != 1 || div[0] != (relay.AggregateKey{Type: "order", ID: "7"}) {
		t.Errorf("Diverted = %v, %v; want the held row's aggregate", div, err)
	}

	// A row no longer pending keeps its status.
	if _, err := f.store.SettleStream(ctx, []*relay.Work{heldWork(ids[1], "done", "erp", "late")}, "relay-a"); err != nil {
		t.Fatalf("SettleStream(hold done): %v", err)
	}
	if got := f.MustRow(t, ids[1]); got.Status != "done" || got.LastError != nil {
		t.Errorf("done row = %+v, want untouched", got)
	}

	// A delivered pair has a known outcome: the ledger keeps it delivered.
	// Prepare reports such a pair PairDelivered, so the engine never
	// decides Hold for it; the old Hold checked the ledger itself and then
	// left the row pending. SettleStream writes the decision it is given:
	// told to hold, it holds the row (status held), and keeps the pair.
	if _, err := f.store.SettleStream(ctx, []*relay.Work{heldWork(ids[2], "delivered", "erp", "late")}, "relay-a"); err != nil {
		t.Fatalf("SettleStream(hold delivered): %v", err)
	}
	if l := f.MustLedger(t, "delivered")["erp"]; l.State != "delivered" || l.Detail != nil {
		t.Errorf("delivered pair = %+v, want delivered, untouched", l)
	}
	if got := f.MustRow(t, ids[2]); got.Status != "held" {
		t.Errorf("row of a delivered pair told to hold = %+v, want held (the decision is the engine's)", got)
	}
	p := holdPair("erp")
	if err := f.store.PrepareStream(ctx, []*relay.Work{streamWork(ids[2], "delivered", relay.Decision{}, p)}, false, "relay-a"); err != nil || p.State != relay.PairDelivered || p.Claimed {
		t.Errorf("PrepareStream(delivered pair) = %v, %+v; want PairDelivered, not claimed", err, p)
	}
}
