package natstest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// Cluster is a JetStream cluster of embedded servers on 127.0.0.1 whose
// every connection, client or route, passes through a netfault.Proxy, so a
// test can stop, restart or cut off each server. Its methods are safe for
// concurrent use.
//
// Each server's cluster port is reached through one proxy per peer (the
// route from server a to server b goes through proxy a→b, whichever side
// dialled), and its client port through one client proxy; URLs lists the
// client proxies. Servers advertise neither their client URLs to clients
// nor their real cluster address to peers, so no connection can go around
// the proxies. Servers ping clients and routes every second and give up
// after three unanswered pings, so a cut-off peer is noticed in about 3-4 s.
type Cluster struct {
	tb      testing.TB
	name    string
	members []*member
	// routeProxy[a][b] carries the routes between a and b that a dialled.
	routeProxy [][]*netfault.Proxy
	// clientProxy[i] is how clients reach server i.
	clientProxy []*netfault.Proxy
	syncAlways  bool

	mu sync.Mutex
}

type member struct {
	name        string
	clientPort  int
	clusterPort int
	storeDir    string
	srv         *server.Server // nil while shut down
}

// ClusterOption configures StartCluster.
type ClusterOption func(*Cluster)

// ClusterSyncAlways makes every server fsync each write before
// acknowledging it (sync_interval: always).
func ClusterSyncAlways() ClusterOption {
	return func(c *Cluster) { c.syncAlways = true }
}

// clusterPing is the servers' ping interval for clients and routes.
const clusterPing = time.Second

// StartCluster starts n servers (n ≥ 3 for a JetStream cluster) named n1 …,
// waits until they have elected a JetStream meta leader, and shuts them down
// when tb ends. It fails tb if the cluster does not form within a minute.
func StartCluster(tb testing.TB, n int, opts ...ClusterOption) *Cluster {
	tb.Helper()
	c := &Cluster{tb: tb, name: "natstest"}
	for _, opt := range opts {
		opt(c)
	}
	for i := range n {
		m := &member{
			name:        "n" + strconv.Itoa(i+1),
			clientPort:  freePort(tb),
			clusterPort: freePort(tb),
			storeDir:    tb.TempDir(),
		}
		c.members = append(c.members, m)
	}
	c.routeProxy = make([][]*netfault.Proxy, n)
	for a := range n {
		c.routeProxy[a] = make([]*netfault.Proxy, n)
		for b := range n {
			if a != b {
				c.routeProxy[a][b] = netfault.NewProxy(tb, addr(c.members[b].clusterPort))
			}
		}
		c.clientProxy = append(c.clientProxy, netfault.NewProxy(tb, addr(c.members[a].clientPort)))
	}
	// Registered after the proxies' and TempDir's cleanups, so it runs
	// before them.
	tb.Cleanup(c.shutdownAll)

	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.start(i)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			tb.Fatalf("natstest: cluster: %v", err)
		}
	}
	c.WaitJetStream(tb, time.Minute)
	return c
}

func addr(port int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) }

func freePort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("natstest: pick a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func (c *Cluster) options(i int) *server.Options {
	m := c.members[i]
	var routes []*url.URL
	for b := range c.members {
		if b != i {
			routes = append(routes, &url.URL{Scheme: "nats-route", Host: c.routeProxy[i][b].Addr()})
		}
	}
	return &server.Options{
		ServerName: m.name,
		Host:       "127.0.0.1",
		Port:       m.clientPort,
		JetStream:  true,
		StoreDir:   m.storeDir,
		NoLog:      true,
		NoSigs:     true,
		SyncAlways: c.syncAlways,

		PingInterval: clusterPing,
		MaxPingsOut:  2,
		Cluster: server.ClusterOpts{
			Name: c.name,
			Host: "127.0.0.1",
			Port: m.clusterPort,
			// Clients know the servers only by the client proxies.
			NoAdvertise: true,
			// Peers learn of each other only through the configured
			// routes: an advertised address nobody listens on makes
			// gossip useless for going around the proxies.
			Advertise:    "127.0.0.1:1",
			PingInterval: clusterPing,
			MaxPingsOut:  2,
		},
		Routes: routes,
	}
}

// start starts server i once its ports are free, and waits until it
// accepts connections (startServer).
func (c *Cluster) start(i int) error {
	m := c.members[i]
	if err := waitPortsFree(m.clientPort, m.clusterPort); err != nil {
		return fmt.Errorf("start %s: %w", m.name, err)
	}
	srv, err := startServer(c.options(i))
	if err != nil {
		return fmt.Errorf("start %s: %w", m.name, err)
	}
	c.mu.Lock()
	m.srv = srv
	c.mu.Unlock()
	return nil
}

// Size returns the number of servers.
func (c *Cluster) Size() int { return len(c.members) }

// Name returns server i's name (n1, n2, …).
func (c *Cluster) Name(i int) string { return c.members[i].name }

// URLs returns the client URLs of every server, comma-separated, as a
// client configured with the whole cluster gets them.
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.clientProxy))
	for i, p := range c.clientProxy {
		urls[i] = "nats://" + p.Addr()
	}
	return strings.Join(urls, ",")
}

// URL returns server i's client URL (through its client proxy).
func (c *Cluster) URL(i int) string { return "nats://" + c.clientProxy[i].Addr() }

// Server returns server i, or nil while it is shut down.
func (c *Cluster) Server(i int) *server.Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.members[i].srv
}

// Shutdown stops server i, as a crash that loses no fsynced data would:
// its connections close and its store stays for Restart.
func (c *Cluster) Shutdown(i int) {
	c.mu.Lock()
	srv := c.members[i].srv
	c.members[i].srv = nil
	c.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

// Restart starts server i again on its ports with its store, after
// Shutdown. It fails tb if the server does not become ready.
func (c *Cluster) Restart(tb testing.TB, i int) {
	tb.Helper()
	c.Shutdown(i)
	if err := c.start(i); err != nil {
		tb.Fatalf("natstest: restart: %v", err)
	}
}

// Partition cuts server i off from its peers and its clients: every open
// connection to it stalls (nothing forwarded, sockets left open) and new
// ones are black-holed too. The server keeps running; its peers and
// clients notice only by their pings.
func (c *Cluster) Partition(i int) {
	for _, p := range c.proxiesOf(i) {
		p.BlackHole(netfault.NewConnsBlackHole)
	}
}

// Heal undoes Partition.
func (c *Cluster) Heal(i int) {
	for _, p := range c.proxiesOf(i) {
		p.Pass()
	}
}

// proxiesOf returns every proxy carrying a connection of server i.
func (c *Cluster) proxiesOf(i int) []*netfault.Proxy {
	ps := []*netfault.Proxy{c.clientProxy[i]}
	for b := range c.members {
		if b != i {
			ps = append(ps, c.routeProxy[i][b], c.routeProxy[b][i])
		}
	}
	return ps
}

// StreamLeader returns the index of the server leading stream in the
// global account, or -1 when none does (an election in progress) or more
// than one claims to (a leader cut off from its peers, or just back and
// not yet told of the new term, still claims the lead and answers stream
// info requests with its stale state).
func (c *Cluster) StreamLeader(stream string) int {
	leader := -1
	for i := range c.members {
		if srv := c.Server(i); srv != nil && srv.JetStreamIsStreamLeader(server.DEFAULT_GLOBAL_ACCOUNT, stream) {
			if leader >= 0 {
				return -1
			}
			leader = i
		}
	}
	return leader
}

// WaitStreamLeader waits until a running server other than except (-1 for
// any) leads stream, and returns it; it fails tb at the timeout.
func (c *Cluster) WaitStreamLeader(tb testing.TB, stream string, except int, timeout time.Duration) int {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if i := c.StreamLeader(stream); i >= 0 && i != except {
			return i
		}
		if time.Now().After(deadline) {
			tb.Fatalf("natstest: no leader for stream %s within %s", stream, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// WaitJetStream waits until the running servers have a JetStream meta
// leader and answer account info, failing tb at the timeout.
func (c *Cluster) WaitJetStream(tb testing.TB, timeout time.Duration) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		last = c.accountInfo()
		if last == nil {
			if last = c.metaPeersCurrent(); last == nil {
				return
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	tb.Fatalf("natstest: cluster JetStream not ready within %s: %v", timeout, last)
}

// CreateStream creates a stream, retrying for up to 30 s while the meta
// leader has not yet placed every peer ("no suitable peers for
// placement"), as happens just after the cluster formed or a server came
// back; it fails tb otherwise.
func (c *Cluster) CreateStream(tb testing.TB, js jetstream.JetStream, cfg jetstream.StreamConfig) jetstream.Stream {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		st, err := js.CreateStream(ctx, cfg)
		cancel()
		if err == nil {
			return st
		}
		var apiErr *jetstream.APIError
		if !errors.As(err, &apiErr) || apiErr.ErrorCode != jsErrCodeNoSuitablePeers || time.Now().After(deadline) {
			tb.Fatalf("natstest: create stream %s: %v", cfg.Name, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// jsErrCodeNoSuitablePeers is nats-server's JSClusterNoPeersErrF ("no
// suitable peers for placement"), which nats.go does not name.
const jsErrCodeNoSuitablePeers jetstream.ErrorCode = 10005

// metaPeersCurrent reports, from the JetStream meta leader, whether every
// running server is a current peer: before that, creating a replicated
// stream can fail with "no suitable peers for placement".
func (c *Cluster) metaPeersCurrent() error {
	running := 0
	var leader *server.Server
	for i := range c.members {
		if srv := c.Server(i); srv != nil {
			running++
			if srv.JetStreamIsLeader() {
				leader = srv
			}
		}
	}
	if leader == nil {
		return errors.New("no meta leader")
	}
	jsz, err := leader.Jsz(&server.JSzOptions{})
	if err != nil {
		return err
	}
	if jsz.Meta == nil {
		return errors.New("no meta cluster information")
	}
	current := 0
	for _, p := range jsz.Meta.Replicas {
		if p.Current && !p.Offline {
			current++
		}
	}
	if current+1 < running {
		return fmt.Errorf("meta leader %s sees %d of %d other servers current", jsz.Meta.Leader, current, running-1)
	}
	return nil
}

func (c *Cluster) accountInfo() error {
	nc, err := nats.Connect(c.URLs(), nats.Timeout(time.Second))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	return err
}

// WaitStreamCurrent waits until stream has one leader, which every running
// server agrees on, and all its replicas are current (none lagging or
// offline), failing tb at the timeout.
func (c *Cluster) WaitStreamCurrent(tb testing.TB, js jetstream.JetStream, stream string, timeout time.Duration) {
	tb.Helper()
	if err := c.StreamCurrent(js, stream, timeout); err != nil {
		tb.Fatalf("natstest: %v", err)
	}
}

// StreamCurrent is WaitStreamCurrent returning an error that describes the
// replicas and routes at the timeout instead of failing a test.
func (c *Cluster) StreamCurrent(js jetstream.JetStream, stream string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		st, err := js.Stream(ctx, stream)
		var info *jetstream.StreamInfo
		if err == nil {
			info, err = st.Info(ctx)
		}
		cancel()
		switch {
		case err != nil:
			last = err.Error()
		case info.Cluster == nil || info.Cluster.Leader == "":
			last = "no leader"
		default:
			current := len(info.Cluster.Replicas) == info.Config.Replicas-1
			last = fmt.Sprintf("leader %s, %d replicas listed", info.Cluster.Leader, len(info.Cluster.Replicas))
			for _, r := range info.Cluster.Replicas {
				if !r.Current || r.Offline {
					current = false
					last = fmt.Sprintf("leader %s, replica %s current=%v offline=%v lag=%d", info.Cluster.Leader, r.Name, r.Current, r.Offline, r.Lag)
				}
			}
			if current && c.StreamLeader(stream) >= 0 && c.Name(c.StreamLeader(stream)) == info.Cluster.Leader {
				return nil
			}
			if current {
				last = fmt.Sprintf("leader %s, but %d servers claim the lead", info.Cluster.Leader, c.leaderClaims(stream))
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	var routes []string
	for i := range c.members {
		n := -1
		if srv := c.Server(i); srv != nil {
			n = srv.NumRoutes()
		}
		routes = append(routes, fmt.Sprintf("%s:%d", c.members[i].name, n))
	}
	return fmt.Errorf("stream %s not current on every server within %s: %s (routes %s)", stream, timeout, last, strings.Join(routes, " "))
}

func (c *Cluster) leaderClaims(stream string) int {
	n := 0
	for i := range c.members {
		if srv := c.Server(i); srv != nil && srv.JetStreamIsStreamLeader(server.DEFAULT_GLOBAL_ACCOUNT, stream) {
			n++
		}
	}
	return n
}

func (c *Cluster) shutdownAll() {
	var wg sync.WaitGroup
	for i := range c.members {
		wg.Add(1)
		go func() { defer wg.Done(); c.Shutdown(i) }()
	}
	wg.Wait()
}
