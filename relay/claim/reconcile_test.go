package claim_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Rows the stream never delivered trip the sweep_after alarm without being
// claimed; reconcile marks them for the claim path, which then delivers
// them. A pending row the ledger shows delivered to every sink (an earlier
// version left its status pending) is stuck like the others, by its
// status: reconcile hands it over too, and the claim path, finding its
// pairs delivered, settles it done without sending it.
//
// Which rows reconcile marks, and that it refuses older-than 0 and is safe
// to repeat, is SQL and is tested with it: ledger's TestReconcile.
func TestReconcile(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "old1", AggType: "order", AggID: "A", Age: time.Hour},
		event{Key: "old2", AggType: "order", AggID: "A", Age: time.Hour},
		event{Key: "old-delivered", Age: time.Hour},
		event{Key: "old-done", Status: "done", Age: time.Hour},
		event{Key: "old-failed", Status: "failed", Age: time.Hour},
		event{Key: "old-marked", Diverted: true, Age: time.Hour},
		event{Key: "new", Age: time.Minute},
	)
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		VALUES ('old-delivered', 'a', 'delivered', 1, now())`)
	ctx := context.Background()

	a := newFakeSink("a", nil)
	c := MustStart(t, f, options{Routes: []relay.Route{{Sink: a}}, PollInterval: 50 * time.Millisecond,
		SweepAfter: 10 * time.Minute})
	waitFor(t, 5*time.Second, "the alarm", func() bool { return c.StuckRows() == 3 })
	if age := c.OldestUnclaimedAge(); age < time.Hour || age > time.Hour+time.Minute {
		t.Errorf("OldestUnclaimedAge = %s, want about 1h", age)
	}
	time.Sleep(300 * time.Millisecond)
	if sent := a.Delivered(); sent["old1"]+sent["old2"] != 0 {
		t.Fatalf("age alone transferred rows to the claim path: sent %v", sent)
	}

	n, err := c.Store.Reconcile(ctx, 10*time.Minute)
	if err != nil || n != 3 {
		t.Fatalf("Reconcile = %d, %v; want 3 rows marked (old1, old2, old-delivered)", n, err)
	}

	waitFor(t, 10*time.Second, "reconciled rows done", func() bool {
		rows := f.MustRows(t)
		return rows["old1"].Status == "done" && rows["old2"].Status == "done" && rows["old-delivered"].Status == "done"
	})
	waitFor(t, 5*time.Second, "the alarm to clear", func() bool { return c.StuckRows() == 0 && c.OldestUnclaimedAge() == 0 })
	sent := a.Delivered()
	if len(sent) != 3 || sent["old1"] != 1 || sent["old2"] != 1 || sent["old-marked"] != 1 {
		t.Errorf("sent %v, want old1, old2 and old-marked once each", sent)
	}
	if r := f.MustRow(t, "new"); r.Status != "pending" {
		t.Errorf("new: status %s, want pending (the stream's)", r.Status)
	}
	if sent["old-delivered"] != 0 {
		t.Errorf("old-delivered sent %d times: its ledger shows it delivered", sent["old-delivered"])
	}
}
