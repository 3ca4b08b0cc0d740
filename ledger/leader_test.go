package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// TestLeader: one relay leads a slot, another stands by; when the leader's
// lock connection is cut, it notices within the ping interval and the
// standby takes over.
func TestLeader(t *testing.T) {
	url := pgtest.NewDatabase(t)
	ctx := context.Background()
	log := zerolog.New(zerolog.NewTestWriter(t))

	first, err := ledger.AcquireLeader(ctx, url, "slot_a", log)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Release()

	// Another slot has its own leader.
	other, err := ledger.AcquireLeader(ctx, url, "slot_b", log)
	if err != nil {
		t.Fatal(err)
	}
	other.Release()

	got := make(chan *ledger.Leader, 1)
	standbyCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		l, err := ledger.AcquireLeader(standbyCtx, url, "slot_a", log)
		if err == nil {
			got <- l
		}
	}()
	select {
	case <-got:
		t.Fatal("a second relay became leader while the first holds the lock")
	case <-time.After(2 * time.Second):
	}

	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'outbox-relay leader slot_a'
		AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("terminate the leader's lock session: n=%d err=%v", n, err)
	}
	cut := time.Now()
	select {
	case <-first.Lost():
		t.Logf("leader noticed the loss after %v", time.Since(cut))
	case <-time.After(5 * time.Second):
		t.Fatal("the leader did not notice its lock connection was cut within 5s")
	}
	select {
	case l := <-got:
		t.Logf("standby took over after %v", time.Since(cut))
		l.Release()
	case <-time.After(10 * time.Second):
		t.Fatal("the standby did not take over")
	}
}

// A server (or a middlebox) that accepts connections and then says nothing
// must not hold a lock attempt forever: each attempt gives up after
// relay.ConnectTimeout and the next one, once the path works again, takes
// the lock. Before the connect timeout the first attempt hung until its
// context ended, and a leader that lost its lock this way never led again.
func TestLockAttemptsOutlastASilentServer(t *testing.T) {
	url := pgtest.NewDatabase(t)
	proxy, proxied := netfault.ProxyURL(t, url)
	// The first connection is accepted and never answered; later ones pass.
	proxy.BlackHoleConns(func(c netfault.ConnInfo) bool { return c.Seq == 1 }, netfault.NewConnsBlackHole)
	log := zerolog.New(zerolog.NewTestWriter(t))
	ctx, cancel := context.WithTimeout(context.Background(), 4*relay.ConnectTimeout)
	defer cancel()

	start := time.Now()
	l, err := ledger.AcquireLeader(ctx, proxied, "slot_a", log)
	if err != nil {
		t.Fatalf("leader lock: %v (after %s)", err, time.Since(start).Round(time.Millisecond))
	}
	l.Release()
	took := time.Since(start)
	t.Logf("leader lock taken %s after start (first connection silent)", took.Round(time.Millisecond))
	if took > relay.ConnectTimeout+5*time.Second {
		t.Errorf("leader lock took %s, want within the connect timeout (%s) and a retry", took, relay.ConnectTimeout)
	}

	// The owner lock's attempt fails in bounded time instead of hanging.
	proxy.BlackHole(netfault.NewConnsBlackHole)
	pool, err := pgxpool.New(ctx, proxied) // connects only when used
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	start = time.Now()
	if lock, err := mustStore(t, pool, ledger.DefaultConfig()).LockOwner(ctx, ledger.NewOwner()); err == nil {
		lock.Release()
		t.Fatal("owner lock taken through a black hole")
	}
	if took := time.Since(start); took > relay.ConnectTimeout+5*time.Second {
		t.Errorf("owner lock attempt gave up after %s, want about the connect timeout (%s)", took, relay.ConnectTimeout)
	}
}

// TestOwnerLockReleasedIntoABlackHoleIsTakenAgain: the claim path stops
// (its leadership term ended) while its owner lock's connection is
// black-holed, so Release cannot unlock and its close never reaches the
// server, whose session keeps the lock. The relay's next term must take
// the owner lock again — ending the session it abandoned — instead of
// failing with relay.ErrLockTaken (make chaos, full profile: pg-blackhole
// then a new term; the relay exited 1 with "claim path: owner …: lock is
// held by another session").
func TestOwnerLockReleasedIntoABlackHoleIsTakenAgain(t *testing.T) {
	url := pgtest.NewDatabase(t)
	proxy, proxied := netfault.ProxyURL(t, url)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, proxied)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	store := mustStore(t, pool, ledger.DefaultConfig())
	owner := ledger.NewOwner()

	lock, err := store.LockOwner(ctx, owner)
	if err != nil {
		t.Fatal(err)
	}
	proxy.BlackHole(netfault.NewConnsPass)
	lock.Release() // the unlock and the close are swallowed
	var held bool
	direct, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close(ctx)
	if err := direct.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted)`).Scan(&held); err != nil || !held {
		t.Fatalf("the abandoned session does not hold the owner lock (held %v, %v): the test does not test anything", held, err)
	}

	again, err := store.LockOwner(ctx, owner)
	if err != nil {
		t.Fatalf("owner lock after a release into a black hole: %v", err)
	}
	again.Release()
}
