// Package natstest runs embedded NATS servers with JetStream for tests: one
// server (Start), or a cluster whose servers can be stopped, restarted and
// cut off (StartCluster).
//
// Start returns a server on a free 127.0.0.1 port with its JetStream store in
// a test temporary directory; Shutdown and Restart stop it and bring it back
// on the same port with the same store, so streams and messages survive and
// clients with reconnect enabled reconnect, as after a real server restart.
package natstest

import (
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

const (
	// bindTimeout bounds how long a start retries a busy port.
	bindTimeout = 10 * time.Second
	// readyTimeout bounds how long a started server may take to accept
	// connections. It is generous because a loaded machine (the race
	// detector, other tests' servers and clusters) can take seconds, and
	// a start that gave up and tried again would only start over; a ready
	// server ends the wait at once.
	readyTimeout = time.Minute
)

// Option configures a server started by Start.
type Option func(*config)

type config struct {
	maxPayload int32
	token      string
	user       string
	password   string
	syncAlways bool
}

// WithMaxPayload sets the largest message payload the server accepts, in
// bytes (the server's max_payload, which bounds JetStream publishes too). The
// default is the server's default, 1 MiB.
func WithMaxPayload(bytes int32) Option {
	return func(c *config) { c.maxPayload = bytes }
}

// WithToken makes the server require the authentication token; clients pass
// it with nats.Token (see ClientOptions). It cannot be combined with
// WithUserPassword.
func WithToken(token string) Option {
	return func(c *config) { c.token = token }
}

// WithUserPassword makes the server require the user and password; clients
// pass them with nats.UserInfo (see ClientOptions).
func WithUserPassword(user, password string) Option {
	return func(c *config) { c.user, c.password = user, password }
}

// WithSyncAlways makes JetStream fsync every write before acknowledging it
// (sync_interval: always), instead of syncing in the background every two
// minutes, so an acknowledged message survives a machine crash.
func WithSyncAlways() Option {
	return func(c *config) { c.syncAlways = true }
}

// Server is an embedded NATS server with JetStream. Its methods are safe for
// concurrent use.
type Server struct {
	cfg      config
	port     int
	storeDir string

	mu  sync.Mutex
	srv *server.Server // nil while shut down
}

// Start starts a server for tb on a free 127.0.0.1 port with JetStream
// storing in a directory from tb.TempDir, and shuts it down when tb ends. It
// fails tb if the server does not become ready.
func Start(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	s := &Server{storeDir: tb.TempDir()}
	for _, opt := range opts {
		opt(&s.cfg)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("natstest: pick a free port: %v", err)
	}
	s.port = l.Addr().(*net.TCPAddr).Port
	_ = l.Close()

	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.startLocked(); err != nil {
		tb.Fatalf("natstest: %v", err)
	}
	// Registered after tb.TempDir, so it runs before the store is removed.
	tb.Cleanup(s.Shutdown)
	return s
}

// URL returns the client URL, nats://127.0.0.1:PORT, without credentials.
func (s *Server) URL() string {
	return "nats://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Port returns the client port. It stays the same across Restart.
func (s *Server) Port() int {
	return s.port
}

// ClientOptions returns the nats.Connect options carrying the credentials set
// with WithToken or WithUserPassword, or none.
func (s *Server) ClientOptions() []nats.Option {
	var opts []nats.Option
	if s.cfg.token != "" {
		opts = append(opts, nats.Token(s.cfg.token))
	}
	if s.cfg.user != "" {
		opts = append(opts, nats.UserInfo(s.cfg.user, s.cfg.password))
	}
	return opts
}

// Server returns the running server, or nil after Shutdown. Restart replaces
// it with a new one.
func (s *Server) Server() *server.Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.srv
}

// Shutdown stops the server and waits until it has stopped: clients are
// disconnected, JetStream has flushed its store and the port is released.
// Calling it again does nothing.
func (s *Server) Shutdown() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shutdownLocked()
}

// Restart shuts the server down if it is running and starts a new one on the
// same port with the same JetStream store, so streams, messages and the
// duplicate window survive. If the port is briefly held by another process it
// retries for up to ten seconds; it fails tb if the server does not become
// ready.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shutdownLocked()
	if err := s.startLocked(); err != nil {
		tb.Fatalf("natstest: restart: %v", err)
	}
}

func (s *Server) shutdownLocked() {
	if s.srv == nil {
		return
	}
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
	s.srv = nil
}

func (s *Server) options() *server.Options {
	return &server.Options{
		ServerName: "natstest",
		Host:       "127.0.0.1",
		Port:       s.port,
		JetStream:  true,
		StoreDir:   s.storeDir,
		NoLog:      true,
		NoSigs:     true,

		MaxPayload:    s.cfg.maxPayload,
		Authorization: s.cfg.token,
		Username:      s.cfg.user,
		Password:      s.cfg.password,
		// As the config file's sync_interval: always. The background
		// interval stays at the store's default.
		SyncAlways: s.cfg.syncAlways,
	}
}

// startLocked starts a server on s.port once the port is free.
func (s *Server) startLocked() error {
	if err := waitPortsFree(s.port); err != nil {
		return fmt.Errorf("start nats server: %w", err)
	}
	srv, err := startServer(s.options())
	if err != nil {
		return fmt.Errorf("start nats server: %w", err)
	}
	s.srv = srv
	return nil
}

// waitPortsFree waits until every port can be bound on 127.0.0.1 (another
// process, or the previous server's sockets, may hold one for a moment),
// for at most bindTimeout. With NoLog a server reports a failed bind
// nowhere and only never becomes ready, so the ports are probed first.
func waitPortsFree(ports ...int) error {
	deadline := time.Now().Add(bindTimeout)
	for {
		var busy error
		for _, p := range ports {
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
			if err != nil {
				busy = fmt.Errorf("port %d: %w", p, err)
				break
			}
			_ = l.Close()
		}
		if busy == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("still busy after %s: %w", bindTimeout, busy)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startServer starts a server with opts and waits until it accepts
// connections on its client (and cluster) port, for at most readyTimeout;
// a server that does not is shut down again.
func startServer(opts *server.Options) (*server.Server, error) {
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, err
	}
	// Start does not block: it runs the accept loop in the server's own
	// goroutines, which Shutdown ends and WaitForShutdown waits for.
	srv.Start()
	if !srv.ReadyForConnections(readyTimeout) {
		srv.Shutdown()
		srv.WaitForShutdown()
		what := fmt.Sprintf("client port %d", opts.Port)
		if opts.Cluster.Port != 0 {
			what += fmt.Sprintf(" and cluster port %d", opts.Cluster.Port)
		}
		return nil, fmt.Errorf("server %s did not accept connections on %s within %s", opts.ServerName, what, readyTimeout)
	}
	return srv, nil
}
