package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// metric returns the sum of a metric's samples whose labels contain match.
func metric(t *testing.T, body, name, match string) float64 {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `(\{[^}]*\})? ([0-9.e+-]+)$`)
	sum := 0.0
	for _, m := range re.FindAllStringSubmatch(body, -1) {
		if strings.Contains(m[1], match) {
			v, _ := strconv.ParseFloat(m[2], 64)
			sum += v
		}
	}
	return sum
}

func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestRelay_Operations: /metrics moves while events flow and its table
// gauges match SQL; /readyz answers; `dlq retry` turns a failed row into a
// delivered one; `replay --ids X --sink nats` re-delivers to NATS only, as a
// new message despite the duplicate window.
func TestRelay_Operations(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	addr := freeAddr(t)
	reject := true
	s.hook.setReply(func(d delivery) int {
		if d.EventKey == "ops-bad" && reject {
			return 422
		}
		return 204
	})
	cfgPath := s.configFileWith(t, "", fmt.Sprintf("http: {listen: %q}\n", addr))
	// configFileWith already sets http.listen to port 0; the last key wins
	// only if the loader allows duplicates, so rewrite it instead.
	cfgBytes, _ := readFile(cfgPath)
	cfgBytes = strings.Replace(cfgBytes, `http: {listen: "127.0.0.1:0"}`, "", 1)
	writeFile(t, cfgPath, cfgBytes)
	s.startInProcess(t, cfgPath)
	s.waitSlot(t)
	if resp, err := http.Get("http://" + addr + "/readyz"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("/readyz: %v %v", resp, err)
	}

	before := scrape(t, addr)
	s.publishWriters(t, 2, 200, 10, "ops")
	ctx := context.Background()
	if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', 'bad', 'ops-bad', '{}')`); err != nil {
		t.Fatal(err)
	}
	s.waitAllDelivered(t, 60*time.Second, s.keys(t, "event_key <> 'ops-bad'"))
	eventually(t, 10*time.Second, "the bad event dead-lettered", func() bool {
		return s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE event_key = 'ops-bad' AND status = 'failed'") == 1
	})

	after := scrape(t, addr)
	for _, sink := range []string{"hook", "nats"} {
		d := metric(t, after, "outbox_relay_delivered_total", `sink="`+sink+`"`) - metric(t, before, "outbox_relay_delivered_total", `sink="`+sink+`"`)
		h := metric(t, after, "outbox_relay_delivery_latency_seconds_count", `sink="`+sink+`"`) - metric(t, before, "outbox_relay_delivery_latency_seconds_count", `sink="`+sink+`"`)
		if d < 400 || h < 400 {
			t.Fatalf("%s: delivered_total moved by %v, latency histogram by %v; want ≥ 400", sink, d, h)
		}
	}
	if f := metric(t, after, "outbox_relay_failed_total", `sink="hook"`); f < 1 {
		t.Fatalf("failed_total %v", f)
	}
	if metric(t, after, "outbox_relay_leader", "") != 1 || metric(t, after, "outbox_relay_mode", `mode="replication"`) != 1 {
		t.Fatal("leader or mode gauge wrong")
	}

	// Table gauges match SQL once refreshed (every 10 s).
	if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_key, payload, status, created_at) VALUES ('ops-stuck', '{}', 'held', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	eventually(t, 15*time.Second, "table gauges refreshed", func() bool {
		return metric(t, scrape(t, addr), "outbox_relay_rows", `status="held"`) == 1
	})
	body := scrape(t, addr)
	pending := s.scalar(t, "SELECT count(*) FROM integration_outbox o WHERE status IN ('pending', 'processing') AND NOT "+doneSQL)
	if got := metric(t, body, "outbox_relay_pending_rows", ""); int64(got) != pending {
		t.Fatalf("pending_rows %v, SQL says %d", got, pending)
	}
	if got := metric(t, body, "outbox_relay_rows", `status="failed"`); got != 1 {
		t.Fatalf("rows{failed} %v", got)
	}
	oldest := s.scalar(t, "SELECT coalesce(extract(epoch FROM now() - min(created_at))::bigint, 0) FROM integration_outbox WHERE status = 'pending'")
	if got := metric(t, body, "outbox_relay_oldest_pending_age_seconds", ""); got > float64(oldest)+15 {
		t.Fatalf("oldest_pending_age_seconds %v, SQL says %d", got, oldest)
	}

	// dlq retry: the receiver accepts it now; the claim path delivers it.
	reject = false
	var out, errOut bytes.Buffer
	if code := Execute(ctx, []string{"dlq", "retry", "--config", cfgPath, "--yes"}, &out, &errOut); code != 0 {
		t.Fatalf("dlq retry: exit %d\n%s%s", code, out.String(), errOut.String())
	}
	eventually(t, 20*time.Second, "the retried event delivered", func() bool {
		return s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE event_key = 'ops-bad' AND status = 'done'") == 1 &&
			len(byKey(s.hook.deliveries())["ops-bad"]) == 1
	})

	// replay one event to NATS only.
	id := s.scalar(t, "SELECT id FROM integration_outbox WHERE event_key = 'ops-w0-0'")
	hookBefore := len(byKey(s.hook.deliveries())["ops-w0-0"])
	out.Reset()
	errOut.Reset()
	if code := Execute(ctx, []string{"replay", "--config", cfgPath, "--ids", fmt.Sprint(id), "--sink", "nats", "--yes"}, &out, &errOut); code != 0 {
		t.Fatalf("replay: exit %d\n%s%s", code, out.String(), errOut.String())
	}
	eventually(t, 20*time.Second, "a second NATS message for the replayed event", func() bool {
		return len(byKey(streamMessages(t, s.nats.URL()))["ops-w0-0"]) == 2
	})
	copies := byKey(streamMessages(t, s.nats.URL()))["ops-w0-0"]
	if copies[1].IdemKey != "ops-w0-0~r1" || copies[1].Body != copies[0].Body {
		t.Fatalf("replay stored with Msg-Id %q (want ops-w0-0~r1) and body equal: %v", copies[1].IdemKey, copies[1].Body == copies[0].Body)
	}
	time.Sleep(2 * time.Second)
	if n := len(byKey(s.hook.deliveries())["ops-w0-0"]); n != hookBefore {
		t.Fatalf("replay --sink nats reached the webhook too (%d → %d)", hookBefore, n)
	}
}

func readFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	return string(b), err
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}
