package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/relay"
)

func TestDLQList(t *testing.T) {
	d := newOpsDB(t)
	failed := d.insert(t, "order-1-created", "order.created", "failed", "HTTP 422: {\"error\": \"invalid\"}\nmore lines")
	held := d.insert(t, "invoice-9-paid", "invoice.paid", "held", "n8n: timeout after the request was written")
	d.insert(t, "order-2-created", "order.created", "pending", "")
	d.insert(t, "order-3-created", "order.created", "done", "")
	d.ledger(t, "order-1-created", "nats", "delivered")
	d.ledger(t, "invoice-9-paid", "nats", "unknown")

	code, out, errOut := execute(t, "dlq", "list", "--config", d.config)
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	t.Logf("dlq list:\n%s", out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	// The failed event's error has a second line, which the table cuts.
	if len(lines) != 5 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[3], "2 events: 1 failed, 1 held") ||
		!strings.Contains(lines[4], "dlq list --json shows every error whole") {
		t.Fatalf("table:\n%s", out)
	}
	for _, want := range []string{
		fmt.Sprint(failed), "failed", "order.created", "order/A1", "order-1-created", "n8n=- nats=delivered", `HTTP 422: {"error": "invalid"} …`,
	} {
		if !strings.Contains(lines[1], want) {
			t.Errorf("row of the failed event lacks %q: %s", want, lines[1])
		}
	}
	// invoice.paid is not routed to n8n (events: order.*), so only nats shows.
	if !strings.Contains(lines[2], fmt.Sprint(held)) || !strings.Contains(lines[2], "held") || !strings.Contains(lines[2], " nats=unknown ") || strings.Contains(lines[2], "n8n=") {
		t.Errorf("row of the held event: %s", lines[2])
	}

	tests := []struct {
		name string
		args []string
		want []int64
	}{
		{"sink n8n: routed to it and not delivered there", []string{"--sink", "n8n"}, []int64{failed}},
		{"sink nats: not delivered there", []string{"--sink", "nats"}, []int64{held}},
		{"event type", []string{"--event-type", "invoice.*"}, []int64{held}},
		{"ids", []string{"--ids", fmt.Sprintf("%d, %d", held, failed+1000)}, []int64{held}},
		{"since the future", []string{"--since", time.Now().Add(time.Hour).UTC().Format(time.RFC3339)}, nil},
		{"since a duration ago", []string{"--since", "1h"}, []int64{failed, held}},
		{"limit", []string{"--limit", "1"}, []int64{failed}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := execute(t, append([]string{"dlq", "list", "--config", d.config, "--json"}, tt.args...)...)
			if code != exitOK {
				t.Fatalf("exit %d\n%s%s", code, out, errOut)
			}
			var entries []admin.Entry
			if err := json.Unmarshal([]byte(out), &entries); err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			var got []int64
			for _, e := range entries {
				got = append(got, e.ID)
			}
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Fatalf("ids %v, want %v\n%s", got, tt.want, out)
			}
		})
	}

	// JSON carries the full error and the ledger rows.
	_, out, _ = execute(t, "dlq", "list", "--config", d.config, "--json", "--ids", fmt.Sprint(failed))
	if !strings.Contains(out, `"last_error": "HTTP 422: {\"error\": \"invalid\"}\nmore lines"`) || !strings.Contains(out, `"sink": "nats"`) {
		t.Fatalf("JSON: %s", out)
	}
	// More than the limit says so.
	_, out, _ = execute(t, "dlq", "list", "--config", d.config, "--limit", "1")
	if !strings.Contains(out, "showing the first 1; --limit N (0: all) shows more") {
		t.Fatalf("limit note missing:\n%s", out)
	}
}

// TestDLQList_ReceiverBody: the table shows a webhook error up to the
// receiver's body (which says what it refused), says where the whole error
// is when it had to cut one, and --json carries the error whole.
func TestDLQList_ReceiverBody(t *testing.T) {
	d := newOpsDB(t)
	body := `{"code":422,"message":"Field 'email' is required","hint":"` + strings.Repeat("x", 400) + `-END"}`
	lastError := `webhook n8n: event "order-1-created": receiver answered 422 Unprocessable Entity: ` + body
	id := d.insert(t, "order-1-created", "order.created", "failed", lastError)

	code, out, errOut := execute(t, "dlq", "list", "--config", d.config)
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	t.Logf("dlq list:\n%s", out)
	requireLines(t, out, `receiver answered 422 Unprocessable Entity: {"code":422,"message":"Field 'email' is required"`,
		"dlq list --json shows every error whole")

	_, out, _ = execute(t, "dlq", "list", "--config", d.config, "--json", "--ids", fmt.Sprint(id))
	var entries []admin.Entry
	if err := json.Unmarshal([]byte(out), &entries); err != nil || len(entries) != 1 || entries[0].LastError == nil || *entries[0].LastError != lastError {
		t.Fatalf("--json: %v\n%s", err, out)
	}
}

func TestDLQ_UsageErrors(t *testing.T) {
	d := newOpsDB(t)
	for _, tt := range []struct {
		args []string
		msg  string
	}{
		{[]string{"dlq", "list", "--sink", "nope"}, `--sink "nope": no such sink (configured: n8n, nats)`},
		{[]string{"dlq", "list", "--ids", "1,x"}, `--ids: "x" is not an event id`},
		{[]string{"dlq", "list", "--since", "yesterday"}, `--since "yesterday"`},
		{[]string{"dlq", "list", "--event-type", "[bad"}, `--event-type "[bad" is not a valid glob`},
		{[]string{"dlq", "retry", "--limit", "-1"}, "--limit must be 0 (all) or more"},
		{[]string{"dlq", "retry", "extra-arg"}, "unknown command"},
	} {
		code, _, errOut := execute(t, append(tt.args, "--config", d.config)...)
		if code != exitUsage || !strings.Contains(errOut, tt.msg) {
			t.Errorf("%v: exit %d, stderr %q, want 2 and %q", tt.args, code, errOut, tt.msg)
		}
	}
}

func TestDLQRetry(t *testing.T) {
	d := newOpsDB(t)
	failed := d.insert(t, "k-failed", "order.created", "failed", "HTTP 422")
	held := d.insert(t, "k-held", "order.created", "held", "unknown outcome")
	d.ledger(t, "k-failed", "nats", "delivered")
	d.ledger(t, "k-failed", "n8n", "sending")
	d.ledger(t, "k-held", "n8n", "unknown")

	// Asked and declined: nothing changes.
	code, out, errOut := executeWithInput(t, "n\n", "dlq", "retry", "--config", d.config)
	if code != exitFailure || !strings.Contains(errOut, "Reset 2 failed/held events to pending and clear their undelivered ledger rows for every sink? [y/N]") ||
		!strings.Contains(errOut, "not confirmed: nothing changed") {
		t.Fatalf("declined: exit %d\n%s%s", code, out, errOut)
	}
	if s, _ := d.status(t, failed); s != "failed" {
		t.Fatalf("declined retry changed the row: %s", s)
	}
	// No answer at all (stdin closed): a usage error naming --yes.
	if code, _, errOut := executeWithInput(t, "", "dlq", "retry", "--config", d.config); code != exitUsage || !strings.Contains(errOut, "--yes") {
		t.Fatalf("no answer: exit %d %s", code, errOut)
	}

	// Accepted, for n8n only.
	code, out, errOut = executeWithInput(t, "y\n", "dlq", "retry", "--config", d.config, "--sink", "n8n")
	if code != exitOK || !strings.Contains(out, "retried 2 events, cleared 2 ledger rows") {
		t.Fatalf("retry: exit %d\n%s%s", code, out, errOut)
	}
	for _, id := range []int64{failed, held} {
		if s, _ := d.status(t, id); s != "pending" {
			t.Fatalf("row %d is %s after retry", id, s)
		}
	}
	if got := d.ledgerStates(t, "k-failed"); got != "nats=delivered" {
		t.Fatalf("ledger after retry: %q", got)
	}
	var diverted, attempts int
	d.pool.QueryRow(t.Context(), `SELECT count(*) FILTER (WHERE handoff_at IS NOT NULL AND last_error IS NULL), sum(attempts) FROM integration_outbox`).Scan(&diverted, &attempts)
	if diverted != 2 || attempts != 0 {
		t.Fatalf("after retry: %d diverted without error, attempts %d", diverted, attempts)
	}

	// Nothing left to retry.
	code, out, _ = execute(t, "dlq", "retry", "--config", d.config, "--yes")
	if code != exitOK || !strings.Contains(out, "no events to retry: none matches") {
		t.Fatalf("empty retry: exit %d %s", code, out)
	}
}

// TestDLQDiscard: discard settles the chosen events with a status of their
// own, discarded (docs/schema.md, "A row's states"), their last error kept
// as it was: status counts them, dlq list --status discarded shows them, and
// a discarded held event no longer holds its aggregate's later events back
// at the claim path.
func TestDLQDiscard(t *testing.T) {
	d := newOpsDB(t)
	ctx := t.Context()
	held := d.insert(t, "k1", "order.created", "held", "HTTP 400: bad")
	other := d.insert(t, "k2", "invoice.paid", "failed", "HTTP 400")
	// A later event of the same aggregate (order/A1), at the claim path.
	later := d.insert(t, "k3", "order.created", "pending", "")
	d.exec(t, `UPDATE integration_outbox SET handoff_at = now(), available_at = now() WHERE id = $1`, later)
	store, err := ledger.New(d.pool, ledger.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	claim := func() []int64 {
		t.Helper()
		works, err := store.Claim(ctx, relay.ClaimQuery{Limit: 10, Owner: ledger.OwnerPrefix + "dlq-test"})
		if err != nil {
			t.Fatal(err)
		}
		var ids []int64
		for _, w := range works {
			ids = append(ids, w.Event.ID)
		}
		return ids
	}
	if got := claim(); len(got) != 0 {
		t.Fatalf("claimed %v behind a held event of the aggregate", got)
	}

	code, out, errOut := execute(t, "dlq", "discard", "--config", d.config, "--event-type", "order.*", "--yes")
	if code != exitOK || !strings.Contains(out, "discarded 1 events") {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	var lastError string
	var processed bool
	d.pool.QueryRow(ctx, `SELECT last_error, processed_at IS NOT NULL FROM integration_outbox WHERE id = $1 AND status = 'discarded'`, held).Scan(&lastError, &processed)
	if lastError != "HTTP 400: bad" || !processed {
		t.Fatalf("discarded row: last_error %q, processed_at set %v; want status discarded, the error kept, processed_at set", lastError, processed)
	}
	if s, _ := d.status(t, other); s != "failed" {
		t.Fatalf("the other event is %s", s)
	}

	code, out, errOut = execute(t, "status", "--config", d.config, "--json")
	var st admin.Status
	if code != exitOK || json.Unmarshal([]byte(out), &st) != nil || st.Rows["discarded"] != 1 || st.Rows["done"] != 0 || st.Rows["held"] != 0 {
		t.Fatalf("status --json: exit %d, rows %v\n%s%s", code, st.Rows, out, errOut)
	}
	if _, out, _ = execute(t, "status", "--config", d.config); !strings.Contains(out, "discarded 1") {
		t.Fatalf("status does not show the discarded row:\n%s", out)
	}
	listed := func(args ...string) string {
		t.Helper()
		code, out, errOut := execute(t, append([]string{"dlq", "list", "--config", d.config, "--json"}, args...)...)
		var entries []admin.Entry
		if code != exitOK || json.Unmarshal([]byte(out), &entries) != nil {
			t.Fatalf("dlq list %v: exit %d\n%s%s", args, code, out, errOut)
		}
		var got []string
		for _, e := range entries {
			got = append(got, fmt.Sprintf("%d:%s", e.ID, e.Status))
		}
		return strings.Join(got, " ")
	}
	if got, want := listed(), fmt.Sprintf("%d:failed", other); got != want {
		t.Errorf("dlq list = %q, want %q (failed and held only)", got, want)
	}
	if got, want := listed("--status", "discarded"), fmt.Sprintf("%d:discarded", held); got != want {
		t.Errorf("dlq list --status discarded = %q, want %q", got, want)
	}
	if got := claim(); fmt.Sprint(got) != fmt.Sprint([]int64{later}) {
		t.Fatalf("claimed %v after the discard, want the aggregate's later event %d", got, later)
	}
}

// TestDLQRetry_ProgressInBatches retries more rows than one batch: a
// progress bar, and every row changed.
func TestDLQRetry_ProgressInBatches(t *testing.T) {
	d := newOpsDB(t)
	d.exec(t, `INSERT INTO integration_outbox (event_type, event_key, status, last_error)
		SELECT 'order.created', 'bulk-' || g, 'failed', 'HTTP 500' FROM generate_series(1, 2500) g`)
	code, out, errOut := execute(t, "dlq", "retry", "--config", d.config, "--yes")
	if code != exitOK || !strings.Contains(out, "retried 2,500 events") {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	if !strings.Contains(errOut, "retry") || !strings.Contains(errOut, "2500/2500") {
		t.Fatalf("no progress bar on stderr: %q", errOut)
	}
	var pending int
	d.pool.QueryRow(t.Context(), `SELECT count(*) FROM integration_outbox WHERE status = 'pending'`).Scan(&pending)
	if pending != 2500 {
		t.Fatalf("%d pending after retry", pending)
	}

	// A small set has no bar.
	d.insert(t, "one", "order.created", "failed", "x")
	_, _, errOut = execute(t, "dlq", "retry", "--config", d.config, "--yes")
	if strings.Contains(errOut, "1/1") {
		t.Fatalf("progress bar for one row: %q", errOut)
	}
}

func TestParseSince(t *testing.T) {
	now := time.Date(2026, 3, 4, 12, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Time{
		"2026-01-02T15:04:05Z":      time.Date(2026, 1, 2, 15, 4, 5, 0, time.UTC),
		"2026-01-02T15:04:05+02:00": time.Date(2026, 1, 2, 13, 4, 5, 0, time.UTC),
		"2026-01-02":                time.Date(2026, 1, 2, 0, 0, 0, 0, time.UTC),
		"2026-01-02 15:04:05":       time.Date(2026, 1, 2, 15, 4, 5, 0, time.UTC),
		"90m":                       now.Add(-90 * time.Minute),
	} {
		got, err := parseSince(in, now)
		if err != nil || !got.Equal(want) {
			t.Errorf("parseSince(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	if _, err := parseSince("-5m", now); err == nil {
		t.Error("a negative duration was accepted")
	}
}

func TestExcerpt(t *testing.T) {
	for _, tt := range []struct {
		in   string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"line one\nline 2", 20, "line one …"},
		{"tab\there\x1b[31m", 20, "tab here [31m"},
		{"ééééééééééé", 5, "éééé…"},
	} {
		if got := excerpt(tt.in, tt.n); got != tt.want {
			t.Errorf("excerpt(%q, %d) = %q, want %q", tt.in, tt.n, got, tt.want)
		}
	}
	if got := count(1234567); got != "1,234,567" {
		t.Errorf("count = %q", got)
	}
}
