package nats_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// TestServerDownAtStart: a server that cannot be reached at start makes a
// sink that is down, not an error: New returns it, each Send fails at once
// as SinkDown (the engine's circuit opens and its events wait without using
// an attempt), and Down says why. The sink keeps connecting; once the
// server is up it checks (here: creates) the stream as at start, and
// delivers.
func TestServerDownAtStart(t *testing.T) {
	srv := natstest.Start(t)
	srv.Shutdown()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := natssink.New(ctx, testConfig(srv))
	if err != nil {
		t.Fatalf("New with the server down: %v, want a sink that is down", err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })

	if err := sendSync(t, s, delivery(1)); class(err) != relay.SinkDown {
		t.Fatalf("send while the server is down: %v, want sink-down", err)
	}
	if err := s.Down(); err == nil || !strings.Contains(err.Error(), "RECONNECTING") {
		t.Fatalf("Down() = %v, want why: the connection is not up", err)
	}

	srv.Restart(t)
	waitUp(t, s)
	if err := sendSync(t, s, delivery(2)); err != nil {
		t.Fatalf("send once the server is up: %v", err)
	}
	msgs := stored(t, MustJetStream(t, srv), testStream)
	if len(msgs) != 1 || msgs[0].Headers().Get(jetstream.MsgIDHeader) != scopedID("evt-2") {
		t.Fatalf("the stream holds %d messages, want evt-2 alone", len(msgs))
	}
}

// TestStreamOfTheWrongShapeOnceReachable: the server was down at start and
// comes up with a stream that does not capture the sink's subjects. That is a sink-level failure, as every event would meet it: the
// sink stays down, Down names the stream and the fix, and once the stream is
// fixed the next check passes and the sink delivers.
func TestStreamOfTheWrongShapeOnceReachable(t *testing.T) {
	srv := natstest.Start(t)
	srv.Shutdown()
	cfg := testConfig(srv)
	cfg.Stream.Create = false
	cfg.URL = strings.Replace(srv.URL(), "nats://", "nats://relay:secret@", 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := natssink.New(ctx, cfg)
	if err != nil {
		t.Fatalf("New with the server down: %v", err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	if err := s.Down(); err == nil || strings.Contains(err.Error(), "secret") {
		t.Fatalf("Down() = %v, want why, without the password", err)
	}

	srv.Restart(t)
	js := MustJetStream(t, srv)
	sc := jetstream.StreamConfig{Name: testStream, Subjects: []string{"elsewhere.>"}, Duplicates: time.Minute}
	if _, err := js.CreateStream(context.Background(), sc); err != nil {
		t.Fatal(err)
	}
	eventually(t, 15*time.Second, "the sink to report the stream's subjects", func() bool {
		err := s.Down()
		return err != nil && strings.Contains(err.Error(), "does not capture the sink's subjects")
	})
	if err := sendSync(t, s, delivery(1)); class(err) != relay.SinkDown || !strings.Contains(err.Error(), "nats stream edit") {
		t.Fatalf("send with the stream of the wrong shape: %v, want sink-down naming the fix", err)
	}

	sc.Subjects = []string{"outbox.>"}
	if _, err := js.UpdateStream(context.Background(), sc); err != nil {
		t.Fatal(err)
	}
	waitUp(t, s)
	if err := sendSync(t, s, delivery(2)); err != nil {
		t.Fatalf("send once the stream is fixed: %v", err)
	}
}

// waitUp waits until s says it is up.
func waitUp(t *testing.T, s *natssink.Sink) {
	t.Helper()
	eventually(t, 45*time.Second, "the sink to be up", func() bool { return s.Down() == nil })
}

// eventually polls cond every 50 ms until it holds, failing t after
// timeout, naming what it waited for.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
