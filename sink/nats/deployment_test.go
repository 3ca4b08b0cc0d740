package nats_test

import (
	"context"
	"slices"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// TestDeploymentsSharingAStreamKeepEachOthersEvents: two deployments (two
// outboxes, each with its own relay) publish into one stream, and each has
// an event keyed collide-1 — event keys are unique per outbox, not per NATS
// account. Both events are stored and both sends count as delivered; each
// deployment's re-send of its own event is dropped as a duplicate.
func TestDeploymentsSharingAStreamKeepEachOthersEvents(t *testing.T) {
	srv := natstest.Start(t)
	js := MustJetStream(t, srv)
	sinks := map[string]*natssink.Sink{}
	for _, dep := range []string{"orders-db", "billing-db"} {
		cfg := testConfig(srv)
		cfg.Deployment = natssink.Deployment{ID: dep}
		sinks[dep] = MustNew(t, cfg)
	}

	for dep, s := range sinks {
		d := delivery(1)
		d.Event.EventKey = "collide-1"
		if err := sendSync(t, s, d); err != nil {
			t.Fatalf("%s: %v", dep, err)
		}
		if s.Duplicates() != 0 {
			t.Fatalf("%s: its event was acknowledged as a duplicate of the other deployment's", dep)
		}
	}
	for dep, s := range sinks {
		again := delivery(1)
		again.Event.EventKey = "collide-1"
		again.Attempt = 2
		if err := sendSync(t, s, again); err != nil {
			t.Fatalf("%s: re-send: %v", dep, err)
		}
		if s.Duplicates() != 1 {
			t.Fatalf("%s: Duplicates() = %d after its own re-send, want 1", dep, s.Duplicates())
		}
	}

	msgs := stored(t, js, testStream)
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d messages, want one per deployment", len(msgs))
	}
	seen := map[string]bool{}
	for _, m := range msgs {
		dep, id := m.Headers().Get(natssink.HeaderDeployment), m.Headers().Get(jetstream.MsgIDHeader)
		if sinks[dep] == nil || id != dep+":collide-1" || seen[dep] {
			t.Fatalf("message %s=%q Nats-Msg-Id %q; want one of each deployment, its id scoped by it", natssink.HeaderDeployment, dep, id)
		}
		seen[dep] = true
		if got := m.Headers().Get(natssink.HeaderEventKey); got != "collide-1" {
			t.Fatalf("%s: %s %q", dep, natssink.HeaderEventKey, got)
		}
	}
}

// TestUpgradeKeepsDeduplicatingEarlierSends: a relay of the version before
// the scoping published evt-42 under its bare key, and the outcome was
// unknown; after the upgrade the new version re-sends it. Events below the
// deployment's cut-over keep the bare id, so the stream drops the re-send as
// a duplicate: the event is stored once. An event from after the upgrade is
// scoped, and its own re-send is dropped too.
func TestUpgradeKeepsDeduplicatingEarlierSends(t *testing.T) {
	srv := natstest.Start(t)
	js := MustJetStream(t, srv)
	cfg := testConfig(srv)
	cfg.Deployment.ScopedFrom = 100
	s := MustNew(t, cfg)

	// As the earlier version published it: the bare key, no deployment.
	old := delivery(42)
	msg := nats.NewMsg("outbox.order.order_placed")
	msg.Header.Set(jetstream.MsgIDHeader, old.Event.EventKey)
	msg.Header.Set(natssink.HeaderEventKey, old.Event.EventKey)
	msg.Data = old.Body
	if _, err := js.PublishMsg(context.Background(), msg); err != nil {
		t.Fatal(err)
	}

	old.Attempt = 2
	if err := sendSync(t, s, old); err != nil {
		t.Fatalf("re-send of evt-42 after the upgrade: %v", err)
	}
	if s.Duplicates() != 1 {
		t.Fatalf("Duplicates() = %d: the re-send of evt-42 was stored again", s.Duplicates())
	}
	for attempt := 1; attempt <= 2; attempt++ {
		d := delivery(100)
		d.Attempt = attempt
		if err := sendSync(t, s, d); err != nil {
			t.Fatalf("evt-100, attempt %d: %v", attempt, err)
		}
	}
	msgs := stored(t, js, testStream)
	var ids []string
	for _, m := range msgs {
		ids = append(ids, m.Headers().Get(jetstream.MsgIDHeader))
	}
	if want := []string{"evt-42", scopedID("evt-100")}; !slices.Equal(ids, want) {
		t.Fatalf("the stream holds %q, want %q (each event once)", ids, want)
	}
}
