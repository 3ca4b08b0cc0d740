package main

import (
	"fmt"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// TestRelay_DeploymentsShareAStream: two databases, each with its own relay
// (one streaming, one polling), deliver to the same NATS server with the
// default stream and subjects, as a new user would set them up. Each
// publishes an event keyed collide-1 (event keys are unique per outbox, not
// per NATS account): the stream stores both, each under its own
// deployment's scope, and both ledgers record nats delivered.
func TestRelay_DeploymentsShareAStream(t *testing.T) {
	a := newSetup(t, pgtest.NewDatabase(t))
	b := newSetup(t, pgtest.NewDatabase(t))
	b.nats = a.nats
	a.biRun(t, a.biConfigFile(t, biConfig{top: biSource("replication")}))
	a.waitSlot(t)
	b.biRun(t, b.biConfigFile(t, biConfig{top: biSource("poll")}))

	for _, s := range []*setup{a, b} {
		s.biPublish(t, "order.placed", "order", "1", "collide-1", `{}`)
	}
	for _, s := range []*setup{a, b} {
		s.biWaitDelivered(t, "hook", "collide-1")
		eventually(t, 30*time.Second, "collide-1 recorded delivered to nats", func() bool {
			return s.biLedger(t, "collide-1")["nats"] == "delivered"
		})
	}

	var got []string
	forEachOutboxMessage(t, a.nats, func(m jetstream.Msg) {
		got = append(got, m.Headers().Get(natssink.HeaderDeployment)+" "+m.Headers().Get(jetstream.MsgIDHeader))
	})
	depA, depB := a.deployment(t).ID, b.deployment(t).ID
	if depA == depB {
		t.Fatalf("both databases derive the deployment %q", depA)
	}
	want := []string{depA + " " + depA + ":collide-1", depB + " " + depB + ":collide-1"}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("the stream holds %q, want one message of each deployment: %q", got, want)
	}
}

// TestRelay_NATSDownAtStart: the NATS server is down when run starts. The
// relay stays up: the webhook gets every event, the NATS sink is down (its
// events wait on the claim path without using an attempt), /readyz answers
// 200 naming the sink and why, and status names it too. Once the server is
// up, the sink connects, checks its stream and delivers what waited, each
// event once.
func TestRelay_NATSDownAtStart(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.nats.Shutdown()
	cfg := s.configFileWith(t, "", biSource("replication"))
	r := s.biRun(t, cfg)
	s.waitSlot(t)

	for i := range 6 {
		s.biPublish(t, "order.placed", "order", fmt.Sprint(i%2), fmt.Sprintf("down-%d", i), `{}`)
	}
	keys := slices.Sorted(maps.Keys(s.keys(t, "true")))
	eventually(t, 30*time.Second, "every event at the webhook and waiting for NATS on the claim path", func() bool {
		r.alive(t)
		hook := s.biAt(t, "hook")
		for _, k := range keys {
			if len(hook[k]) == 0 {
				return false
			}
		}
		return s.scalar(t, `SELECT count(*) FROM integration_outbox WHERE status = 'pending' AND handoff_at IS NOT NULL
			AND attempts = 0 AND last_error LIKE 'sink nats: %'`) == int64(len(keys))
	})
	code, body := biReadyz(t, r.addr(t))
	if code != http.StatusOK || !regexp.MustCompile(`(?m)^ready\nsink nats is down: nats connection to nats://127\.0\.0\.1:\d+ is RECONNECTING`).MatchString(body) {
		t.Fatalf("/readyz: %d %q; want 200, ready, and a line naming the nats sink down", code, body)
	}
	if code, out, stderr := execute(t, "status", "--config", cfg); code != 0 || !regexp.MustCompile(`sink down: +nats: 6 pending rows`).MatchString(out) {
		t.Fatalf("status: exit %d, want a line naming nats down:\n%s%s", code, out, stderr)
	}
	if n := s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status = 'failed'"); n != 0 {
		t.Fatalf("%d rows dead-lettered while NATS was down", n)
	}

	s.nats.Restart(t)
	s.biFlows(t, keys...)
	eventually(t, 10*time.Second, "every row done", func() bool {
		return s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status <> 'done'") == 0
	})
	for k, ds := range s.biAt(t, "nats") {
		if len(ds) != 1 {
			t.Fatalf("NATS stored %q %d times", k, len(ds))
		}
	}
	if code, body := biReadyz(t, r.addr(t)); code != http.StatusOK || body != "ready\n" {
		t.Fatalf("/readyz with NATS up: %d %q", code, body)
	}
	if !strings.Contains(r.logs.String(), "nats sink ready") {
		t.Fatal("the log does not say the nats sink became ready")
	}
}

// TestRelay_WebhookDownInReadyz: a webhook whose receiver answers 404 (a
// URL that is not there) is named by /readyz, which stays 200, for as long
// as its receiver is down; once it answers 204 the line goes and the
// events that waited are delivered (docs/sinks.md, "A server down at
// start").
func TestRelay_WebhookDownInReadyz(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.hook.setReply(func(delivery) int { return http.StatusNotFound })
	cfg := s.configFileWith(t, "", biSource("replication"))
	r := s.biRun(t, cfg)
	s.waitSlot(t)
	s.biPublish(t, "order.placed", "order", "1", "hook-down-1", `{}`)
	down := regexp.MustCompile(`(?m)^ready\nsink hook is down: sink-down: webhook hook: .*404`)
	var code int
	var body string
	eventually(t, 30*time.Second, "/readyz naming the webhook down", func() bool {
		r.alive(t)
		code, body = biReadyz(t, r.addr(t))
		return code == http.StatusOK && down.MatchString(body)
	})
	s.hook.setReply(nil)
	s.biWaitDelivered(t, "hook", "hook-down-1")
	eventually(t, 10*time.Second, "/readyz without the webhook's line", func() bool {
		code, body = biReadyz(t, r.addr(t))
		return code == http.StatusOK && body == "ready\n"
	})
}
