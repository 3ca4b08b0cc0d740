package main

import (
	"slices"
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
