package netfault_test

import (
	"bytes"
	"encoding/binary"
	"maps"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// startupMessage builds a PostgreSQL protocol 3.0 StartupMessage.
func startupMessage(params ...string) []byte {
	var body bytes.Buffer
	binary.Write(&body, binary.BigEndian, uint32(3<<16))
	for _, p := range params {
		body.WriteString(p)
		body.WriteByte(0)
	}
	body.WriteByte(0)
	msg := binary.BigEndian.AppendUint32(nil, uint32(body.Len()+4))
	return append(msg, body.Bytes()...)
}

func sslRequest() []byte {
	return binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(nil, 8), 80877103)
}

func TestPostgresStartup(t *testing.T) {
	repl := startupMessage("user", "relay", "database", "app", "replication", "database")
	want := map[string]string{"user": "relay", "database": "app", "replication": "database"}
	for _, tc := range []struct {
		name   string
		head   []byte
		params map[string]string
		ok     bool
	}{
		{"plain", repl, want, true},
		{"after a refused SSLRequest", append(sslRequest(), repl...), want, true},
		{"SSLRequest only", sslRequest(), nil, false},
		{"truncated", repl[:len(repl)-3], nil, false},
		{"more bytes after it", append(append([]byte{}, repl...), 'Q', 0, 0, 0, 4), want, true},
		{"no parameters", startupMessage(), map[string]string{}, true},
		{"TLS handshake after SSLRequest", append(sslRequest(), 0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01), nil, false},
		{"CancelRequest", binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(nil, 16), 80877102), nil, false},
		{"empty", nil, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			params, ok := netfault.PostgresStartup(tc.head)
			if ok != tc.ok || (tc.ok && !maps.Equal(params, tc.params)) {
				t.Errorf("PostgresStartup = %v, %v; want %v, %v", params, ok, tc.params, tc.ok)
			}
		})
	}
}

// TestProxy_BlackHoleConnsOpen: only the open connection the selector picks
// (by its StartupMessage) is black-holed; the other, and a new one like the
// picked one, pass.
func TestProxy_BlackHoleConnsOpen(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	plain := dial(t, p.Addr())
	if err := roundTrip(plain, startupMessage("user", "relay", "application_name", "outbox-relay"), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	repl := dial(t, p.Addr())
	if err := roundTrip(repl, append(sslRequest(), startupMessage("user", "relay", "replication", "database")...), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	p.BlackHoleConns(netfault.PostgresParam("replication", "database"), netfault.NewConnsPass)

	infos := p.ConnInfos()
	if len(infos) != 2 || infos[0].Seq != 1 || infos[0].BlackHoled || infos[1].Seq != 2 || !infos[1].BlackHoled {
		t.Fatalf("ConnInfos = %+v; want #1 passing, #2 black-holed", infos)
	}
	if err := roundTrip(repl, []byte("data"), 300*time.Millisecond); !isTimeout(err) {
		t.Fatalf("the selected connection: %v; want a timeout", err)
	}
	if err := roundTrip(plain, []byte("data"), 2*time.Second); err != nil {
		t.Fatalf("the other connection: %v", err)
	}
	fresh := dial(t, p.Addr())
	if err := roundTrip(fresh, startupMessage("user", "relay", "replication", "database"), 2*time.Second); err != nil {
		t.Fatalf("a new connection the selector picks, with NewConnsPass: %v", err)
	}
	p.Pass()
	got := make([]byte, 4)
	_ = repl.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := repl.Read(got); err != nil || string(got) != "data" {
		t.Fatalf("after Pass the held bytes arrive: %q, %v", got, err)
	}
}

// TestProxy_BlackHoleConnsNew: with NewConnsBlackHole, a new connection is
// black-holed as soon as its first bytes match — none of the matching
// StartupMessage reaches the server — and others pass.
func TestProxy_BlackHoleConnsNew(t *testing.T) {
	echo := startEcho(t)
	p := newProxy(t, echo.l.Addr().String())
	p.BlackHoleConns(netfault.PostgresParam("application_name", "outbox-relay leader s"), netfault.NewConnsBlackHole)

	other := dial(t, p.Addr())
	if err := roundTrip(other, startupMessage("user", "relay", "application_name", "outbox-relay"), 2*time.Second); err != nil {
		t.Fatalf("a connection the selector does not pick: %v", err)
	}
	before := echo.received.Load()
	c := dial(t, p.Addr())
	// The SSLRequest does not match yet: it passes, and the server's
	// answer (here its echo) comes back.
	if err := roundTrip(c, sslRequest(), 2*time.Second); err != nil {
		t.Fatalf("SSLRequest: %v", err)
	}
	startup := startupMessage("user", "relay", "application_name", "outbox-relay leader s")
	if err := roundTrip(c, startup, 300*time.Millisecond); !isTimeout(err) {
		t.Fatalf("a new connection the selector picks: %v; want a timeout", err)
	}
	if got := echo.received.Load() - before; got != 8 {
		t.Fatalf("the server received %d bytes of the picked connection, want only its 8-byte SSLRequest", got)
	}
	p.Pass()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	got := make([]byte, len(startup))
	if _, err := c.Read(got); err != nil {
		t.Fatalf("after Pass: %v", err)
	}
}
