package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestRelay_RateLimit: 2,000 events into a webhook limited to 200 events a
// second take about 10 s to reach it, in per-aggregate order, while NATS,
// without a limit, gets them all long before; the slot's confirmed
// position passes the events while the webhook is still behind: the limit
// never holds the slot. The wait is counted in the sink's metrics.
func TestRelay_RateLimit(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfgPath := s.configFile(t, "    rate_limit: {per_second: 200, burst: 20}")
	var logs syncBuffer
	s.startProcess(t, cfgPath, &logs)
	s.waitSlot(t)

	start := time.Now()
	s.publishWriters(t, 4, 500, 10, "rl")
	_, written := s.slotLSN(t)
	keys := s.keys(t, "event_key LIKE 'rl-%'")
	if len(keys) != 2000 {
		t.Fatalf("%d events published, want 2000", len(keys))
	}
	hookHas := func() int {
		n := 0
		for k := range byKey(s.hook.deliveries()) {
			if keys[k] {
				n++
			}
		}
		return n
	}
	eventually(t, 30*time.Second, "every event at NATS", func() bool {
		n := 0
		for k := range byKey(streamMessages(t, s.nats.URL())) {
			if keys[k] {
				n++
			}
		}
		return n == len(keys)
	})
	natsTook := time.Since(start)
	eventually(t, 10*time.Second, "the slot's confirmed position past the events", func() bool {
		confirmed, _ := s.slotLSN(t)
		return confirmed >= written
	})
	atConfirm := hookHas()
	if atConfirm >= len(keys) {
		t.Fatalf("the webhook had every event when the slot passed them: the limit was not felt")
	}
	eventually(t, 40*time.Second, "every event at the limited webhook", func() bool { return hookHas() == len(keys) })
	hookTook := time.Since(start)
	t.Logf("NATS got 2,000 events in %s; the webhook limited to 200/s in %s (it had %d when the slot passed them)",
		natsTook.Round(time.Millisecond), hookTook.Round(time.Millisecond), atConfirm)
	if hookTook < 8*time.Second || hookTook > 16*time.Second {
		t.Errorf("the limited webhook took %s for 2,000 events at 200/s, want 8 s to 16 s", hookTook)
	}
	if natsTook > hookTook/2 {
		t.Errorf("NATS took %s, the webhook %s: the unlimited sink should not wait for the limited one", natsTook, hookTook)
	}
	checkOrder(t, "webhook", s.hook.deliveries())
	var status bytes.Buffer
	if code := Execute(context.Background(), []string{"status", "--config", cfgPath}, &status, &status); code != exitOK ||
		!strings.Contains(status.String(), "rate limit:") || !strings.Contains(status.String(), "hook 200/s, burst 20") {
		t.Errorf("status: exit %d:\n%s", code, status.String())
	}
	if !strings.Contains(logs.String(), "relay running") {
		t.Errorf("no start in the log:\n%s", logs.String())
	}
}
