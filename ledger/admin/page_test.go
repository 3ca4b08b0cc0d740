package admin_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// explainDB runs each query through EXPLAIN (ANALYZE, BUFFERS) before
// running it, and keeps the largest number of buffers one statement touched
// with its plan.
type explainDB struct {
	tb   testing.TB
	db   admin.DB
	mu   sync.Mutex
	max  int64
	plan string
}

func (e *explainDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return e.db.Exec(ctx, sql, args...)
}

func (e *explainDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	e.explain(ctx, sql, args)
	return e.db.Query(ctx, sql, args...)
}

func (e *explainDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	e.explain(ctx, sql, args)
	return e.db.QueryRow(ctx, sql, args...)
}

func (e *explainDB) explain(ctx context.Context, sql string, args []any) {
	e.tb.Helper()
	var out []byte
	if err := e.db.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+sql, args...).Scan(&out); err != nil {
		e.tb.Fatalf("explain %s: %v", sql, err)
	}
	var plans []struct {
		Plan struct {
			Hit  int64 `json:"Shared Hit Blocks"`
			Read int64 `json:"Shared Read Blocks"`
		} `json:"Plan"`
	}
	if err := json.Unmarshal(out, &plans); err != nil || len(plans) != 1 {
		e.tb.Fatalf("explain output %s: %v", out, err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if n := plans[0].Plan.Hit + plans[0].Plan.Read; n > e.max {
		e.max, e.plan = n, sql+"\n"+string(out)
	}
}

// TestListPage_ReadsOnlyTheDeadLetters: a page of dead letters, as the
// console asks for one every few seconds, reads the failed and held rows
// through the status index, never the outbox's other rows: on 100,000
// done rows with 30 dead letters, each statement touches fewer than 100
// buffers (the table has over 1,000 pages), and the pages follow one
// another by id.
func TestListPage_ReadsOnlyTheDeadLetters(t *testing.T) {
	f := MustFixture(t)
	f.tables.Sinks = []admin.Sink{{Name: "hook", Events: []string{"*"}}, {Name: "nats", Events: []string{"order.*"}}}
	ctx := context.Background()
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_type, aggregate_type, aggregate_id, event_key, payload, status, processed_at)
		SELECT 'order.placed', 'order', 'agg-' || (g %% 1000), 'done-' || g, jsonb_build_object('pad', repeat('x', 40)), 'done', now()
		  FROM generate_series(1, 100000) AS g`, f.tables.Outbox.Quoted()))
	var dead []int64
	for i := range 30 {
		status, typ := "failed", "order.placed"
		if i%3 == 0 {
			status, typ = "held", "invoice.sent"
		}
		dead = append(dead, f.MustInsert(t, row{key: fmt.Sprintf("dead-%d", i), status: status, eventType: str(typ), lastError: "400 Bad Request"}))
	}
	f.MustLedger(t, "dead-1", "hook", "delivered", 0)
	MustExec(t, f.pool, "ANALYZE "+f.tables.Outbox.Quoted())

	db := &explainDB{tb: t, db: f.pool}
	var got []int64
	sel := admin.Selection{Statuses: admin.DeadStatuses, Limit: 12}
	for pages := 0; ; pages++ {
		page, err := admin.ListPage(ctx, db, f.tables, sel)
		if err != nil {
			t.Fatal(err)
		}
		if pages > 3 || len(page.Entries) > 12 {
			t.Fatalf("page %d: %d entries, more %v", pages, len(page.Entries), page.More)
		}
		for _, e := range page.Entries {
			got = append(got, e.ID)
		}
		if !page.More {
			break
		}
		sel.After = page.Entries[len(page.Entries)-1].ID
	}
	t.Logf("at most %d buffers a statement", db.max)
	if !slices.Equal(got, dead) {
		t.Errorf("the pages listed %v, want %v", got, dead)
	}
	if db.max >= 100 {
		t.Errorf("a statement touched %d buffers:\n%s", db.max, db.plan)
	}

	// Filters: a sink it was not delivered to, a type glob.
	for _, tc := range []struct {
		name string
		sel  admin.Selection
		want int
	}{
		{"not delivered to hook", admin.Selection{NotDeliveredTo: "hook"}, 29},
		{"held invoices", admin.Selection{Statuses: []string{"held"}, EventType: "invoice.*"}, 10},
		{"no invoices failed", admin.Selection{Statuses: []string{"failed"}, EventType: "invoice.*"}, 0},
	} {
		sel := tc.sel
		if sel.Statuses == nil {
			sel.Statuses = admin.DeadStatuses
		}
		sel.Limit = 50
		page, err := admin.ListPage(ctx, db, f.tables, sel)
		if err != nil || len(page.Entries) != tc.want || page.More {
			t.Errorf("%s: %d entries (more %v), want %d: %v", tc.name, len(page.Entries), page.More, tc.want, err)
		}
	}
	if db.max >= 100 {
		t.Errorf("a filtered statement touched %d buffers:\n%s", db.max, db.plan)
	}
	if t.Failed() {
		return
	}
	// The filters apply to the entries' ledger rows as well.
	page, _ := admin.ListPage(ctx, db, f.tables, admin.Selection{Statuses: admin.DeadStatuses, IDs: []int64{dead[1]}, Limit: 1})
	if len(page.Entries) != 1 || len(page.Entries[0].Ledger) != 1 || !strings.EqualFold(page.Entries[0].Ledger[0].Action, "hook") {
		t.Errorf("entry with its ledger rows: %+v", page.Entries)
	}
}
