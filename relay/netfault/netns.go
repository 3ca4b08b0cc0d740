package netfault

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// Network namespaces: a Namespace is a Linux network namespace made with
// `ip netns add`, with its own interfaces, routes and loopback. Link joins
// two of them (or one and the test's own namespace) with a veth pair. A
// server runs inside one either as a process (Namespace.Command, which runs
// `ip netns exec`) or in the test's process on a socket made inside it
// (Namespace.Listen, Namespace.DialContext): a socket belongs to the
// namespace it was created in, whichever thread uses it later.
//
// Faults: Link.Down takes one end of the pair down, so every packet either
// way is dropped silently (the neighbour entries are permanent, so no ARP
// failure reports "host unreachable"): open connections stall with writes
// succeeding locally, and new connects never complete. Namespace.Blackhole
// adds a blackhole route: packets the namespace sends there vanish, so its
// peers see their connects and requests go unanswered (the namespace's own
// connects to that prefix fail at once with EINVAL).
//
// All of it needs root and iproute2's ip; Require says which is missing.

// Require checks what namespaces need (root, the ip command, a working
// `ip netns`) and skips tb with the reason when something is missing, or
// fails it under CI (CI=true or CI=1): there the tests must not pass by
// skipping.
func Require(tb testing.TB) {
	tb.Helper()
	err := prerequisites()
	if err == nil {
		return
	}
	msg := fmt.Sprintf("netfault: network namespaces unavailable: %v", err)
	if inCI() {
		tb.Fatalf("%s (CI is set: not skipping)", msg)
	}
	tb.Skip(msg)
}

var prerequisites = sync.OnceValue(func() error {
	if os.Geteuid() != 0 {
		return errors.New("not root (ip netns needs CAP_SYS_ADMIN and CAP_NET_ADMIN)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return errors.New("the ip command is missing: apt-get install iproute2")
	}
	if _, err := os.Stat("/proc/thread-self/ns/net"); err != nil {
		return fmt.Errorf("no network namespace support: %w", err)
	}
	return nil
})

func inCI() bool {
	v := os.Getenv("CI")
	return strings.EqualFold(v, "true") || v == "1"
}

// ip runs the ip command with args and returns its error with its output.
func ip(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// randomHex returns n random bytes in hex.
func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Namespace is a network namespace made by NewNamespace. A nil *Namespace
// stands for the test's own (the host's) namespace where a method allows it.
type Namespace struct {
	name string
}

// NewNamespace makes a network namespace with a fresh name and its loopback
// up, and deletes it when tb ends (which removes its interfaces, and so the
// veth pairs of its links). It calls Require first.
func NewNamespace(tb testing.TB) *Namespace {
	tb.Helper()
	Require(tb)
	ns, err := CreateNamespace()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := ns.Delete(); err != nil {
			tb.Errorf("%v", err)
		}
	})
	return ns
}

// CreateNamespace makes a network namespace named "nf-" and random hex,
// with its loopback up. The caller must Delete it; for tests, NewNamespace
// does.
func CreateNamespace() (*Namespace, error) {
	if err := prerequisites(); err != nil {
		return nil, fmt.Errorf("netfault: %w", err)
	}
	ns := &Namespace{name: "nf-" + randomHex(4)}
	if err := ip("netns", "add", ns.name); err != nil {
		return nil, fmt.Errorf("netfault: %w", err)
	}
	if err := ns.IP("link", "set", "lo", "up"); err != nil {
		_ = ns.Delete()
		return nil, err
	}
	return ns, nil
}

// Name returns the namespace's name, as `ip netns` lists it.
func (ns *Namespace) Name() string { return ns.name }

// Delete deletes the namespace (its interfaces go with it). Processes still
// running in it keep it alive until they exit.
func (ns *Namespace) Delete() error {
	if err := ip("netns", "del", ns.name); err != nil {
		return fmt.Errorf("netfault: delete namespace: %w", err)
	}
	return nil
}

// IP runs `ip args…` inside the namespace (`ip -n NAME args…`); on the
// nil Namespace, in the test's own.
func (ns *Namespace) IP(args ...string) error {
	if ns != nil {
		args = append([]string{"-n", ns.name}, args...)
	}
	if err := ip(args...); err != nil {
		return fmt.Errorf("netfault: %w", err)
	}
	return nil
}

// Command returns a command that runs name with args inside the namespace
// (through `ip netns exec`).
func (ns *Namespace) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns.name, name}, args...)...)
}

// Do runs fn on an OS thread switched into the namespace, so that sockets
// fn creates belong to it. fn must not start goroutines that create
// sockets (they would run on other threads). The thread is switched back
// afterwards; if that fails it is discarded.
func (ns *Namespace) Do(fn func() error) error {
	if ns == nil {
		return fn()
	}
	type result struct{ err error }
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		// Not unlocked when switching back fails: the goroutine's exit
		// then ends the thread rather than reusing it in the namespace.
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			done <- result{fmt.Errorf("netfault: %w", err)}
			return
		}
		defer orig.Close()
		target, err := os.Open("/var/run/netns/" + ns.name)
		if err != nil {
			done <- result{fmt.Errorf("netfault: namespace %s: %w", ns.name, err)}
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- result{fmt.Errorf("netfault: enter namespace %s: %w", ns.name, err)}
			return
		}
		fnErr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- result{errors.Join(fnErr, fmt.Errorf("netfault: leave namespace %s: %w", ns.name, err))}
			return
		}
		runtime.UnlockOSThread()
		done <- result{fnErr}
	}()
	return (<-done).err
}

// Listen listens on address inside the namespace (see Do); the listener and
// the connections it accepts belong to the namespace.
func (ns *Namespace) Listen(network, address string) (net.Listener, error) {
	var l net.Listener
	err := ns.Do(func() (err error) {
		l, err = net.Listen(network, address)
		return err
	})
	return l, err
}

// DialContext dials address from inside the namespace (see Do), as a client
// running there would. Use an IP address: a name lookup may run elsewhere.
// Its signature fits http.Transport.DialContext, pgconn's DialFunc and
// nats.SetCustomDialer (through Dialer).
func (ns *Namespace) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, network, address)
		return err
	})
	return c, err
}

// Blackhole adds a blackhole route for prefix (such as "10.1.2.3/32") in
// the namespace (nil: the test's own): what it sends there is dropped. Its
// peers at prefix then get no answer: their connects hang, and their open
// connections stall.
func (ns *Namespace) Blackhole(prefix string) error {
	return ns.IP("route", "add", "blackhole", prefix)
}

// Unblackhole removes the blackhole route Blackhole added.
func (ns *Namespace) Unblackhole(prefix string) error {
	return ns.IP("route", "del", "blackhole", prefix)
}

// Link is a veth pair joining two namespaces, each end with an address in
// one /30.
type Link struct {
	a, b         *Namespace
	nameA, nameB string
	addrA, addrB net.IP
}

// NewLink joins a and b (either may be nil, the test's own namespace, but
// not both) with a veth pair, gives the ends addresses in a random
// 10.x.y.z/30, brings them up with permanent neighbour entries, and removes
// the pair when tb ends. It calls Require first.
func NewLink(tb testing.TB, a, b *Namespace) *Link {
	tb.Helper()
	Require(tb)
	l, err := CreateLink(a, b)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := l.Delete(); err != nil {
			tb.Errorf("%v", err)
		}
	})
	return l
}

// CreateLink is NewLink without a test: the caller must Delete the link
// (deleting either namespace deletes it too).
func CreateLink(a, b *Namespace) (*Link, error) {
	if a == nil && b == nil {
		return nil, errors.New("netfault: a link needs at least one namespace")
	}
	if err := prerequisites(); err != nil {
		return nil, fmt.Errorf("netfault: %w", err)
	}
	id := randomHex(4)
	// A random /30 in 10.128.0.0/9; link-local names under 16 bytes.
	var r [4]byte
	_, _ = rand.Read(r[:])
	base := binary.BigEndian.Uint32(r[:])&0x007ffffc | 10<<24 | 0x80<<16
	l := &Link{a: a, b: b, nameA: "nf" + id + "a", nameB: "nf" + id + "b",
		addrA: ipv4(base + 1), addrB: ipv4(base + 2)}

	if err := ip("link", "add", l.nameA, "type", "veth", "peer", "name", l.nameB); err != nil {
		return nil, fmt.Errorf("netfault: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = l.Delete()
		}
	}()
	for _, end := range []struct {
		ns   *Namespace
		name string
		addr net.IP
	}{{a, l.nameA, l.addrA}, {b, l.nameB, l.addrB}} {
		if end.ns != nil {
			if err := ip("link", "set", end.name, "netns", end.ns.name); err != nil {
				return nil, fmt.Errorf("netfault: %w", err)
			}
		}
		if err := end.ns.IP("addr", "add", end.addr.String()+"/30", "dev", end.name); err != nil {
			return nil, err
		}
		if err := end.ns.IP("link", "set", end.name, "up"); err != nil {
			return nil, err
		}
	}
	macA, err := l.a.mac(l.nameA)
	if err != nil {
		return nil, err
	}
	macB, err := l.b.mac(l.nameB)
	if err != nil {
		return nil, err
	}
	// Permanent neighbours: with the link down, a neighbour lookup that
	// failed would report "no route to host" instead of silence.
	if err := l.a.IP("neigh", "replace", l.addrB.String(), "lladdr", macB, "dev", l.nameA, "nud", "permanent"); err != nil {
		return nil, err
	}
	if err := l.b.IP("neigh", "replace", l.addrA.String(), "lladdr", macA, "dev", l.nameB, "nud", "permanent"); err != nil {
		return nil, err
	}
	ok = true
	return l, nil
}

func ipv4(v uint32) net.IP {
	return net.IPv4(byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
}

// mac returns the hardware address of interface dev in ns.
func (ns *Namespace) mac(dev string) (string, error) {
	var hw string
	err := ns.Do(func() error {
		iface, err := net.InterfaceByName(dev)
		if err != nil {
			return fmt.Errorf("netfault: interface %s: %w", dev, err)
		}
		hw = iface.HardwareAddr.String()
		return nil
	})
	return hw, err
}

// AddrA returns the address of the end in the first namespace.
func (l *Link) AddrA() string { return l.addrA.String() }

// AddrB returns the address of the end in the second namespace.
func (l *Link) AddrB() string { return l.addrB.String() }

// Down takes the second namespace's end down: every packet either way is
// dropped silently until Up.
func (l *Link) Down() error { return l.b.IP("link", "set", l.nameB, "down") }

// Up brings the second namespace's end back up.
func (l *Link) Up() error { return l.b.IP("link", "set", l.nameB, "up") }

// Delete removes the veth pair (both ends). Removing one already gone with
// its namespace is not an error.
func (l *Link) Delete() error {
	// A namespace's interfaces go some moment after `ip netns del`: the
	// kernel cleans namespaces up in the background.
	err := l.a.IP("link", "del", l.nameA)
	if err != nil && strings.Contains(err.Error(), "Cannot find device") {
		return nil
	}
	return err
}
