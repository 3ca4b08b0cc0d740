package netfault_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// echoServer echoes every connection and counts the bytes it received.
type echoServer struct {
	l        net.Listener
	received atomic.Int64
}

func startEcho(t *testing.T) *echoServer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &echoServer{l: l}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					s.received.Add(int64(n))
					if n > 0 {
						if _, err := c.Write(buf[:n]); err != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() { _ = l.Close() })
	return s
}

func newProxy(t *testing.T, upstream string) *netfault.Proxy {
	t.Helper()
	p, err := netfault.Listen(upstream)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("close proxy: %v", err)
		}
	})
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// roundTrip writes msg and reads the echo within timeout.
func roundTrip(c net.Conn, msg []byte, timeout time.Duration) error {
	if _, err := c.Write(msg); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	defer c.SetReadDeadline(time.Time{})
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if !bytes.Equal(got, msg) {
		return errors.New("echo differs")
	}
	return nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func TestProxy_Pass(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	c := dial(t, p.Addr())
	if err := roundTrip(c, []byte("hello"), 2*time.Second); err != nil {
		t.Fatalf("round trip through a passing proxy: %v", err)
	}
	if p.Conns() != 1 || p.Accepted() != 1 {
		t.Errorf("Conns, Accepted = %d, %d; want 1, 1", p.Conns(), p.Accepted())
	}
}

func TestProxy_BlackHoleOpenConnsNewConnsPass(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	old := dial(t, p.Addr())
	if err := roundTrip(old, []byte("before"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	before := echo.received.Load()

	p.BlackHole(netfault.NewConnsPass)
	// The write succeeds locally; nothing arrives; the read times out.
	if _, err := old.Write([]byte("into the hole")); err != nil {
		t.Fatalf("write on a black-holed connection failed locally: %v", err)
	}
	_ = old.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := old.Read(make([]byte, 64)); !isTimeout(err) {
		t.Fatalf("read on a black-holed connection = %d, %v; want a timeout", n, err)
	}
	if got := echo.received.Load(); got != before {
		t.Fatalf("upstream received %d bytes through the black hole", got-before)
	}

	// A new connection passes.
	fresh := dial(t, p.Addr())
	if err := roundTrip(fresh, []byte("new"), 2*time.Second); err != nil {
		t.Fatalf("new connection while only open ones are black-holed: %v", err)
	}

	// Healing delivers the held bytes late, intact, as TCP would.
	p.Pass()
	_ = old.SetReadDeadline(time.Now().Add(2 * time.Second))
	got := make([]byte, len("into the hole"))
	if _, err := io.ReadFull(old, got); err != nil || string(got) != "into the hole" {
		t.Fatalf("after Pass the old connection read %q, %v", got, err)
	}
}

func TestProxy_BlackHoleNewConnsToo(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	p.BlackHole(netfault.NewConnsBlackHole)

	c := dial(t, p.Addr()) // the proxy's kernel completes the handshake
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatalf("write: %v", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := c.Read(make([]byte, 1)); !isTimeout(err) {
		t.Fatalf("read on a new black-holed connection: %v; want a timeout", err)
	}
	if echo.received.Load() != 0 {
		t.Fatal("upstream received bytes through the black hole")
	}
	p.Pass()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatalf("after Pass: %v", err)
	}
}

func TestProxy_BlackHoleFillsTheSendersBuffers(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	c := dial(t, p.Addr())
	p.BlackHole(netfault.NewConnsPass)
	// Writes succeed until the kernel buffers and the proxy's one held
	// chunk are full, then block: a real partition's back-pressure.
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	buf := make([]byte, 64<<10)
	written := 0
	var err error
	for written < 256<<20 {
		var n int
		n, err = c.Write(buf)
		written += n
		if err != nil {
			break
		}
	}
	if !isTimeout(err) {
		t.Fatalf("wrote %d bytes into a black hole without blocking (err %v)", written, err)
	}
	t.Logf("a black-holed connection took %d KiB before writes blocked", written>>10)
}

func TestProxy_Latency(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	p.SetLatency(netfault.Upstream, 100*time.Millisecond)
	p.SetLatency(netfault.Downstream, 50*time.Millisecond)
	c := dial(t, p.Addr())
	start := time.Now()
	if err := roundTrip(c, []byte("slow"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 150*time.Millisecond || took > time.Second {
		t.Errorf("round trip took %s, want about 150ms", took)
	}
	p.SetLatency(netfault.Upstream, 0)
	p.SetLatency(netfault.Downstream, 0)
	start = time.Now()
	if err := roundTrip(c, []byte("fast"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 100*time.Millisecond {
		t.Errorf("round trip without latency took %s", took)
	}
}

func TestProxy_Bandwidth(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	p.SetBandwidth(netfault.Upstream, 40<<10) // 40 KiB/s
	c := dial(t, p.Addr())
	msg := bytes.Repeat([]byte("b"), 40<<10)
	start := time.Now()
	if err := roundTrip(c, msg, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 800*time.Millisecond || took > 3*time.Second {
		t.Errorf("40 KiB at 40 KiB/s took %s, want about 1s", took)
	}
}

func TestProxy_ResetAndCloseConns(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())

	c := dial(t, p.Addr())
	if err := roundTrip(c, []byte("a"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	p.ResetConns()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("read after ResetConns: %v; want ECONNRESET", err)
	}

	c = dial(t, p.Addr())
	if err := roundTrip(c, []byte("b"), 2*time.Second); err != nil {
		t.Fatalf("new connection after ResetConns: %v", err)
	}
	p.CloseConns()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Errorf("read after CloseConns: %v; want EOF", err)
	}
}

func TestProxy_Refuse(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	p.Refuse()
	c := dial(t, p.Addr())
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Errorf("read on a refused connection: %v; want it closed", err)
	}
	p.Pass()
	c = dial(t, p.Addr())
	if err := roundTrip(c, []byte("ok"), 2*time.Second); err != nil {
		t.Fatalf("after Pass: %v", err)
	}
}

func TestProxy_CloseEndsBlackHoledConns(t *testing.T) {
	echo := startEcho(t)
	p, err := netfault.Listen(echo.l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr())
	p.BlackHole(netfault.NewConnsBlackHole)
	_, _ = c.Write([]byte("held"))
	done := make(chan error, 1)
	go func() { done <- p.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close hangs with black-holed connections open")
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("connection still open after Close")
	}
}

func TestProxy_UpstreamDown(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	p := newProxy(t, addr)
	// The reset can beat the end of the client's connect.
	c, err := net.DialTimeout("tcp", p.Addr(), 2*time.Second)
	if err == nil {
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = c.Read(make([]byte, 1))
	}
	if err == nil || isTimeout(err) || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("read through a proxy whose upstream is down: %v; want the connection reset", err)
	}
}

func TestProxyURL(t *testing.T) {
	echo := startEcho(t)
	raw := "postgres://u:secret@" + echo.l.Addr().String() + "/db?sslmode=disable"
	p, proxied := netfault.ProxyURL(t, raw)
	want := "postgres://u:secret@" + p.Addr() + "/db?sslmode=disable"
	if proxied != want {
		t.Fatalf("ProxyURL = %q, want %q", proxied, want)
	}
	c := dial(t, p.Addr())
	if err := roundTrip(c, []byte("pg"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
}
