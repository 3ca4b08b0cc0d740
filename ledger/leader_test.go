package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
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
