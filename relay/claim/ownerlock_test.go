package claim_test

import (
	"bytes"
	"context"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay/claim"
)

// A Run whose ctx ends while its owner-lock query is in flight has released
// the lock when it returns, so a new claim source with the same owner can
// start at once — what the relay does in auto mode when the stream fails at
// start (a role without REPLICATION) and it falls back to polling. Found by
// the bad-input suite (TestBadInput_MissingGrants): the query, cut short by
// the cancelled ctx, left the lock with a session pgx was still closing in
// the background, the polling source found the lock taken, and the relay
// stopped.
//
// A proxy between the source's store and the server forwards the lock
// query and then holds the connection: the server has granted the lock and
// the answer has not reached the source when ctx is cancelled.
func TestRunCancelledWhileLockingReleasesTheLock(t *testing.T) {
	f := MustFixture(t)
	p := startFreezeProxy(t, f.url, []byte("pg_try_advisory_lock"))
	u, err := url.Parse(p.url)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("default_query_exec_mode", "simple_protocol") // the query text travels with its execution
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	r := MustEngine(t, f, options{Routes: routes(newFakeSink("a", nil)), PollInterval: time.Hour})
	owner := r.Owner()
	lockHeld := func() bool {
		return f.MustInt(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2
			AND classid = $1 AND objid = hashtext($2)::oid`, int64(ledger.OwnerLockClass), owner) > 0
	}
	// The source's store (the owner lock's connection) goes through the
	// proxy; the engine's does not.
	c, err := claim.New(r.SourceConfig(t, mustStore(t, pool, ledger.DefaultConfig())))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case <-p.frozen:
	case <-time.After(20 * time.Second):
		t.Fatal("the owner-lock query never reached the proxy")
	}
	waitFor(t, 10*time.Second, "the server to grant the owner lock", lockHeld)
	cancel()

	select {
	case err := <-done:
		// Run gave up on the answer: the session that holds the lock is
		// still open behind the proxy.
		if lockHeld() {
			t.Fatalf("Run returned (%v) while a session of its own still held the owner lock", err)
		}
	case <-time.After(2 * time.Second):
		// Run waits for the answer to the query it sent.
		p.release()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("Run did not return once the answer came")
		}
		if lockHeld() {
			t.Fatal("the owner lock is still held after Run returned")
		}
	}
	p.release()

	// A new source with the same owner starts at once.
	again, err := claim.New(r.SourceConfig(t, nil))
	if err != nil {
		t.Fatal(err)
	}
	ctx2, cancel2 := context.WithCancel(context.Background())
	done2 := make(chan error, 1)
	go func() { done2 <- again.Run(ctx2) }()
	waitFor(t, 10*time.Second, "the new source's owner lock", func() bool {
		select {
		case err := <-done2:
			t.Fatalf("the new source with the same owner: %v", err)
		default:
		}
		return lockHeld()
	})
	cancel2()
	if err := <-done2; err != nil {
		t.Fatal(err)
	}
}

// freezeProxy forwards TCP connections to a PostgreSQL server until a client
// sends a message containing its trigger: it forwards that message, then
// holds both directions of that connection until release.
type freezeProxy struct {
	url     string
	frozen  chan struct{} // closed once the trigger was forwarded
	thawed  chan struct{} // closed by release
	once    sync.Once
	trigger []byte
}

func startFreezeProxy(t *testing.T, serverURL string, trigger []byte) *freezeProxy {
	t.Helper()
	u, err := url.Parse(serverURL)
	if err != nil {
		t.Fatal(err)
	}
	upstream := u.Host
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.Host = ln.Addr().String()
	p := &freezeProxy{url: u.String(), frozen: make(chan struct{}), thawed: make(chan struct{}), trigger: trigger}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		p.release()
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	var triggered sync.Once
	wg.Go(func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", upstream)
			if err != nil {
				client.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, client, server)
			mu.Unlock()
			// held is closed when this connection freezes.
			held := make(chan struct{})
			// Client to server: watch for the trigger.
			wg.Go(func() {
				defer server.Close()
				buf := make([]byte, 64<<10)
				for {
					n, err := client.Read(buf)
					if n > 0 {
						trig := false
						if bytes.Contains(buf[:n], p.trigger) {
							// Hold the answer before the server can send it.
							triggered.Do(func() { close(held); trig = true })
						}
						if _, werr := server.Write(buf[:n]); werr != nil {
							return
						}
						if trig {
							close(p.frozen)
						}
						select {
						case <-held:
							<-p.thawed
						default:
						}
					}
					if err != nil {
						return
					}
				}
			})
			// Server to client: held once frozen.
			wg.Go(func() {
				defer client.Close()
				buf := make([]byte, 64<<10)
				for {
					n, err := server.Read(buf)
					if n > 0 {
						select {
						case <-held:
							<-p.thawed
						default:
						}
						if _, werr := client.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			})
		}
	})
	return p
}

// release lets the frozen connection's traffic through again.
func (p *freezeProxy) release() { p.once.Do(func() { close(p.thawed) }) }
