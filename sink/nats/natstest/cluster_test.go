package natstest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

func TestCluster_StreamSurvivesLeaderLossAndPartition(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	// Pings notice a connection to a cut-off server (nats.go's default
	// takes minutes).
	nc, err := nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
		nats.PingInterval(time.Second), nats.MaxPingsOutstanding(2))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c.CreateStream(t, js, jetstream.StreamConfig{Name: "R3", Subjects: []string{"r3.>"}, Replicas: 3, Storage: jetstream.FileStorage})
	c.WaitStreamCurrent(t, js, "R3", 30*time.Second)
	publish := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); ; {
			pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			ack, err := js.Publish(pctx, "r3.x", []byte("m"), jetstream.WithMsgID(fmt.Sprintf("m%d", n)))
			cancel()
			if err == nil {
				t.Logf("publish %d: seq %d dup %v via %s (leader %d)", n, ack.Sequence, ack.Duplicate, nc.ConnectedServerName(), c.StreamLeader("R3"))
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
	if c.Server(next).JetStreamIsStreamLeader(server.DEFAULT_GLOBAL_ACCOUNT, "R3") {
		// It may believe it leads until it hears of the new term.
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
		for i := range c.Size() {
			jsz, _ := c.Server(i).Jsz(&server.JSzOptions{Streams: true, Accounts: true})
			for _, a := range jsz.AccountDetails {
				for _, sd := range a.Streams {
					t.Logf("%s: stream %s msgs %d last %d leader %v", c.Name(i), sd.Name, sd.State.Msgs, sd.State.LastSeq, sd.Cluster)
				}
			}
		}
		t.Fatalf("stream holds %d messages, want 3", info.State.Msgs)
	}
}
