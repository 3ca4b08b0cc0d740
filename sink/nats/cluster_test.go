package nats_test

import (
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// envClusterRate sets TestCluster_R3StreamUnderFaults's publish rate in
// events per second (default 200); envClusterAckTimeout its sink's ack
// timeout (default natssink.DefaultAckTimeout).
const (
	envClusterRate       = "OUTBOX_RELAY_TEST_CLUSTER_RATE"
	envClusterAckTimeout = "OUTBOX_RELAY_TEST_CLUSTER_ACK_TIMEOUT"
)

// A three-server JetStream cluster with an R3 stream, the sink given all
// three URLs and its default timeouts, and events published at a steady
// rate through Send, each failure re-sent with the same Nats-Msg-Id: kill
// the stream leader, then a follower, then cut the new leader off from its
// peers and clients. Every event ends in the stream exactly once. The
// recovery time of each fault (from the fault to the last failure it
// caused) is logged; docs/jetstream-cluster.md quotes them.
//
//	go test -race -count=1 -run TestCluster_R3StreamUnderFaults -v ./sink/nats/
func TestCluster_R3StreamUnderFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("a minute of faults; not with -short")
	}
	rate := 200
	if v := os.Getenv(envClusterRate); v != "" {
		var err error
		if rate, err = strconv.Atoi(v); err != nil || rate <= 0 {
			t.Fatalf("%s=%q: want a positive number", envClusterRate, v)
		}
	}
	ackTimeout := natssink.DefaultAckTimeout
	if v := os.Getenv(envClusterAckTimeout); v != "" {
		var err error
		if ackTimeout, err = time.ParseDuration(v); err != nil || ackTimeout <= 0 {
			t.Fatalf("%s=%q: want a positive duration", envClusterAckTimeout, v)
		}
	}
	c := natstest.StartCluster(t, 3)
	js := mustClusterJetStream(t, c)
	c.CreateStream(t, js, jetstream.StreamConfig{
		Name:       testStream,
		Subjects:   []string{"outbox.>"},
		Storage:    jetstream.FileStorage,
		Replicas:   3,
		Duplicates: 2 * time.Minute,
	})
	c.WaitStreamCurrent(t, js, testStream, 30*time.Second)

	s := MustNew(t, natssink.Config{
		Name:       "nats",
		URL:        c.URLs(),
		Subject:    natssink.DefaultSubject,
		Deployment: testDeployment,
		Stream:     natssink.StreamConfig{Name: testStream, DuplicateWindow: 2 * time.Minute},
		AckTimeout: ackTimeout,
		Options:    []nats.Option{nats.ReconnectWait(100 * time.Millisecond)},
	})

	const maxEvents = 100_000
	r := newResender(t, s, maxEvents, 100*time.Millisecond)
	var fed atomic.Int64
	stopFeed := make(chan struct{})
	feedDone := make(chan struct{})
	go func() {
		defer close(feedDone)
		tick := time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
		for i := 0; i < maxEvents; i++ {
			select {
			case <-stopFeed:
				return
			case <-tick.C:
				r.Add(i)
				fed.Add(1)
			}
		}
	}()

	// A sampler notes the last moment more than half a second's worth of
	// events was waiting: a stall shows as a backlog even before its
	// publishes time out.
	var lastBacklog atomic.Int64 // unix nanoseconds
	go func() {
		for {
			select {
			case <-feedDone:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if fed.Load()-r.delivered.Load() > int64(rate/2) {
				lastBacklog.Store(time.Now().UnixNano())
			}
		}
	}()
	// settled waits until the fault at faultAt has stopped causing
	// failures and backlog, for longer than the sink's ack timeout, and
	// returns the time from the fault to its last failure or backlog.
	settled := func(name string, faultAt time.Time) time.Duration {
		t.Helper()
		quietFor := ackTimeout + 2*time.Second
		deadline := time.Now().Add(2 * time.Minute)
		for {
			time.Sleep(200 * time.Millisecond)
			last := faultAt.Add(r.Recovery(faultAt))
			if b := time.Unix(0, lastBacklog.Load()); b.After(last) {
				last = b
			}
			if time.Since(last) > quietFor {
				rec := last.Sub(faultAt)
				t.Logf("%s: recovered %s after the fault (outcomes so far: %s)", name, rec.Round(10*time.Millisecond), r.Summary())
				return rec
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: still failing or backlogged 2 minutes after the fault: %s", name, r.Summary())
			}
		}
	}

	time.Sleep(3 * time.Second) // load before the first fault

	leader := c.WaitStreamLeader(t, testStream, -1, 10*time.Second)
	t.Logf("killing stream leader %s", c.Name(leader))
	at := time.Now()
	c.Shutdown(leader)
	next := c.WaitStreamLeader(t, testStream, leader, 30*time.Second)
	t.Logf("new stream leader %s elected %s after the kill", c.Name(next), time.Since(at).Round(10*time.Millisecond))
	leaderRecovery := settled("leader killed", at)
	c.Restart(t, leader)
	c.WaitStreamCurrent(t, js, testStream, 60*time.Second)

	leader = c.WaitStreamLeader(t, testStream, -1, 10*time.Second)
	follower := (leader + 1) % c.Size()
	t.Logf("killing follower %s (leader %s)", c.Name(follower), c.Name(leader))
	at = time.Now()
	c.Shutdown(follower)
	followerRecovery := settled("follower killed", at)
	c.Restart(t, follower)
	c.WaitStreamCurrent(t, js, testStream, 60*time.Second)

	leader = c.WaitStreamLeader(t, testStream, -1, 10*time.Second)
	t.Logf("cutting stream leader %s off from its peers and clients", c.Name(leader))
	at = time.Now()
	c.Partition(leader)
	partitionRecovery := settled("leader partitioned", at)
	c.Heal(leader)
	at = time.Now()
	// Not required for the delivery guarantee (the stream is read from
	// its leader), but worth knowing: how long the cut-off replica takes
	// to catch up.
	if err := c.StreamCurrent(js, testStream, 60*time.Second); err != nil {
		t.Logf("NOTE after healing the partition: %v", err)
		// Read the stream from its one leader, not a stale one.
		c.WaitStreamLeader(t, testStream, -1, time.Minute)
	} else {
		t.Logf("after healing the partition every replica was current within %s", time.Since(at).Round(10*time.Millisecond))
	}

	close(stopFeed)
	<-feedDone
	n := int(fed.Load())
	// Wait for the last events fed; the resender counts against n.
	waitFor(t, 2*time.Minute, func() bool { return r.delivered.Load() >= int64(n) })
	verifyExactlyOnce(t, js, testStream, n)
	t.Logf("ack timeout %s, %d events at %d/s: recovery after leader kill %s, follower kill %s, leader partition %s; %d re-sends, %d acknowledged as duplicates (stored once); outcomes %s",
		ackTimeout, n, rate, leaderRecovery.Round(10*time.Millisecond), followerRecovery.Round(10*time.Millisecond),
		partitionRecovery.Round(10*time.Millisecond), r.resends.Load(), s.Duplicates(), r.Summary())
}

// mustClusterJetStream connects a test client to every server of c.
func mustClusterJetStream(tb testing.TB, c *natstest.Cluster) jetstream.JetStream {
	tb.Helper()
	nc, err := nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
		nats.PingInterval(time.Second), nats.MaxPingsOutstanding(2))
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatal(err)
	}
	return js
}
