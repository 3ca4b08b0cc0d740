package admin_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
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
			c, err := admin.Replay(ctx, f.pool, f.tables, []int64{done, failed, processing}, []string{"nats"}, []string{"nats", "n8n"})
			if err != nil {
				t.Fatal(err)
			}
			if c.Rows != 2 || c.LedgerRows != 2 {
				t.Fatalf("replay changed %+v, want 2 rows, 2 ledger rows", c)
			}
			for _, id := range []int64{done, failed} {
				r := f.MustRow(t, id)
				if r.status != "pending" || r.attempts != 0 || r.lastError != nil || !r.handedOff || r.replays == nil || *r.replays != 1 || r.availableIn > time.Second {
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
			c, err = admin.Replay(ctx, f.pool, f.tables, []int64{done}, nil, []string{"nats", "n8n"})
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
