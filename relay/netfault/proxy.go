// Package netfault makes network faults that are not crashes, for tests and
// the chaos tool: a TCP proxy that black-holes, delays, throttles, closes or
// resets the connections through it (Proxy), and Linux network namespaces
// joined by veth pairs whose links can be taken down or black-holed
// (Namespace, Link).
//
// It is test tooling: the relay daemon never imports it. It lives under
// relay/ (beside relay/sinktest) rather than under cmd/internal because the
// sinks' and sources' own tests use it, and Go's internal rule would hide
// cmd/internal from them. See docs/jetstream-cluster.md for what the NATS
// tests built on it show.
//
// # Why a hand-written proxy
//
// Shopify's toxiproxy (v2.5.0 is the newest the module proxy serves) was
// considered. Its timeout toxic, its black-hole, drops the bytes it holds,
// so a link that heals carries a corrupt stream, where a real partition
// that heals delivers them late (TCP retransmits); it cannot black-hole
// the open connections while new ones pass, which is how a dead NAT entry
// or a failed-over peer looks; and as a library it needs its API server,
// metrics container and JSON toxic definitions. What the tests need is a
// few hundred lines.
package netfault

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"
)

// Direction is one half of a proxied connection.
type Direction int

const (
	// Upstream is the client-to-server half.
	Upstream Direction = iota
	// Downstream is the server-to-client half.
	Downstream
)

func (d Direction) String() string {
	if d == Upstream {
		return "upstream"
	}
	return "downstream"
}

// NewConns says what BlackHole does to connections accepted while it lasts.
type NewConns int

const (
	// NewConnsPass forwards new connections normally: only the open ones
	// are black-holed, as when a NAT entry or a failed-over peer dies and
	// a reconnect would work.
	NewConnsPass NewConns = iota
	// NewConnsBlackHole black-holes new connections too: they are accepted
	// (the kernel completes the handshake with the proxy) but nothing is
	// forwarded either way until Pass.
	NewConnsBlackHole
)

// chunkSize is the most bytes one read forwards.
const chunkSize = 32 << 10

// queueChunks bounds the chunks held between a half's reader and writer, so
// a delayed or throttled half pushes back on its sender as a slow link does.
const queueChunks = 64

// Proxy forwards TCP connections from a loopback port to an upstream
// address, with faults that can be switched at any time. Its methods are
// safe for concurrent use.
type Proxy struct {
	listener net.Listener
	upstream string

	mu        sync.Mutex
	cond      *sync.Cond // broadcast on every change of the fields below
	closed    bool
	holeNew   bool // new connections start black-holed
	refuse    bool // new connections are closed at once
	latency   [2]time.Duration
	bandwidth [2]int // bytes per second; 0 = unlimited
	conns     map[*conn]struct{}
	accepted  int
	// holeMatch black-holes a new connection as soon as it selects it
	// (BlackHoleConns with NewConnsBlackHole).
	holeMatch  func(ConnInfo) bool
	wg         sync.WaitGroup
	acceptDone chan struct{}
}

// conn is one proxied connection: the client's socket and the upstream one.
type conn struct {
	p              *Proxy
	client, server net.Conn
	seq            int    // accept order, from 1
	head           []byte // guarded by p.mu: the client's first HeadBytes
	holed          bool   // guarded by p.mu
	dead           bool   // guarded by p.mu: closed, stop waiting
	once           sync.Once
}

// Listen starts a proxy on 127.0.0.1 (a free port) forwarding to upstream
// (host:port), in pass mode. The caller must Close it.
func Listen(upstream string) (*Proxy, error) {
	return ListenOn("127.0.0.1:0", upstream)
}

// ListenOn is Listen on a chosen address, such as a fixed port a client
// must find again after the proxy is replaced.
func ListenOn(addr, upstream string) (*Proxy, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("netfault: proxy for %s: %w", upstream, err)
	}
	p := &Proxy{listener: l, upstream: upstream, conns: map[*conn]struct{}{}, acceptDone: make(chan struct{})}
	p.cond = sync.NewCond(&p.mu)
	go p.accept()
	return p, nil
}

// Addr returns the proxy's listening address, host:port.
func (p *Proxy) Addr() string { return p.listener.Addr().String() }

// Upstream returns the address the proxy forwards to.
func (p *Proxy) Upstream() string { return p.upstream }

// Conns returns how many proxied connections are open.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Accepted returns how many connections the proxy has accepted in all.
func (p *Proxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted
}

// BlackHole stops forwarding on every open connection, both ways: their
// sockets stay open, so the peers' writes succeed until the kernel buffers
// fill, and their reads wait. Nothing that is read after BlackHole returns
// is forwarded (a chunk already being written completes). newConns says
// whether connections accepted from now on pass or are black-holed too.
// Pass undoes it: the held bytes are then delivered late, as TCP
// retransmission would deliver them after a partition heals.
func (p *Proxy) BlackHole(newConns NewConns) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.holed = true
	}
	p.holeNew = newConns == NewConnsBlackHole
	p.cond.Broadcast()
}

// HeadBytes is how much of what a client sends first the proxy keeps for
// ConnInfo.Head.
const HeadBytes = 4 << 10

// ConnInfo describes one proxied connection to a selector (BlackHoleConns)
// and in ConnInfos.
type ConnInfo struct {
	// Seq is the connection's place in the proxy's accept order, from 1.
	Seq int
	// Head is the first bytes the client sent (up to HeadBytes, as far as
	// they have arrived): enough for a protocol's opening message, such as
	// a PostgreSQL StartupMessage (see PostgresStartup).
	Head []byte
	// BlackHoled reports whether the connection is black-holed.
	BlackHoled bool
}

// BlackHoleConns is BlackHole for the connections match selects: the open
// ones it selects now and, with NewConnsBlackHole, every connection accepted
// later as soon as it selects it — match is asked again each time such a
// connection's client has sent more of its first HeadBytes, and a
// connection it selects is black-holed before the bytes that made it match
// are forwarded. The other connections pass. match runs with the proxy's
// lock held: it must not call the proxy. Pass undoes it.
//
// A test black-holes one kind of connection among a client's several this
// way, e.g. a PostgreSQL client's replication connection:
//
//	p.BlackHoleConns(func(c netfault.ConnInfo) bool {
//		params, ok := netfault.PostgresStartup(c.Head)
//		return ok && params["replication"] == "database"
//	}, netfault.NewConnsPass)
func (p *Proxy) BlackHoleConns(match func(ConnInfo) bool, newConns NewConns) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		if !c.holed && match(c.info()) {
			c.holed = true
		}
	}
	p.holeMatch = nil
	if newConns == NewConnsBlackHole {
		p.holeMatch = match
	}
	p.cond.Broadcast()
}

// ConnInfos describes the open connections, in accept order.
func (p *Proxy) ConnInfos() []ConnInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]ConnInfo, 0, len(p.conns))
	for c := range p.conns {
		out = append(out, c.info())
	}
	slices.SortFunc(out, func(a, b ConnInfo) int { return a.Seq - b.Seq })
	return out
}

// info describes c; p.mu must be held.
func (c *conn) info() ConnInfo {
	return ConnInfo{Seq: c.seq, Head: slices.Clip(c.head), BlackHoled: c.holed}
}

// Pass forwards again on every connection and accepts new ones normally;
// latency and bandwidth settings stay.
func (p *Proxy) Pass() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.holed = false
	}
	p.holeNew = false
	p.holeMatch = nil
	p.refuse = false
	p.cond.Broadcast()
}

// SetLatency delays every chunk forwarded in direction d by latency (0 for
// none), counted from when the proxy read it. A round trip through the
// proxy takes the sum of both directions' latency.
func (p *Proxy) SetLatency(d Direction, latency time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.latency[d] = latency
	p.cond.Broadcast()
}

// SetBandwidth limits direction d of each connection to bytesPerSecond (0
// for unlimited).
func (p *Proxy) SetBandwidth(d Direction, bytesPerSecond int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.bandwidth[d] = bytesPerSecond
	p.cond.Broadcast()
}

// Refuse makes the proxy close new connections as soon as it accepts them
// (the client sees its connection closed before any byte), until Pass.
func (p *Proxy) Refuse() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse = true
}

// CloseConns closes every open connection with a FIN on both sides, as a
// peer that exits cleanly does. New connections are still accepted.
func (p *Proxy) CloseConns() { p.dropConns(false) }

// ResetConns closes every open connection with a TCP RST on both sides, as a
// peer that crashes or a firewall that rejects does. New connections are
// still accepted.
func (p *Proxy) ResetConns() { p.dropConns(true) }

func (p *Proxy) dropConns(reset bool) {
	p.mu.Lock()
	conns := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		c.close(reset)
	}
}

// Close stops accepting, closes every connection (with a RST) and waits for
// the proxy's goroutines to end. Calling it again does nothing.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.cond.Broadcast()
	p.mu.Unlock()
	err := p.listener.Close()
	<-p.acceptDone
	p.dropConns(true)
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer close(p.acceptDone)
	for {
		client, err := p.listener.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // EMFILE and the like
			continue
		}
		p.mu.Lock()
		refuse, closed := p.refuse, p.closed
		p.mu.Unlock()
		if refuse || closed {
			_ = client.Close()
			continue
		}
		p.wg.Add(1)
		go p.serve(client)
	}
}

// serve dials upstream for client and forwards both halves until both end.
func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	server, err := net.DialTimeout("tcp", p.upstream, 10*time.Second)
	if err != nil {
		// The upstream refuses: so does the proxy, as far as it can.
		resetClose(client)
		return
	}
	c := &conn{p: p, client: client, server: server}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.close(true)
		return
	}
	c.holed = p.holeNew
	p.conns[c] = struct{}{}
	p.accepted++
	c.seq = p.accepted
	p.mu.Unlock()

	var halves sync.WaitGroup
	halves.Add(2)
	go func() { defer halves.Done(); p.forward(c, Upstream, client, server) }()
	go func() { defer halves.Done(); p.forward(c, Downstream, server, client) }()
	halves.Wait()
	c.close(false)
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

type chunk struct {
	data []byte
	read time.Time
	eof  bool
	err  error
}

// forward copies one half of c from src to dst, honouring the black-hole,
// latency and bandwidth settings. When src ends, it half-closes dst; when
// either side fails, it closes both.
func (p *Proxy) forward(c *conn, d Direction, src, dst net.Conn) {
	queue := make(chan chunk, queueChunks)
	go func() {
		defer close(queue)
		for {
			if !p.waitOpen(c) {
				return
			}
			buf := make([]byte, p.readSize(d))
			n, err := src.Read(buf)
			if n > 0 {
				if d == Upstream {
					p.sawHead(c, buf[:n])
				}
				queue <- chunk{data: buf[:n], read: time.Now()}
			}
			if err != nil {
				queue <- chunk{eof: errors.Is(err, io.EOF), err: err, read: time.Now()}
				return
			}
		}
	}()
	defer func() {
		for range queue { // let the reader end
		}
	}()
	for ch := range queue {
		if !p.waitDue(c, d, ch.read) {
			c.close(true)
			return
		}
		if ch.err != nil {
			if ch.eof {
				if tc, ok := dst.(*net.TCPConn); ok {
					_ = tc.CloseWrite()
					return
				}
			}
			c.close(true)
			return
		}
		start := time.Now()
		if _, err := dst.Write(ch.data); err != nil {
			c.close(true)
			return
		}
		p.throttle(d, len(ch.data), start)
	}
}

// sawHead adds data, read from c's client, to c's head, and black-holes c
// when a selector of new connections now selects it: before data is
// forwarded, since the writer checks holed after taking it from the queue.
func (p *Proxy) sawHead(c *conn, data []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(c.head) >= HeadBytes {
		return
	}
	c.head = append(c.head, data[:min(len(data), HeadBytes-len(c.head))]...)
	if p.holeMatch != nil && !c.holed && p.holeMatch(c.info()) {
		c.holed = true
		p.cond.Broadcast()
	}
}

// waitOpen waits while c is black-holed; false when the proxy closed.
func (p *Proxy) waitOpen(c *conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c.holed && !p.closed && !c.dead {
		p.cond.Wait()
	}
	return !p.closed && !c.dead
}

// waitDue waits until a chunk read at read is due in direction d and c is
// not black-holed; false when the proxy closed.
func (p *Proxy) waitDue(c *conn, d Direction, read time.Time) bool {
	for {
		p.mu.Lock()
		for c.holed && !p.closed && !c.dead {
			p.cond.Wait()
		}
		closed, due := p.closed || c.dead, read.Add(p.latency[d])
		p.mu.Unlock()
		if closed {
			return false
		}
		wait := time.Until(due)
		if wait <= 0 {
			return true
		}
		// Sleep in short steps so a changed setting (a black-hole, less
		// latency) takes effect within a few milliseconds.
		time.Sleep(min(wait, 5*time.Millisecond))
	}
}

// readSize is how much one read takes in direction d: at most 50 ms worth
// of its bandwidth, so a slow link trickles rather than bursts.
func (p *Proxy) readSize(d Direction) int {
	p.mu.Lock()
	rate := p.bandwidth[d]
	p.mu.Unlock()
	if rate <= 0 {
		return chunkSize
	}
	return min(max(rate/20, 1), chunkSize)
}

// throttle sleeps so that n bytes written since start keep direction d
// within its bandwidth.
func (p *Proxy) throttle(d Direction, n int, start time.Time) {
	p.mu.Lock()
	rate := p.bandwidth[d]
	p.mu.Unlock()
	if rate <= 0 {
		return
	}
	want := time.Duration(float64(n) / float64(rate) * float64(time.Second))
	if rest := want - time.Since(start); rest > 0 {
		time.Sleep(rest)
	}
}

// close closes both sockets of c, with a RST when reset is set.
func (c *conn) close(reset bool) {
	c.once.Do(func() {
		c.p.mu.Lock()
		c.dead = true
		c.p.cond.Broadcast()
		c.p.mu.Unlock()
		if reset {
			resetClose(c.client)
			resetClose(c.server)
			return
		}
		_ = c.client.Close()
		_ = c.server.Close()
	})
}

// resetClose closes nc so that the peer gets a RST rather than a FIN.
func resetClose(nc net.Conn) {
	if tc, ok := nc.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = nc.Close()
}

// NewProxy starts a proxy to upstream for tb (see Listen) and closes it
// when tb ends.
func NewProxy(tb testing.TB, upstream string) *Proxy {
	tb.Helper()
	p, err := Listen(upstream)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := p.Close(); err != nil {
			tb.Errorf("netfault: close proxy: %v", err)
		}
	})
	return p
}

// ProxyURL starts a proxy for tb to the host:port of rawURL (postgres://,
// nats://, http://; a comma-separated list is not split) and returns it
// with rawURL pointing at the proxy instead: give that URL to the code
// under test and keep rawURL for the test's own checks, so only the code
// under test suffers the faults. Used with migrations/pgtest:
//
//	dbURL := pgtest.NewDatabase(t)
//	pg, relayURL := netfault.ProxyURL(t, dbURL)
//	pg.SetLatency(netfault.Upstream, 100*time.Millisecond)
func ProxyURL(tb testing.TB, rawURL string) (*Proxy, string) {
	tb.Helper()
	u, err := url.Parse(rawURL)
	if err != nil || u.Host == "" || u.Port() == "" {
		tb.Fatalf("netfault: ProxyURL needs a URL with a host and port")
	}
	p := NewProxy(tb, u.Host)
	u.Host = p.Addr()
	return p, u.String()
}
