package netfault_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// serveEcho echoes every connection l accepts.
func serveEcho(t *testing.T, l net.Listener) {
	t.Helper()
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
}

func TestNamespace_ListenDialAcrossALink(t *testing.T) {
	ns := netfault.NewNamespace(t)
	link := netfault.NewLink(t, nil, ns)

	l, err := ns.Listen("tcp", net.JoinHostPort(link.AddrB(), "7000"))
	if err != nil {
		t.Fatal(err)
	}
	serveEcho(t, l)

	// From the test's own namespace, across the veth pair.
	c := dial(t, net.JoinHostPort(link.AddrB(), "7000"))
	if err := roundTrip(c, []byte("across"), 2*time.Second); err != nil {
		t.Fatalf("round trip across the link: %v", err)
	}

	// The listener is in the namespace: the test's own loopback does not
	// reach it, the namespace's does.
	inner, err := ns.Listen("tcp", "127.0.0.1:7001")
	if err != nil {
		t.Fatal(err)
	}
	serveEcho(t, inner)
	if c, err := net.DialTimeout("tcp", "127.0.0.1:7001", time.Second); err == nil {
		c.Close()
		t.Error("the test's loopback reached a listener in the namespace")
	}
	c2, err := ns.DialContext(context.Background(), "tcp", "127.0.0.1:7001")
	if err != nil {
		t.Fatalf("dial inside the namespace: %v", err)
	}
	defer c2.Close()
	if err := roundTrip(c2, []byte("inside"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
}

func TestLink_DownDropsSilently(t *testing.T) {
	ns := netfault.NewNamespace(t)
	link := netfault.NewLink(t, nil, ns)
	addr := net.JoinHostPort(link.AddrB(), "7000")
	l, err := ns.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	serveEcho(t, l)
	c := dial(t, addr)
	if err := roundTrip(c, []byte("up"), 2*time.Second); err != nil {
		t.Fatal(err)
	}

	if err := link.Down(); err != nil {
		t.Fatal(err)
	}
	// An open connection: the write succeeds locally, the read times out.
	if _, err := c.Write([]byte("down")); err != nil {
		t.Fatalf("write on a link that is down failed locally: %v", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := c.Read(make([]byte, 4)); !isTimeout(err) {
		t.Fatalf("read across a link that is down: %v; want a timeout", err)
	}
	// A new connect never completes (no refusal, no "unreachable").
	if c2, err := net.DialTimeout("tcp", addr, 700*time.Millisecond); !isTimeout(err) {
		if c2 != nil {
			c2.Close()
		}
		t.Fatalf("connect across a link that is down: %v; want a timeout", err)
	}

	// Up again: TCP retransmits, and the held bytes arrive late.
	if err := link.Up(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, 4)
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "down" {
		t.Fatalf("after Up read %q, %v", got, err)
	}
}

func TestNamespace_BlackholeRouteSilencesTheNamespace(t *testing.T) {
	ns := netfault.NewNamespace(t)
	link := netfault.NewLink(t, nil, ns)
	addr := net.JoinHostPort(link.AddrB(), "7000")
	l, err := ns.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	serveEcho(t, l)

	// The namespace's replies to the test's end vanish: connects hang.
	prefix := link.AddrA() + "/32"
	if err := ns.Blackhole(prefix); err != nil {
		t.Fatal(err)
	}
	if c, err := net.DialTimeout("tcp", addr, 700*time.Millisecond); !isTimeout(err) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("connect to a namespace that black-holes its replies: %v; want a timeout", err)
	}
	if err := ns.Unblackhole(prefix); err != nil {
		t.Fatal(err)
	}
	c := dial(t, addr)
	if err := roundTrip(c, []byte("back"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
}

func TestNamespace_Command(t *testing.T) {
	ns := netfault.NewNamespace(t)
	out, err := ns.Command(context.Background(), "ip", "-o", "link", "show").CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	// Only the namespace's loopback, none of the host's interfaces.
	if lines := strings.Count(strings.TrimSpace(string(out)), "\n") + 1; lines != 1 || !strings.Contains(string(out), "lo:") {
		t.Errorf("ip link inside the namespace:\n%s", out)
	}
	if err := ns.Command(context.Background(), "false").Run(); !errors.As(err, new(*exec.ExitError)) {
		t.Errorf("a failing command: %v", err)
	}
}

func TestNamespace_DeleteRemovesItsLinks(t *testing.T) {
	netfault.Require(t)
	ns, err := netfault.CreateNamespace()
	if err != nil {
		t.Fatal(err)
	}
	link, err := netfault.CreateLink(nil, ns)
	if err != nil {
		_ = ns.Delete()
		t.Fatal(err)
	}
	if err := ns.Delete(); err != nil {
		t.Fatal(err)
	}
	if err := link.Delete(); err != nil {
		t.Errorf("Delete of a link gone with its namespace: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		out, _ := exec.Command("ip", "-o", "addr", "show").CombinedOutput()
		if !strings.Contains(string(out), link.AddrA()+"/30") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the host still has the link's address 5s after its namespace was deleted:\n%s", out)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
