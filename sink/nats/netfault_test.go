package nats_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// proxiedConfig is testConfig with the sink reaching srv through a fault
// proxy; the test's own client (MustJetStream) still connects directly.
func proxiedConfig(t *testing.T, srv *natstest.Server) (natssink.Config, *netfault.Proxy) {
	t.Helper()
	proxy, url := netfault.ProxyURL(t, srv.URL())
	cfg := testConfig(srv)
	cfg.URL = url
	return cfg, proxy
}

// A server that answers slowly: PubAcks arrive after the ack timeout, so
// each publish is Unknown though it was stored; the re-send carries the same
// Nats-Msg-Id and is acknowledged as a duplicate once acks are fast again.
// Nothing is lost or stored twice.
func TestSlowServer_LateAcksAreUnknownAndResendsAreDuplicates(t *testing.T) {
	srv := natstest.Start(t)
	cfg, proxy := proxiedConfig(t, srv)
	cfg.AckTimeout = 300 * time.Millisecond
	s := MustNew(t, cfg)
	js := MustJetStream(t, srv)

	proxy.SetLatency(netfault.Downstream, time.Second)
	const n = 50
	r := newResender(t, s, n, 100*time.Millisecond)
	for i := range n {
		r.Add(i)
	}
	time.Sleep(2 * time.Second)
	proxy.SetLatency(netfault.Downstream, 0)
	r.Wait(t, 30*time.Second)

	got := r.Outcomes()
	for c := range got {
		if c != "delivered" && c != relay.Unknown.String() {
			t.Fatalf("outcomes %s: a %s failure from a slow server, want only unknown", r.Summary(), c)
		}
	}
	if got[relay.Unknown.String()] == 0 || s.Duplicates() == 0 {
		t.Fatalf("outcomes %s, %d duplicates: want late acks to be unknown and their re-sends duplicates", r.Summary(), s.Duplicates())
	}
	verifyExactlyOnce(t, js, testStream, n)
	t.Logf("outcomes %s; %d re-sends acknowledged as duplicates", r.Summary(), s.Duplicates())
}

// deadConnNoticedWithin is how soon the sink's own settings (docs/jetstream-cluster.md)
// must notice a connection that went silent: PingInterval 5 s with 2 pings
// outstanding declares it stale within 15 s, plus a reconnect.
const deadConnNoticedWithin = 20 * time.Second

// The open connection black-holed (nothing forwarded either way, the socket
// still open), while a new one would work: the sink's ping settings notice
// the dead connection, publishes waiting on it end as Unknown, the client
// reconnects and the re-sends are stored. When the black hole heals, the
// publishes it held reach the server late and are dropped as duplicates.
// This runs with the sink's default ping and ack timeout settings.
func TestBlackHoledConnection_NoticedAndResentWithTheSameMsgID(t *testing.T) {
	srv := natstest.Start(t)
	cfg, proxy := proxiedConfig(t, srv)
	s := MustNew(t, cfg)
	js := MustJetStream(t, srv)

	const before, n = 20, 60
	r := newResender(t, s, n, 200*time.Millisecond)
	for i := range before {
		r.Add(i)
	}
	waitFor(t, 10*time.Second, func() bool { return r.delivered.Load() == before })

	proxy.BlackHole(netfault.NewConnsPass)
	faultAt := time.Now()
	for i := before; i < n; i++ {
		r.Add(i)
	}
	r.Wait(t, 3*deadConnNoticedWithin)
	recovery := r.Recovery(faultAt)
	t.Logf("black-holed connection: last failure %s after the fault; outcomes %s", recovery.Round(time.Millisecond), r.Summary())
	if recovery > deadConnNoticedWithin {
		t.Errorf("the sink took %s to get past a dead connection, want under %s", recovery.Round(time.Millisecond), deadConnNoticedWithin)
	}
	for c := range r.Outcomes() {
		if c != "delivered" && c != relay.Unknown.String() && c != relay.SinkDown.String() {
			t.Errorf("outcomes %s: a %s failure on a dead connection, want unknown or sink-down", r.Summary(), c)
		}
	}
	if r.Outcomes()[relay.Unknown.String()] == 0 {
		t.Errorf("outcomes %s: publishes written to the dead connection must be unknown", r.Summary())
	}

	// Heal: the held publishes arrive late on the old connection; the
	// server drops them as duplicates of the re-sends.
	proxy.Pass()
	time.Sleep(500 * time.Millisecond)
	verifyExactlyOnce(t, js, testStream, n)
}

// The server unreachable for new connections too (a connect completes at
// the proxy, but no INFO ever comes): Sends fail as Unknown or SinkDown,
// never Transient or Permanent, until the server is reachable again; then
// every event is stored once.
func TestBlackHoledServer_SinkDownUntilReachable(t *testing.T) {
	srv := natstest.Start(t)
	cfg, proxy := proxiedConfig(t, srv)
	cfg.AckTimeout = time.Second
	// Fast pings: this test is about the classification, not detection.
	cfg.Options = append(cfg.Options, nats.PingInterval(200*time.Millisecond), nats.MaxPingsOutstanding(2))
	s := MustNew(t, cfg)
	js := MustJetStream(t, srv)

	const n = 100
	r := newResender(t, s, n, 100*time.Millisecond)
	proxy.BlackHole(netfault.NewConnsBlackHole)
	for i := range n {
		r.Add(i)
	}
	waitFor(t, 20*time.Second, func() bool { return r.Outcomes()[relay.SinkDown.String()] > 0 })
	if d := r.delivered.Load(); d != 0 {
		t.Fatalf("%d events delivered through a black hole", d)
	}
	proxy.Pass()
	r.Wait(t, 30*time.Second)
	for c := range r.Outcomes() {
		if c != "delivered" && c != relay.Unknown.String() && c != relay.SinkDown.String() {
			t.Fatalf("outcomes %s: a %s failure while the server was unreachable", r.Summary(), c)
		}
	}
	verifyExactlyOnce(t, js, testStream, n)
	t.Logf("outcomes %s", r.Summary())
}

// waitFor polls cond every 10 ms until it holds, failing tb at timeout.
func waitFor(tb testing.TB, timeout time.Duration, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("condition not met within %s", timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
