package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestDeadLettersAndHoldsRecordWhenTheyWereSettled: a row dead-lettered or
// held, on either path, has processed_at set to its settlement's time: the
// order in which the dead-letter notifier reads them (docs/operations.md,
// "Dead-letter notifications").
func TestDeadLettersAndHoldsRecordWhenTheyWereSettled(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "stream-failed"}, row{Key: "stream-held"},
		row{Key: "claim-failed", Status: "processing", Diverted: true}, row{Key: "claim-held", Status: "processing", Diverted: true},
	)
	f.MustExec(t, fmt.Sprintf(`UPDATE %s SET locked_by = 'relay-a', locked_at = now() WHERE status = 'processing'`, f.names.Outbox.Quoted()))
	dead := relay.Decision{Kind: relay.DeadLetter, Reason: "sink erp: 400", Attempts: 1}
	hold := relay.Decision{Kind: relay.Hold, Reason: "sink erp: outcome unknown: timeout", Attempts: 1}
	heldPair := func() *relay.Pair {
		return &relay.Pair{Sink: "erp", Hold: true, Claimed: true, Outcome: relay.Outcome{Kind: relay.Held, Reason: "timeout", Unknown: true}}
	}

	before := time.Now().Add(-time.Second) // the server's clock, within a second of ours
	if _, err := f.store.SettleStream(ctx, []*relay.Work{
		streamWork(ids[0], "stream-failed", dead, outcomePair("erp", relay.Failed)),
		streamWork(ids[1], "stream-held", hold, heldPair()),
	}, "relay-a"); err != nil {
		t.Fatalf("SettleStream: %v", err)
	}
	if _, err := f.store.SettleClaim(ctx, []*relay.Work{
		streamWork(ids[2], "claim-failed", dead, outcomePair("erp", relay.Failed)),
		streamWork(ids[3], "claim-held", hold, heldPair()),
	}, "relay-a"); err != nil {
		t.Fatalf("SettleClaim: %v", err)
	}
	after := time.Now().Add(time.Second)
	for i, want := range []string{"failed", "held", "failed", "held"} {
		got := f.MustRow(t, ids[i])
		if got.Status != want {
			t.Errorf("row %d: status %s, want %s", ids[i], got.Status, want)
		}
		if got.ProcessedAt == nil || got.ProcessedAt.Before(before) || got.ProcessedAt.After(after) {
			t.Errorf("row %d (%s): processed_at %s, want the settlement's time", ids[i], want, deref(got.ProcessedAt))
		}
	}
}
