package ledger_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// A NULL status means pending (the column is nullable; docs/guarantees.md,
// "NULL status and NULL available_at"): every reader of the rows the
// stream owns takes such a row as pending, and every write that gives a
// row to the claim path writes status pending, which the claim path's
// partial indexes hold.

// TestHandOverTakesNullStatusRows: rows with a NULL status pending when a
// new slot is created are the hand-over's like pending ones: the snapshot
// reports their aggregates (Pending, Aggregates), an aggregate with an
// older such row is not complete among the newest rows (NewestUnblocked), and
// Deliver feeds them in id order. Before, the snapshot's readers read only
// status = 'pending': the row was never fed, and the slot never streams it.
func TestHandOverTakesNullStatusRows(t *testing.T) {
	defer ledger.SetEarlySlice(1)()
	f := MustFixture(t)
	ctx := context.Background()
	n, m := relay.AggregateKey{Type: "order", ID: "n"}, relay.AggregateKey{Type: "order", ID: "m"}
	of := func(key string, agg relay.AggregateKey, null bool) row {
		return row{Key: key, AggType: ptr(agg.Type), AggID: ptr(agg.ID), NullStatus: null}
	}
	f.MustInsert(t, of("n-1", n, true), row{Key: "free", NullStatus: true}, of("m-1", m, true), of("n-2", n, false))
	slot, created, h := f.mustOpenHandOver(t, f.store)
	defer h.Close()

	got, err := h.Pending(ctx, []relay.AggregateKey{m, n})
	slices.SortFunc(got, func(a, b relay.AggregateKey) int { return strings.Compare(a.ID, b.ID) })
	if err != nil || !slices.Equal(got, []relay.AggregateKey{m, n}) {
		t.Errorf("Pending before the read = %v, %v; want [m n] (m's one row has a NULL status)", got, err)
	}
	// The newest row, n-2, has an older row of its aggregate pending: n-1.
	if events, aggs, err := h.NewestUnblocked(ctx); err != nil || len(events)+len(aggs) != 0 {
		t.Errorf("NewestUnblocked = %d rows %v, %v; want nothing: n-2's aggregate has n-1 before it", len(events), aggs, err)
	}
	if aggs, err := h.Aggregates(ctx); err != nil || !slices.Equal(aggs, []relay.AggregateKey{n, m}) {
		t.Errorf("Aggregates = %v, %v; want [n m]", aggs, err)
	}
	fed := &feedLog{}
	if _, err := fed.deliver(ctx, h, slot, created.consistent); err != nil {
		t.Fatalf("Deliver: %v", err)
	}
	if got, want := fed.keys(), []string{"free", "m-1", "n-1", "n-2"}; !slices.Equal(got, want) {
		t.Errorf("Deliver fed %q, want %q", got, want)
	}
	for _, ev := range fed.events {
		if ev.Status != "pending" {
			t.Errorf("row %s fed with status %q, want pending", ev.EventKey, ev.Status)
		}
	}
}

// TestMarkForClaimFromStandbyTakesNullStatusRows: the hand-over of a slot
// made on a standby reads the rows pending in the standby's snapshot,
// those with a NULL status among them, and marks them for the claim path
// with status pending, so that the claim takes them. The snapshot here is
// the primary's own: the statement is the same.
func TestMarkForClaimFromStandbyTakesNullStatusRows(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "null", NullStatus: true}, row{Key: "pending"})
	slot := f.MustSlotName(t)
	if err := f.store.BeginSlot(ctx, slot); err != nil {
		t.Fatal(err)
	}
	created := f.MustCreateSlot(t)
	standby, err := pgx.Connect(ctx, f.url)
	if err != nil {
		t.Fatal(err)
	}
	defer standby.Close(ctx)
	if n, err := f.store.MarkForClaimFromStandby(ctx, standby, slot, created.snapshot, created.consistent); err != nil || n != 2 {
		t.Fatalf("MarkForClaimFromStandby = %d, %v; want both rows marked", n, err)
	}
	for _, id := range ids {
		if got := f.MustRow(t, id); got.Status != "pending" || got.DivertedAt == nil {
			t.Errorf("row %d = %v, want pending and diverted", id, got)
		}
	}
	mustClaimIDs(t, f.store, ids...)
}

// TestStreamDivertOfANullStatusRowReachesTheClaimPath: the stream hands
// off a row inserted with a NULL status; the diversion writes status
// pending, and the claim (of diverted rows) takes it. Before, the row
// stayed NULL, which the claim's index does not hold, until the sweeper's
// repair.
func TestStreamDivertOfANullStatusRowReachesTheClaimPath(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "null", NullStatus: true})
	w := streamWork(ids[0], "null", relay.Decision{Kind: relay.Later, Reason: "503"}, outcomePair("webhook", relay.Retry))
	if _, err := f.store.SettleStream(ctx, []*relay.Work{w}, "relay-a"); err != nil {
		t.Fatal(err)
	}
	if got := f.MustRow(t, ids[0]); got.Status != "pending" || got.DivertedAt == nil {
		t.Errorf("row after the diversion = %v, want pending and diverted", got)
	}
	mustClaimIDs(t, f.store, ids...)
}

// TestNullStatusRowsAreTheStreams: the other writers of the rows the stream
// owns take a NULL status as pending: reconcile hands such a row to the
// claim path (writing status pending), and the stream's settlement writes
// one it delivered done.
func TestNullStatusRowsAreTheStreams(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t, row{Key: "old", NullStatus: true}, row{Key: "delivered", NullStatus: true})
	f.MustExec(t, `UPDATE integration_outbox SET created_at = now() - interval '1 hour' WHERE id = $1`, ids[0])
	w := streamWork(ids[1], "delivered", relay.Decision{Kind: relay.Done}, outcomePair("webhook", relay.Delivered))
	if _, err := f.store.SettleStream(ctx, []*relay.Work{w}, "relay-a"); err != nil {
		t.Fatal(err)
	}
	if got := f.MustRow(t, ids[1]); got.Status != "done" {
		t.Errorf("delivered row = %v, want done", got)
	}
	if n, err := f.store.Reconcile(ctx, 10*time.Minute); err != nil || n != 1 {
		t.Errorf("Reconcile = %d, %v; want the old row marked", n, err)
	}
	if got := f.MustRow(t, ids[0]); got.Status != "pending" || got.DivertedAt == nil {
		t.Errorf("reconciled row = %v, want pending and diverted", got)
	}
}

// mustClaimIDs claims diverted rows (replication mode) and fails unless
// it took exactly ids.
func mustClaimIDs(t *testing.T, store *ledger.Store, ids ...int64) {
	t.Helper()
	works, err := store.Claim(context.Background(), relay.ClaimQuery{Limit: 10, Owner: ledger.NewOwner()})
	if err != nil {
		t.Fatalf("Claim: %v", err)
	}
	var got []int64
	for _, w := range works {
		got = append(got, w.Event.ID)
	}
	slices.Sort(got)
	if !slices.Equal(got, ids) {
		t.Errorf("Claim took %v, want %v", got, ids)
	}
}
