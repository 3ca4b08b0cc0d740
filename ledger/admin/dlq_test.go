package admin_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
)

func TestSelectIDs(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	failedOrder := f.MustInsert(t, row{key: "a", status: "failed", eventType: str("order.created"), created: 2 * time.Hour})
	heldInvoice := f.MustInsert(t, row{key: "b", status: "held", eventType: str("invoice.paid")})
	failedNull := f.MustInsert(t, row{key: "c", status: "failed", eventType: nil})
	MustExec(t, f.pool, fmt.Sprintf("UPDATE %s SET event_type = NULL WHERE id = $1", f.tables.Outbox.Quoted()), failedNull)
	slashed := f.MustInsert(t, row{key: "s", status: "failed", eventType: str("crm/lead")})
	f.MustInsert(t, row{key: "d", status: "pending"})
	f.MustInsert(t, row{key: "e", status: "done"})
	// "a" reached n8n but not nats.
	f.MustLedger(t, "a", "n8n", "delivered", 0)

	tests := []struct {
		name string
		sel  admin.Selection
		want []int64
	}{
		{"dead letters", admin.Selection{}, []int64{failedOrder, heldInvoice, failedNull, slashed}},
		{"ids", admin.Selection{IDs: []int64{heldInvoice, 999}}, []int64{heldInvoice}},
		{"empty ids select nothing", admin.Selection{IDs: []int64{}}, nil},
		{"since", admin.Selection{Since: time.Now().Add(-time.Hour)}, []int64{heldInvoice, failedNull, slashed}},
		{"event type glob", admin.Selection{EventType: "order.*"}, []int64{failedOrder}},
		{"NULL event type matches only *", admin.Selection{EventType: "*"}, []int64{failedOrder, heldInvoice, failedNull, slashed}},
		{"* takes a type with a slash, as the engine routes", admin.Selection{Routes: []string{"*"}}, []int64{failedOrder, heldInvoice, failedNull, slashed}},
		{"other globs never match NULL", admin.Selection{EventType: "*.*"}, []int64{failedOrder, heldInvoice}},
		{"not delivered to n8n", admin.Selection{NotDeliveredTo: "n8n"}, []int64{heldInvoice, failedNull, slashed}},
		{"not delivered to nats", admin.Selection{NotDeliveredTo: "nats"}, []int64{failedOrder, heldInvoice, failedNull, slashed}},
		{"routes", admin.Selection{Routes: []string{"invoice.*", "nothing"}}, []int64{heldInvoice}},
		{"limit", admin.Selection{Limit: 2}, []int64{failedOrder, heldInvoice}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sel := tt.sel
			sel.Statuses = admin.DeadStatuses
			got, err := admin.SelectIDs(ctx, f.pool, f.tables, sel)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
		})
	}

	if _, err := admin.SelectIDs(ctx, f.pool, f.tables, admin.Selection{Statuses: admin.DeadStatuses, EventType: "[oops"}); err == nil || !strings.Contains(err.Error(), "[oops") {
		t.Fatalf("bad glob: %v", err)
	}
}

// TestSelectIDs_Pages selects more rows than one page holds, with a glob
// that drops some on every page.
func TestSelectIDs_Pages(t *testing.T) {
	f := MustFixture(t)
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_type, event_key, status)
		SELECT CASE WHEN g %% 3 = 0 THEN 'skip.me' ELSE 'keep.me' END, 'k' || g, 'failed' FROM generate_series(1, 2600) g`, f.tables.Outbox.Quoted()))
	got, err := admin.SelectIDs(context.Background(), f.pool, f.tables, admin.Selection{Statuses: admin.DeadStatuses, EventType: "keep.*"})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2600-866 || !slices.IsSorted(got) {
		t.Fatalf("selected %d rows (sorted %v), want %d", len(got), slices.IsSorted(got), 2600-866)
	}
	got, err = admin.SelectIDs(context.Background(), f.pool, f.tables, admin.Selection{Statuses: admin.DeadStatuses, EventType: "keep.*", Limit: 1500})
	if err != nil || len(got) != 1500 {
		t.Fatalf("with limit: %d rows, %v", len(got), err)
	}
}

func TestList(t *testing.T) {
	f := MustFixture(t)
	id := f.MustInsert(t, row{key: "a", status: "held", attempts: 2, lastError: "timeout after write"})
	f.MustLedger(t, "a", "nats", "delivered", 0)
	f.MustLedger(t, "a", "n8n", "unknown", 0)
	entries, err := admin.List(context.Background(), f.pool, f.tables, []int64{id, 12345})
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 {
		t.Fatalf("entries: %+v", entries)
	}
	e := entries[0]
	if e.ID != id || e.EventKey != "a" || e.Status != "held" || e.Attempts != 2 || *e.LastError != "timeout after write" ||
		*e.AggregateType != "order" || *e.AggregateID != "A1" || *e.EventType != "order.created" {
		t.Fatalf("entry: %+v", e)
	}
	if len(e.Ledger) != 2 || e.Ledger[0].Action != "n8n" || e.Ledger[0].State != "unknown" || e.Ledger[1].Action != "nats" || e.Ledger[1].State != "delivered" {
		t.Fatalf("ledger: %+v", e.Ledger)
	}
}

func TestRetryAndDiscard(t *testing.T) {
	for name, names := range map[string]migrations.Names{"default names": migrations.DefaultNames(), "hostile names": hostileNames()} {
		t.Run(name, func(t *testing.T) {
			f := MustFixtureNames(t, names)
			ctx := context.Background()
			failed := f.MustInsert(t, row{key: "failed", status: "failed", attempts: 10, lastError: "HTTP 422", processed: time.Minute})
			held := f.MustInsert(t, row{key: "held", status: "held", attempts: 1, lastError: "unknown outcome"})
			pending := f.MustInsert(t, row{key: "pending", status: "pending", attempts: 3, lastError: "503"})
			f.MustLedger(t, "failed", "nats", "delivered", 0)
			f.MustLedger(t, "failed", "n8n", "sending", 0)
			f.MustLedger(t, "held", "n8n", "unknown", 0)
			f.MustLedger(t, "held", "other", "unknown", 0)
			f.MustLedger(t, "pending", "n8n", "sending", 0)

			// Retry for n8n only: other's unknown row stays.
			c, err := admin.Retry(ctx, f.pool, f.tables, []int64{failed, held, pending}, []string{"n8n"})
			if err != nil {
				t.Fatal(err)
			}
			if c.Rows != 2 || c.LedgerRows != 2 {
				t.Fatalf("retry changed %+v, want 2 rows and 2 ledger rows", c)
			}
			for _, id := range []int64{failed, held} {
				r := f.MustRow(t, id)
				if r.status != "pending" || r.attempts != 0 || r.lastError != nil || !r.diverted || r.availableIn > time.Second {
					t.Fatalf("row %d after retry: %+v", id, r)
				}
			}
			if r := f.MustRow(t, pending); r.attempts != 3 || r.diverted {
				t.Fatalf("pending row changed: %+v", r)
			}
			if got := f.MustLedgerStates(t, "failed"); len(got) != 1 || got["nats"] != "delivered" {
				t.Fatalf("ledger of failed: %v (delivered pairs stay, n8n's claim goes)", got)
			}
			if got := f.MustLedgerStates(t, "held"); len(got) != 1 || got["other"] != "unknown" {
				t.Fatalf("ledger of held: %v", got)
			}
			if got := f.MustLedgerStates(t, "pending"); got["n8n"] != "sending" {
				t.Fatalf("ledger of a pending row changed: %v", got)
			}

			// Repeating changes nothing: the rows are no longer dead.
			if c, err := admin.Retry(ctx, f.pool, f.tables, []int64{failed, held}, nil); err != nil || c.Rows != 0 || c.LedgerRows != 0 {
				t.Fatalf("second retry: %+v %v", c, err)
			}

			// All sinks by default.
			MustExec(t, f.pool, fmt.Sprintf("UPDATE %s SET status = 'held' WHERE id = $1", f.tables.Outbox.Quoted()), held)
			if c, err := admin.Retry(ctx, f.pool, f.tables, []int64{held}, nil); err != nil || c.Rows != 1 || c.LedgerRows != 1 {
				t.Fatalf("retry every sink: %+v %v", c, err)
			}

			// Discard.
			dead := f.MustInsert(t, row{key: "dead", status: "failed", lastError: "HTTP 400: bad"})
			deadNoErr := f.MustInsert(t, row{key: "dead2", status: "held"})
			c, err = admin.Discard(ctx, f.pool, f.tables, []int64{dead, deadNoErr, pending})
			if err != nil || c.Rows != 2 {
				t.Fatalf("discard: %+v %v", c, err)
			}
			if r := f.MustRow(t, dead); r.status != "discarded" || r.lastError == nil || *r.lastError != "HTTP 400: bad" {
				t.Fatalf("discarded row: %+v, want status discarded and its error kept", r)
			}
			if r := f.MustRow(t, deadNoErr); r.status != "discarded" || r.lastError != nil {
				t.Fatalf("discarded row: %+v", r)
			}
			if r := f.MustRow(t, pending); r.status != "pending" {
				t.Fatalf("discard touched a pending row: %+v", r)
			}
			if c, err := admin.Discard(ctx, f.pool, f.tables, []int64{dead}); err != nil || c.Rows != 0 {
				t.Fatalf("second discard: %+v %v", c, err)
			}
			// A discarded row is retried and replayed as a failed one is.
			if c, err := admin.Retry(ctx, f.pool, f.tables, []int64{dead}, nil); err != nil || c.Rows != 1 {
				t.Fatalf("retry of a discarded row: %+v %v", c, err)
			}
			if r := f.MustRow(t, dead); r.status != "pending" || !r.diverted {
				t.Fatalf("retried discarded row: %+v", r)
			}
			if c, err := admin.Replay(ctx, f.pool, f.tables, []int64{deadNoErr}, nil); err != nil || c.Rows != 1 {
				t.Fatalf("replay of a discarded row: %+v %v", c, err)
			}
			if r := f.MustRow(t, deadNoErr); r.status != "pending" || !r.diverted {
				t.Fatalf("replayed discarded row: %+v", r)
			}
		})
	}
}
