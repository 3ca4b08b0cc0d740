package natstest_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

func TestCluster_StreamSurvivesLeaderLossAndPartition(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	nc, err := nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "R3", Subjects: []string{"r3.>"}, Replicas: 3, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	c.WaitStreamCurrent(t, js, "R3", 30*time.Second)
	publish := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); ; {
			_, err := js.Publish(ctx, "r3.x", []byte("m"), jetstream.WithMsgID("m"+time.Now().String()))
			if err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("publish %d: %v", n, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	publish(1)

	leader := c.WaitStreamLeader(t, "R3", -1, 10*time.Second)
	c.Shutdown(leader)
	next := c.WaitStreamLeader(t, "R3", leader, 30*time.Second)
	publish(2)
	c.Restart(t, leader)
	c.WaitStreamCurrent(t, js, "R3", 30*time.Second)

	// Cut one server off: its peers drop their routes to it, it drops
	// its own, and no connection goes around the proxies.
	c.Partition(next)
	deadline := time.Now().Add(15 * time.Second)
	for c.Server(next).NumRoutes() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s still has %d routes 15s into its partition", c.Name(next), c.Server(next).NumRoutes())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if c.StreamLeader("R3") == next {
		// It may believe it leads until its term ends; the majority
		// elects another.
		t.Logf("%s still claims the lead while cut off", c.Name(next))
	}
	publish(3)
	c.Heal(next)
	c.WaitStreamCurrent(t, js, "R3", 30*time.Second)
	st, err := js.Stream(ctx, "R3")
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 3 {
		t.Fatalf("stream holds %d messages, want 3", info.State.Msgs)
	}
}
