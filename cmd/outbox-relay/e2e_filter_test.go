package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// hookFilter is the webhook sink's filter in the filter tests.
const hookFilter = `    filter: 'payload.amount > 100 && event_type == "order.placed"'`

// publishAmounts publishes one order.placed event per amount, keyed
// prefix-i, with {"amount": amount}; a negative amount publishes a payload
// without the field, on which hookFilter fails. It returns the keys
// hookFilter accepts.
func (s *setup) publishAmounts(t *testing.T, prefix string, amounts ...int) (taken []string) {
	t.Helper()
	for i, a := range amounts {
		key := fmt.Sprintf("%s-%d", prefix, i)
		payload := fmt.Sprintf(`{"amount": %d}`, a)
		if a < 0 {
			payload = `{"note": "no amount"}`
		}
		s.scalar(t, `SELECT count(*) FROM (SELECT outbox_publish('order.placed', 'order', $1, $2, $3::jsonb)) AS x`, prefix, key, payload)
		if a > 100 {
			taken = append(taken, key)
		}
	}
	return taken
}

// waitSettled waits until every row is done or dead-lettered.
func (s *setup) waitSettled(t *testing.T) {
	t.Helper()
	eventually(t, 60*time.Second, "every row settled", func() bool {
		return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status IS DISTINCT FROM 'done' AND status IS DISTINCT FROM 'failed'`) == 0
	})
}

// TestRelay_FilterByPayload: a webhook sink with a filter on a payload
// field gets the events it accepts and no other, through a new slot's
// hand-over (rows written before the first start), the stream, a restart
// and the poll mode; NATS, without a filter, gets every event. An event
// the filter fails on is dead-lettered for the webhook only, naming the
// error, NATS gets it, and the stream goes on. verify, event and dlq route
// as the engine did (docs/sinks.md, "Filters").
func TestRelay_FilterByPayload(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	amounts := []int{50, 150, 100, 101, 500}
	want := s.publishAmounts(t, "handover", amounts...)
	cfg := s.configFile(t, hookFilter)
	stop := s.startInProcess(t, cfg)
	s.waitSlot(t)
	want = append(want, s.publishAmounts(t, "stream", amounts...)...)
	s.publishAmounts(t, "bad", -1)
	want = append(want, s.publishAmounts(t, "after", amounts...)...)
	s.waitSettled(t)
	stop()

	want = append(want, s.publishAmounts(t, "stopped", amounts...)...)
	stop = s.startInProcess(t, cfg)
	s.waitSettled(t)
	stop()

	pollCfg := s.configFileWith(t, hookFilter, "source: {mode: poll, poll_interval: 200ms}")
	stop = s.startInProcess(t, pollCfg)
	want = append(want, s.publishAmounts(t, "poll", amounts...)...)
	s.waitSettled(t)
	stop()

	all := s.keys(t, "true")
	eventually(t, 10*time.Second, "every event in the stream", func() bool { return len(byKey(streamMessages(t, s.nats.URL()))) == len(all) })
	hook := byKey(s.hook.deliveries())
	for _, k := range want {
		if len(hook[k]) != 1 {
			t.Errorf("%s reached the webhook %d times, want once", k, len(hook[k]))
		}
	}
	if len(hook) != len(want) {
		t.Fatalf("the webhook got %d events, want the %d its filter accepts", len(hook), len(want))
	}
	var status, lastError string
	if err := s.pool.QueryRow(t.Context(), `SELECT status, last_error FROM integration_outbox WHERE event_key = 'bad-0'`).Scan(&status, &lastError); err != nil {
		t.Fatal(err)
	}
	if status != "failed" || !strings.Contains(lastError, "sink hook: filter: no such key: amount") || strings.Contains(lastError, "sink nats") {
		t.Fatalf("bad-0: status %s, last_error %q; want failed, naming the webhook's filter error only", status, lastError)
	}
	if n := s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status <> 'done'`); n != 1 {
		t.Fatalf("%d rows not done, want 1 (bad-0)", n)
	}

	code, out, errOut := execute(t, "verify", "--config", cfg, "--since", "1h", "--json")
	if code != exitOK {
		t.Fatalf("verify: exit %d\n%s%s", code, out, errOut)
	}
	v := parseVerify(t, out)
	if !v.Clean || v.Rows != int64(len(all)) {
		t.Fatalf("verify: clean %v, %d rows, gaps %v", v.Clean, v.Rows, v.gaps())
	}
	if h := v.tally("hook"); h.Routed != int64(len(want)+1) || h.Delivered != int64(len(want)) || h.DeadLettered != 1 {
		t.Errorf("verify hook: %+v; want %d routed (with bad-0), %d delivered, 1 dead-lettered", *h, len(want)+1, len(want))
	}

	for key, routed := range map[string]bool{"stream-1": true, "stream-0": false, "bad-0": true} {
		code, out, errOut := execute(t, "event", key, "--json", "--config", cfg)
		if code != exitOK {
			t.Fatalf("event %s: exit %d\n%s%s", key, code, out, errOut)
		}
		var r admin.EventReport
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatal(err)
		}
		for _, sk := range r.Sinks {
			if sk.Name == "hook" && sk.Routed != routed {
				t.Errorf("event %s: the webhook routed %v, want %v", key, sk.Routed, routed)
			}
		}
	}
	code, out, _ = execute(t, "dlq", "list", "--config", cfg, "--sink", "hook", "--json")
	if code != exitOK || !strings.Contains(out, `"bad-0"`) {
		t.Fatalf("dlq list --sink hook: exit %d\n%s", code, out)
	}

	// The filter fixed (guarded), the dead letter retried: the claim path
	// routes it by the new filter, which refuses it; it ends done, and
	// nothing reaches the webhook or NATS again.
	fixed := s.configFile(t, `    filter: 'has(payload.amount) && payload.amount > 100'`)
	bad := s.scalar(t, `SELECT id FROM integration_outbox WHERE event_key = 'bad-0'`)
	if code, out, errOut := execute(t, "dlq", "retry", "--ids", fmt.Sprint(bad), "--yes", "--config", fixed); code != exitOK {
		t.Fatalf("dlq retry: exit %d\n%s%s", code, out, errOut)
	}
	stop = s.startInProcess(t, fixed)
	eventually(t, 30*time.Second, "bad-0 done", func() bool {
		return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE event_key = 'bad-0' AND status = 'done'`) == 1
	})
	stop()
	if n := len(byKey(s.hook.deliveries())["bad-0"]); n != 0 {
		t.Fatalf("bad-0 reached the webhook %d times after the retry, want none", n)
	}
	if n := len(byKey(streamMessages(t, s.nats.URL()))["bad-0"]); n != 1 {
		t.Fatalf("bad-0 is in the stream %d times, want once", n)
	}
	code, out, errOut = execute(t, "verify", "--config", fixed, "--since", "1h", "--json")
	if v := parseVerify(t, out); code != exitOK || !v.Clean || v.tally("hook").DeadLettered != 0 {
		t.Fatalf("verify after the retry: exit %d, clean %v, gaps %v\n%s", code, v.Clean, v.gaps(), errOut)
	}
}
