package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// verifyOutput is verify --json's output.
type verifyOutput struct {
	Clean bool    `json:"clean"`
	Took  float64 `json:"took_seconds"`
	admin.VerifyReport
}

func parseVerify(t *testing.T, out string) verifyOutput {
	t.Helper()
	var v verifyOutput
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("verify --json: %v\n%s", err, out)
	}
	return v
}

// gaps returns the listed gaps as "kind@sink: id" (or the key when there is
// no row), sorted.
func (v verifyOutput) gaps() []string {
	var out []string
	for _, g := range v.Gaps {
		for _, x := range g.First {
			what := fmt.Sprint(x.ID)
			if x.ID == 0 {
				what = x.EventKey
			}
			out = append(out, fmt.Sprintf("%s@%s: %s", g.Kind, g.Sink, what))
		}
	}
	slices.Sort(out)
	return out
}

func (v verifyOutput) tally(sink string) *admin.SinkTally {
	for _, t := range v.Sinks {
		if t.Sink == sink {
			return t
		}
	}
	return nil
}

// deleteStoredCopy removes key's message from the stream.
func deleteStoredCopy(t *testing.T, url, key string) {
	t.Helper()
	ctx := context.Background()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	stream, err := js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{HeadersOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	for {
		batch, err := cons.Fetch(100, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			if m.Headers().Get(natssink.HeaderEventKey) != key {
				continue
			}
			meta, _ := m.Metadata()
			if err := stream.DeleteMsg(ctx, meta.Sequence.Stream); err != nil {
				t.Fatal(err)
			}
			return
		}
		if n == 0 {
			t.Fatalf("no message of %s in the stream", key)
		}
	}
}

// TestVerifyCommand runs the relay, then verify: a clean run exits 0; then
// each kind of gap is made by hand — a ledger row deleted, a message removed
// from the stream, a message stored twice under two ids, an event the
// receiver's table lacks, a row stuck, a ledger row for a sink the row is
// not routed to, a ledger row without its row — and verify finds each,
// exits 1, and lists a query for those it can.
func TestVerifyCommand(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfg := s.configFile(t, `    events: ["order.*"]`)
	stop := s.startInProcess(t, cfg)
	s.publishWriters(t, 2, 40, 5, "v")
	for i := range 5 {
		s.scalar(t, `SELECT count(*) FROM (SELECT outbox_publish('invoice.sent', 'invoice', 'I1', $1, '{}')) AS x`, fmt.Sprintf("inv-%d", i))
	}
	s.waitDone(t, "true", 85)
	eventually(t, 10*time.Second, "every order at the webhook", func() bool { return len(byKey(s.hook.deliveries())) == 80 })
	stop()

	s.scalar(t, `SELECT count(*) FROM (SELECT 1) AS x`) // the pool still works after the relay stopped
	if _, err := s.pool.Exec(context.Background(), `CREATE TABLE received (event_key text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	for key := range byKey(s.hook.deliveries()) {
		if _, err := s.pool.Exec(context.Background(), `INSERT INTO received VALUES ($1)`, key); err != nil {
			t.Fatal(err)
		}
	}
	receiver := "--receiver-query=SELECT event_key FROM received WHERE event_key = ANY($1)"
	deep := []string{"verify", "--config", cfg, "--since", "1h", "--deep", receiver, "--json"}

	code, out, errOut := execute(t, deep...)
	if code != exitOK {
		t.Fatalf("a clean run: exit %d\n%s%s", code, out, errOut)
	}
	v := parseVerify(t, out)
	if !v.Clean || v.Rows != 85 {
		t.Fatalf("a clean run: clean %v, %d rows, gaps %v", v.Clean, v.Rows, v.gaps())
	}
	if n := v.tally("nats"); n.Delivered != 85 || n.Stream == nil || n.Stream.Read != 85 || n.Stream.Replays != 0 {
		t.Errorf("nats: %+v, stream %+v", *n, n.Stream)
	}
	if h := v.tally("hook"); h.Routed != 80 || h.Delivered != 80 || h.Receiver == nil || *h.Receiver != 80 {
		t.Errorf("hook: %+v", *h)
	}

	id := func(key string) int64 {
		return s.scalar(t, `SELECT id FROM integration_outbox WHERE event_key = $1`, key)
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := s.pool.Exec(context.Background(), sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`DELETE FROM integration_idempotency WHERE event_key = 'v-w0-1' AND action = 'hook'`)
	deleteStoredCopy(t, s.nats.URL(), "v-w0-2")
	nc, err := nats.Connect(s.nats.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	copyMsg := nats.NewMsg("outbox.order.order_placed")
	copyMsg.Header.Set(jetstream.MsgIDHeader, "another-deployment:v-w0-3")
	copyMsg.Header.Set(natssink.HeaderEventKey, "v-w0-3")
	copyMsg.Header.Set(natssink.HeaderEventID, fmt.Sprint(id("v-w0-3")))
	copyMsg.Data = []byte(`{}`)
	if _, err := js.PublishMsg(context.Background(), copyMsg); err != nil {
		t.Fatal(err)
	}
	exec(`DELETE FROM received WHERE event_key = 'v-w0-4'`)
	exec(`INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, created_at, available_at)
		VALUES ('order.placed', 'order', 'S1', 'stuck-1', '{}', now() - interval '10 minutes', now() - interval '10 minutes')`)
	exec(`INSERT INTO integration_idempotency (event_key, action, state, delivered_at) VALUES ('inv-0', 'hook', 'delivered', now()), ('ghost', 'nats', 'delivered', now())`)

	code, out, errOut = execute(t, deep...)
	if code != exitFailure || !strings.Contains(errOut, "verify found 7 gaps") {
		t.Fatalf("gaps: exit %d\n%s%s", code, out, errOut)
	}
	v = parseVerify(t, out)
	want := []string{
		fmt.Sprintf("duplicate@nats: %d", id("v-w0-3")),
		fmt.Sprintf("missing@hook: %d", id("v-w0-1")),
		fmt.Sprintf("missing_at_sink@hook: %d", id("v-w0-4")),
		fmt.Sprintf("missing_at_sink@nats: %d", id("v-w0-2")),
		"orphaned@nats: ghost",
		fmt.Sprintf("stuck@: %d", id("stuck-1")),
		fmt.Sprintf("unrouted@hook: %d", id("inv-0")),
	}
	slices.Sort(want)
	if got := v.gaps(); v.Clean || !slices.Equal(got, want) {
		t.Fatalf("gaps:\n got  %q\n want %q", got, want)
	}

	// For people: each kind, its first rows, and the query that lists
	// them all.
	code, out, _ = execute(t, "verify", "--config", cfg, "--since", "1h")
	for _, line := range []string{"MISSING at hook: 1", "STUCK: 1", "UNROUTED at hook: 1", "ORPHANED at nats: 1", "all of them:", "FROM \"public\".\"integration_outbox\" AS o"} {
		if !strings.Contains(out, line) {
			t.Errorf("the report lacks %q:\n%s", line, out)
		}
	}
	if code != exitFailure {
		t.Errorf("exit %d, want 1", code)
	}

	// --ids: the rows named; no orphans (a ledger row has no id).
	code, out, _ = execute(t, "verify", "--config", cfg, "--ids", fmt.Sprintf("%d,%d", id("v-w0-0"), id("v-w0-1")), "--json")
	v = parseVerify(t, out)
	if code != exitFailure || v.Rows != 2 || !slices.Equal(v.gaps(), []string{fmt.Sprintf("missing@hook: %d", id("v-w0-1"))}) || len(v.Notes) == 0 {
		t.Errorf("--ids: exit %d, %d rows, gaps %q, notes %q", code, v.Rows, v.gaps(), v.Notes)
	}
	// --sink nats: nats's pairs and ledger rows only (a stuck row concerns
	// every sink it waits for).
	code, out, _ = execute(t, "verify", "--config", cfg, "--since", "1h", "--sink", "nats", "--deep", "--json")
	v = parseVerify(t, out)
	for _, g := range v.gaps() {
		if !strings.Contains(g, "@nats") && !strings.HasPrefix(g, "stuck@") {
			t.Errorf("--sink nats reports %s", g)
		}
	}
	if code != exitFailure || len(v.Sinks) != 1 {
		t.Errorf("--sink nats: exit %d, sinks %d", code, len(v.Sinks))
	}
}

func TestVerifyCommand_Usage(t *testing.T) {
	cfg := writeOpsConfig(t, "postgres://127.0.0.1:9/none", `
  - name: nats
    type: nats
    url: nats://127.0.0.1:9`)
	for _, args := range [][]string{
		{"verify", "--config", cfg},
		{"verify", "--config", cfg, "--ids", "5-x"},
		{"verify", "--config", cfg, "--ids", "9-5"},
		{"verify", "--config", cfg, "--since", "yesterday"},
		{"verify", "--config", cfg, "--since", "1h", "--receiver-query", "SELECT 1"},
		{"verify", "--config", cfg, "--since", "1h", "--sink", "nope"},
		{"verify", "--config", cfg, "--since", "1h", "--deep", "--receiver-query", "SELECT event_key FROM t WHERE event_key = ANY($1)"},
		{"verify", "--config", cfg, "--since", "1h", "--list", "-1"},
	} {
		if code, out, errOut := execute(t, args...); code != exitUsage {
			t.Errorf("%q: exit %d, want 2\n%s%s", args, code, out, errOut)
		}
	}
}

func TestParseIDRanges(t *testing.T) {
	got, err := parseIDRanges("1,2, 5-9,8-12,20")
	want := []admin.IDRange{{From: 1, To: 2}, {From: 5, To: 12}, {From: 20, To: 20}}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("parseIDRanges = %v, %v; want %v", got, err, want)
	}
	for _, bad := range []string{"", ",", "a", "5-", "-5", "9-5", "1-2-3"} {
		if _, err := parseIDRanges(bad); err == nil {
			t.Errorf("parseIDRanges(%q) accepted", bad)
		}
	}
}

// gaugeValue reads g.
func gaugeValue(g prometheus.Gauge) float64 {
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		return -1
	}
	return m.GetGauge().GetValue()
}

// TestRun_ContinuousVerify: with verify.interval set, run checks the last
// window on its own and exports what it finds (outbox_relay_verify_gaps).
func TestRun_ContinuousVerify(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfg := s.configFileWith(t, "", "verify: {interval: 300ms, window: 1h}")
	s.startInProcess(t, cfg)
	s.publishWriters(t, 1, 20, 4, "c")
	s.waitDone(t, "true", 20)
	eventually(t, 10*time.Second, "a clean pass", func() bool {
		return gaugeValue(relay.VerifyLastRun) > 0 && gaugeValue(relay.VerifyGaps.WithLabelValues("missing")) == 0
	})
	if _, err := s.pool.Exec(context.Background(), `DELETE FROM integration_idempotency WHERE event_key = 'c-w0-3' AND action = 'nats'`); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "outbox_relay_verify_gaps{kind=\"missing\"} 1", func() bool {
		return gaugeValue(relay.VerifyGaps.WithLabelValues("missing")) == 1
	})
	for _, k := range []string{"stuck", "unrouted", "orphaned"} {
		if n := gaugeValue(relay.VerifyGaps.WithLabelValues(k)); n != 0 {
			t.Errorf("verify_gaps{kind=%q} = %v", k, n)
		}
	}
}
