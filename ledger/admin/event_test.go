package admin_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// eventSinks are the sinks the lookup tests configure: n8n takes order.*,
// nats every event (a NULL event_type included).
var eventSinks = []admin.Sink{{Name: "n8n", Events: []string{"order.*"}}, {Name: "nats", Events: []string{"*"}}}

// sinkOf returns the report's entry for sink name.
func sinkOf(tb testing.TB, r admin.EventReport, name string) admin.EventSink {
	tb.Helper()
	for _, s := range r.Sinks {
		if s.Name == name {
			return s
		}
	}
	tb.Fatalf("report has no sink %s: %+v", name, r.Sinks)
	return admin.EventSink{}
}

// TestLookupEvent: one event's row, what the relay makes of it, its ledger
// row per sink with whether each routed sink has it, by key and by id; with
// table names that would inject SQL if they were not quoted.
func TestLookupEvent(t *testing.T) {
	f := MustFixtureNames(t, hostileNames())
	f.tables.Sinks = eventSinks
	ctx := context.Background()
	older := f.MustInsert(t, row{key: "order-122", status: "pending"})
	id := f.MustInsert(t, row{key: "order-123", status: "pending", attempts: 3, lastError: "sink n8n: HTTP 503: busy", created: 5 * time.Minute})
	MustExec(t, f.pool, fmt.Sprintf(`UPDATE %s SET handoff_at = now(), available_at = now() + interval '30 seconds', replays = 2 WHERE id = $1`,
		f.tables.Outbox.Quoted()), id)
	f.MustLedger(t, "order-123", "nats", "delivered", time.Minute)
	MustExec(t, f.pool, fmt.Sprintf(`INSERT INTO %s (event_key, action, state, attempts, owner, claimed_at, detail)
		VALUES ('order-123', 'n8n', 'unknown', 2, 'relay-a:1:0', now(), 'timeout after the request was written')`, f.tables.Ledger.Quoted()))
	f.MustLedger(t, "order-123", "retired", "delivered", time.Hour) // a sink no longer configured

	r, err := admin.LookupEvent(ctx, f.pool, f.tables, admin.EventRef{Key: "order-123"})
	if err != nil {
		t.Fatal(err)
	}
	if r.ID != id || r.EventKey != "order-123" || deref(r.EventType) != "order.created" || deref(r.AggregateType) != "order" ||
		deref(r.AggregateID) != "A1" || r.Status != "pending" || r.State != admin.EventAtClaimPath || r.Attempts != 3 || r.Replays != 2 ||
		deref(r.LastError) != "sink n8n: HTTP 503: busy" || r.DivertedAt == nil || r.AvailableAt == nil || r.CreatedAt == nil ||
		r.PayloadBytes == nil || *r.PayloadBytes != int64(len(`{"n": 1}`)) {
		t.Fatalf("report: %+v", r)
	}
	if r.WaitsBehind == nil || r.WaitsBehind.ID != older || r.WaitsBehind.EventKey != "order-122" || r.WaitsBehind.Status != "pending" {
		t.Fatalf("waits behind %+v, want the pending order-122 (id %d)", r.WaitsBehind, older)
	}
	n8n, nats, retired := sinkOf(t, r, "n8n"), sinkOf(t, r, "nats"), sinkOf(t, r, "retired")
	if !n8n.Configured || !n8n.Routed || n8n.Delivered || n8n.Ledger == nil || n8n.Ledger.State != "unknown" || n8n.Ledger.Attempts != 2 ||
		deref(n8n.Ledger.Detail) != "timeout after the request was written" || deref(n8n.Ledger.Owner) != "relay-a:1:0" || n8n.Ledger.ClaimedAt == nil {
		t.Fatalf("n8n: %+v (ledger %+v)", n8n, n8n.Ledger)
	}
	if !nats.Configured || !nats.Routed || !nats.Delivered || nats.Ledger == nil || nats.Ledger.DeliveredAt == nil {
		t.Fatalf("nats: %+v", nats)
	}
	if retired.Configured || retired.Routed || !retired.Delivered {
		t.Fatalf("retired: %+v, want a ledger row of a sink not configured", retired)
	}
	if len(r.Sinks) != 3 || r.Sinks[0].Name != "n8n" || r.Sinks[1].Name != "nats" {
		t.Fatalf("sinks %+v: the configured ones first, in their order, then the others", r.Sinks)
	}

	byID, err := admin.LookupEvent(ctx, f.pool, f.tables, admin.EventRef{ID: id})
	if err != nil || byID.EventKey != "order-123" || len(byID.Sinks) != 3 {
		t.Fatalf("by id: %+v, %v", byID, err)
	}
	// The struct is what an API serves: its JSON names are part of it.
	out, _ := json.Marshal(r)
	for _, key := range []string{`"event_key":"order-123"`, `"state":"claim_path"`, `"routed":true`, `"delivered":false`, `"waits_behind":{`, `"payload_bytes":8`, `"replays":2`} {
		if !strings.Contains(string(out), key) {
			t.Errorf("JSON lacks %s: %s", key, out)
		}
	}
}

func deref(s *string) string {
	if s == nil {
		return "<nil>"
	}
	return *s
}

// TestLookupEvent_States: what the relay makes of a row, from its status
// and its diversion alone (docs/schema.md, "A row's states"): a pending row
// the ledger shows delivered everywhere is still the stream's.
func TestLookupEvent_States(t *testing.T) {
	f := MustFixture(t)
	f.tables.Sinks = eventSinks
	ctx := context.Background()
	set := func(id int64, sql string) {
		MustExec(t, f.pool, fmt.Sprintf(`UPDATE %s SET %s WHERE id = $1`, f.tables.Outbox.Quoted(), sql), id)
	}
	stream := f.MustInsert(t, row{key: "stream", status: "pending"})
	f.MustLedger(t, "stream", "nats", "delivered", 0)
	delivered := f.MustInsert(t, row{key: "delivered", status: "pending"})
	f.MustLedger(t, "delivered", "nats", "delivered", 0)
	f.MustLedger(t, "delivered", "n8n", "delivered", 0)
	claimed := f.MustInsert(t, row{key: "claimed", status: "processing"})
	set(claimed, "locked_by = 'relay-b:2:0', locked_at = now(), handoff_at = now()")
	discarded := f.MustInsert(t, row{key: "discarded", status: "discarded", lastError: "HTTP 422"})
	// Discarded by an earlier version: done, last_error prefixed.
	discardedBefore := f.MustInsert(t, row{key: "discarded-before", status: "done", lastError: "discarded: HTTP 422"})
	nullStatus := f.MustInsert(t, row{key: "null-status"})
	set(nullStatus, "status = NULL")
	for _, tt := range []struct {
		id    int64
		state admin.EventState
	}{
		{stream, admin.EventWithStream},
		{delivered, admin.EventWithStream},
		{claimed, admin.EventProcessing},
		{f.MustInsert(t, row{key: "held", status: "held"}), admin.EventHeld},
		{f.MustInsert(t, row{key: "failed", status: "failed"}), admin.EventFailed},
		{f.MustInsert(t, row{key: "done", status: "done"}), admin.EventDone},
		{discarded, admin.EventDiscarded},
		{discardedBefore, admin.EventDiscarded},
		{nullStatus, admin.EventWithStream},
	} {
		r, err := admin.LookupEvent(ctx, f.pool, f.tables, admin.EventRef{ID: tt.id})
		if err != nil || r.State != tt.state {
			t.Errorf("event %d: state %q, %v; want %q", tt.id, r.State, err, tt.state)
		}
	}
	// Without the configuration, the same.
	noSinks := f.tables
	noSinks.Sinks = nil
	if r, err := admin.LookupEvent(ctx, f.pool, noSinks, admin.EventRef{ID: delivered}); err != nil || r.State != admin.EventWithStream || sinkOf(t, r, "n8n").Configured {
		t.Fatalf("without sinks: %+v, %v", r, err)
	}
}

// TestLookupEvent_BadInput: NULL type, aggregate and payload are reported
// as such (and route only to "*"); a key that is not there — of any length,
// not UTF-8, with a NUL — is a clear error that quotes a bounded excerpt of
// it; an id that is not there too.
func TestLookupEvent_BadInput(t *testing.T) {
	f := MustFixture(t)
	f.tables.Sinks = eventSinks
	ctx := context.Background()
	id := f.MustInsert(t, row{key: "bare"})
	MustExec(t, f.pool, fmt.Sprintf(`UPDATE %s SET event_type = NULL, aggregate_type = NULL, aggregate_id = NULL, payload = NULL,
		attempts = NULL, created_at = NULL, available_at = NULL WHERE id = $1`, f.tables.Outbox.Quoted()), id)
	r, err := admin.LookupEvent(ctx, f.pool, f.tables, admin.EventRef{Key: "bare"})
	if err != nil {
		t.Fatal(err)
	}
	if r.EventType != nil || r.AggregateType != nil || r.AggregateID != nil || r.PayloadBytes != nil || r.Attempts != 0 || r.WaitsBehind != nil {
		t.Fatalf("report of a bare row: %+v", r)
	}
	if n8n, nats := sinkOf(t, r, "n8n"), sinkOf(t, r, "nats"); n8n.Routed || !nats.Routed || n8n.Ledger != nil {
		t.Fatalf("routes of a NULL event_type: n8n %+v, nats %+v; want only nats (\"*\")", n8n, nats)
	}

	long := strings.Repeat("k", 1<<20)
	for name, key := range map[string]string{
		"unknown": "order-404", "a megabyte": long, "not UTF-8": "order-\xff", "a NUL": "order\x00x", "control characters": "order\n\x1b[2J",
	} {
		t.Run(name, func(t *testing.T) {
			_, err := admin.LookupEvent(ctx, f.pool, f.tables, admin.EventRef{Key: key})
			if !errors.Is(err, admin.ErrEventNotFound) {
				t.Fatalf("err %v, want ErrEventNotFound", err)
			}
			if msg := err.Error(); len(msg) > 300 || !strings.Contains(msg, "no event with key") || strings.ContainsAny(msg, "\x00\n\x1b") {
				t.Fatalf("error %q (%d bytes): want a short line naming the key", excerptOf(msg), len(msg))
			}
		})
	}
	if _, err := admin.LookupEvent(ctx, f.pool, f.tables, admin.EventRef{ID: id + 1000}); !errors.Is(err, admin.ErrEventNotFound) ||
		!strings.Contains(err.Error(), fmt.Sprint(id+1000)) {
		t.Fatalf("unknown id: %v", err)
	}
	// A row pruned while its ledger rows remain: the error says so.
	f.MustLedger(t, "pruned", "nats", "delivered", 0)
	if _, err := admin.LookupEvent(ctx, f.pool, f.tables, admin.EventRef{Key: "pruned"}); !errors.Is(err, admin.ErrEventNotFound) ||
		!strings.Contains(err.Error(), "the ledger still has 1 row") {
		t.Fatalf("pruned row: %v", err)
	}
}

func excerptOf(s string) string {
	if len(s) > 200 {
		return s[:200] + "…"
	}
	return s
}
