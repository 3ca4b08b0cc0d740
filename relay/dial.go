package relay

import (
	"context"
	"net"
	"syscall"
	"time"
)

// Keepalive settings of every connection the relay opens to PostgreSQL
// (docs/operations.md, "timeouts"): an idle peer that stopped answering is
// noticed after about idle + interval × count = 11 s, and data the peer
// never acknowledges ends the connection after TCPUserTimeout. Neither sees
// a peer that answers TCP but not the protocol (a proxy in between): the
// relay's own pings and receive limits cover that.
const (
	KeepaliveIdle     = 5 * time.Second
	KeepaliveInterval = 2 * time.Second
	KeepaliveCount    = 3
	TCPUserTimeout    = 20 * time.Second
)

// ConnectTimeout bounds one connection attempt to PostgreSQL — the dial,
// TLS and the start-up exchange — unless the URL's connect_timeout sets
// another. Without it a server (or a middlebox) that accepts the TCP
// connection and then says nothing holds the attempt forever: a relay
// that lost its leader lock that way would never lead again.
const ConnectTimeout = 10 * time.Second

// Dial is a DialFunc for pgx with those keepalives and TCP_USER_TIMEOUT.
func Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	d := &net.Dialer{
		Timeout:         ConnectTimeout,
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: KeepaliveIdle, Interval: KeepaliveInterval, Count: KeepaliveCount},
		Control: func(network, address string, c syscall.RawConn) error {
			if network != "tcp" && network != "tcp4" && network != "tcp6" {
				return nil
			}
			var serr error
			err := c.Control(func(fd uintptr) { serr = setUserTimeout(fd, TCPUserTimeout) })
			if err != nil {
				return err
			}
			return serr
		},
	}
	return d.DialContext(ctx, network, addr)
}
