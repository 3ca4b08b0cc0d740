package admin_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

func TestReplay(t *testing.T) {
	for name, names := range map[string]migrations.Names{"default names": migrations.DefaultNames(), "hostile names": hostileNames()} {
		t.Run(name, func(t *testing.T) {
			f := MustFixtureNames(t, names)
			ctx := context.Background()
			done := f.MustInsert(t, row{key: "done", status: "done", attempts: 1, processed: time.Minute})
			failed := f.MustInsert(t, row{key: "failed", status: "failed", attempts: 10, lastError: "422"})
			processing := f.MustInsert(t, row{key: "processing", status: "processing"})
			for _, key := range []string{"done", "failed", "processing"} {
				f.MustLedger(t, key, "nats", "delivered", 0)
				f.MustLedger(t, key, "n8n", "delivered", 0)
			}

			// --sink nats: only nats's rows go, so only nats gets it again.
			c, err := admin.Replay(ctx, f.pool, f.tables, []int64{done, failed, processing}, []string{"nats"})
			if err != nil {
				t.Fatal(err)
			}
			if c.Rows != 2 || c.LedgerRows != 2 {
				t.Fatalf("replay changed %+v, want 2 rows, 2 ledger rows", c)
			}
			for _, id := range []int64{done, failed} {
				r := f.MustRow(t, id)
				if r.status != "pending" || r.attempts != 0 || r.lastError != nil || !r.diverted || r.replays == nil || *r.replays != 1 || r.availableIn > time.Second {
					t.Fatalf("row %d after replay: %+v", id, r)
				}
			}
			if got := f.MustLedgerStates(t, "done"); len(got) != 1 || got["n8n"] != "delivered" {
				t.Fatalf("ledger after replay to nats: %v, want n8n delivered only", got)
			}
			if r := f.MustRow(t, processing); r.status != "processing" || r.replays != nil {
				t.Fatalf("a row in flight was replayed: %+v", r)
			}
			if got := f.MustLedgerStates(t, "processing"); len(got) != 2 {
				t.Fatalf("ledger of a row in flight changed: %v", got)
			}

			// A second replay of the settled row counts again and, with no
			// sink, clears every sink.
			MustExec(t, f.pool, "UPDATE "+f.tables.Outbox.Quoted()+" SET status = 'done' WHERE id = $1", done)
			c, err = admin.Replay(ctx, f.pool, f.tables, []int64{done}, nil)
			if err != nil || c.Rows != 1 || c.LedgerRows != 1 {
				t.Fatalf("second replay: %+v %v", c, err)
			}
			if r := f.MustRow(t, done); *r.replays != 2 {
				t.Fatalf("replays = %d, want 2", *r.replays)
			}
			if got := f.MustLedgerStates(t, "done"); len(got) != 0 {
				t.Fatalf("ledger after replay to every sink: %v", got)
			}
		})
	}
}

// TestReplayRightAfterAStreamDelivery: an operator replays an event moments
// after the stream delivered it. Its settlement wrote the row done with its
// delivered ledger row, in one transaction, so the replay finds it settled
// and takes it; the claim path then finds no delivered ledger row and
// delivers it again. (When the status was marked after the settlement, the
// replay had to read the ledger to know the row was done, and a late mark
// could land on the replayed row.)
func TestReplayRightAfterAStreamDelivery(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	store, err := ledger.New(f.pool, ledger.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	id := f.MustInsert(t, row{key: "fresh"})
	ev := &relay.Event{ID: id, EventKey: "fresh"}
	delivered := &relay.Work{Event: ev, Decision: relay.Decision{Kind: relay.Done},
		Pairs: []*relay.Pair{{Sink: "nats", Outcome: relay.Outcome{Kind: relay.Delivered}}}}
	if _, err := store.SettleStream(ctx, []*relay.Work{delivered}, "relay-a"); err != nil {
		t.Fatal(err)
	}
	if r := f.MustRow(t, id); r.status != "done" {
		t.Fatalf("the settled row: %+v, want done", r)
	}
	c, err := admin.Replay(ctx, f.pool, f.tables, []int64{id}, nil)
	if err != nil || c.Rows != 1 || c.LedgerRows != 1 {
		t.Fatalf("replay of the delivered row: %+v %v; want the row and its ledger row", c, err)
	}
	if r := f.MustRow(t, id); r.status != "pending" || !r.diverted {
		t.Fatalf("the replayed row: %+v, want pending and diverted to the claim path", r)
	}
	works, err := store.Claim(ctx, relay.ClaimQuery{Limit: 10, Owner: "outbox-relay:test"})
	if err != nil || len(works) != 1 {
		t.Fatalf("claim after the replay: %d rows, %v; want the replayed row", len(works), err)
	}
	works[0].Pairs = []*relay.Pair{{Sink: "nats"}}
	if err := store.PrepareClaim(ctx, works, "outbox-relay:test", time.Minute); err != nil {
		t.Fatal(err)
	}
	if p := works[0].Pairs[0]; p.State != relay.PairSend || !p.Claimed {
		t.Fatalf("the replayed pair: state %v, claimed %v; want claimed to be sent again", p.State, p.Claimed)
	}
}
