package replication_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
	"github.com/outbox-relay/outbox-relay/relay/replication"
)

// serverVersion returns the shared cluster's server_version_num.
func serverVersion(t *testing.T, e *testEnv) int {
	t.Helper()
	var v int
	if err := e.conn.QueryRow(context.Background(), "SELECT current_setting('server_version_num')::int").Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

func slotFailover(t *testing.T, e *testEnv) bool {
	t.Helper()
	var on bool
	if err := e.conn.QueryRow(context.Background(), "SELECT failover FROM pg_replication_slots WHERE slot_name = $1", e.slot).Scan(&on); err != nil {
		t.Fatal(err)
	}
	return on
}

// TestCreatesFailoverSlot (PostgreSQL 17+): the slot is created with
// failover enabled, through the exported-snapshot hand-over.
func TestCreatesFailoverSlot(t *testing.T) {
	e := newEnv(t)
	if v := serverVersion(t, e); v < 170000 {
		t.Skipf("server_version_num %d: slots have no failover property before PostgreSQL 17", v)
	}
	e.insert(t, "pending-at-creation")
	c := &fakeConsumer{}
	claim := &claimRecorder{url: e.url}
	start(t, e.config(t, c, &fakeCheckpoint{}, claim))
	waitStreaming(t, c, 1)
	if !slotFailover(t, e) {
		t.Error("the new slot has failover disabled")
	}
	if _, counts := claim.waitCalls(t, 1); len(counts) != 1 || counts[0] != 1 {
		t.Errorf("hand-over marked %v rows, want [1]: the exported snapshot was not handed over", counts)
	}
}

// TestEnablesFailoverOnExistingSlot (PostgreSQL 17+): a slot of the relay
// made without failover (before an upgrade to 17) gets it at the next
// session, and keeps its position.
func TestEnablesFailoverOnExistingSlot(t *testing.T) {
	e := newEnv(t)
	if v := serverVersion(t, e); v < 170000 {
		t.Skipf("server_version_num %d: slots have no failover property before PostgreSQL 17", v)
	}
	mustExec(t, e.conn, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", e.slot)
	if slotFailover(t, e) {
		t.Fatal("the slot made by hand has failover enabled")
	}
	c := &fakeConsumer{}
	cfg := e.config(t, c, &fakeCheckpoint{}, nil)
	cfg.HandOver = handOverStub{} // the slot counts as handed over: it is kept
	start(t, cfg)
	waitStreaming(t, c, 1)
	if !slotFailover(t, e) {
		t.Error("failover is still disabled on the relay's slot")
	}
	e.insert(t, "after")
	waitFor(t, 10*time.Second, "the event", func() bool { return c.commitOf("after") != 0 })
}

// TestWaitsForSlotHeldByAnotherProcess: "replication slot is active for
// PID" from a process that is not the Source's own is retried until the
// slot is free, not treated as fatal.
func TestWaitsForSlotHeldByAnotherProcess(t *testing.T) {
	e := newEnv(t)
	c1 := &fakeConsumer{}
	claim := &claimRecorder{url: e.url}
	r := start(t, e.config(t, c1, &fakeCheckpoint{}, claim))
	waitStreaming(t, c1, 1)
	// The hand-over finishes beside the stream; a slot left without its
	// record would be made again rather than waited for.
	claim.waitCalls(t, 1)
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	// The server ends the stopped source's walsender a moment after its
	// connection closed.
	waitFor(t, 10*time.Second, "the stopped source's walsender to end", func() bool {
		_, _, pid, _ := slotState(t, e)
		return pid == 0
	})

	ctx := context.Background()
	other, err := pgconn.Connect(ctx, e.url+"&replication=database")
	if err != nil {
		t.Fatal(err)
	}
	if err := pglogrepl.StartReplication(ctx, other, e.slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names 'outbox_relay'"},
	}); err != nil {
		t.Fatal(err)
	}

	var log logBuffer
	cfg := e.config(t, &fakeConsumer{}, &fakeCheckpoint{}, &claimRecorder{url: e.url})
	c2 := &fakeConsumer{}
	cfg.Consumer = c2
	cfg.ReconnectMax = 500 * time.Millisecond
	cfg.Logger = zerolog.New(&log)
	start(t, cfg)
	waitFor(t, 20*time.Second, "a retried START_REPLICATION", func() bool {
		return strings.Count(log.String(), "in use by process") >= 2
	})
	other.Close(ctx)
	waitFor(t, 30*time.Second, "streaming once the slot is free", func() bool {
		// The consumer restarts once the slot is the session's (the
		// refused attempts do not restart it).
		_, _, pid, _ := slotState(t, e)
		return pid != 0 && c2.restartCount() >= 1
	})
	e.insert(t, "after")
	waitFor(t, 10*time.Second, "the event", func() bool { return c2.commitOf("after") != 0 })
}

// TestEndsOwnStaleWalsender: the walsender of the Source's own earlier
// connection, which a network that swallows packets keeps alive at the
// server until wal_sender_timeout, is ended as soon as the slot is found
// held by it: streaming resumes within seconds, not a minute.
func TestEndsOwnStaleWalsender(t *testing.T) {
	e := newEnv(t)
	proxy, viaProxy := netfault.ProxyURL(t, e.url)
	var log logBuffer
	cfg := e.config(t, &fakeConsumer{}, &fakeCheckpoint{}, &claimRecorder{url: e.url})
	c := &fakeConsumer{}
	cfg.Consumer = c
	cfg.ConnString = viaProxy
	cfg.Logger = zerolog.New(&log)
	start(t, cfg)
	waitStreaming(t, c, 1)
	_, _, stale, _ := slotState(t, e)

	proxy.BlackHole(netfault.NewConnsPass)
	cut := time.Now()
	waitFor(t, 40*time.Second, "streaming again on a new walsender", func() bool {
		_, _, pid, _ := slotState(t, e)
		return pid != 0 && pid != stale && c.restartCount() >= 2
	})
	if took := time.Since(cut); took > 30*time.Second {
		t.Errorf("streaming resumed %v after the cut: the stale walsender was waited for", took)
	}
	if !strings.Contains(log.String(), "ended the walsender of an earlier replication connection") {
		t.Errorf("the stale walsender was not ended by the Source; log:\n%s", log.String())
	}
	e.insert(t, "after")
	waitFor(t, 10*time.Second, "the event", func() bool { return c.commitOf("after") != 0 })
}

// TestSourceEndsWhenServerChanges: a Source on a multi-host URL streams
// from the primary; once the primary is killed and its standby promoted,
// Run returns relay.ErrServerChanged instead of streaming from the new
// primary: the events it streamed belong to the old one. StreamFrom is told
// the server of each session.
func TestSourceEndsWhenServerChanges(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary := pgtest.NewCluster(t, pgtest.Options{})
	if err := primary.CreateDatabase(ctx, "relay"); err != nil {
		t.Fatal(err)
	}
	e := &testEnv{url: primary.URL("relay"), slot: "outbox_relay"}
	e.conn = mustConnect(t, e.url)
	if _, err := migrations.Migrate(ctx, e.conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{})
	e.conn = mustConnect(t, e.url)

	type bound struct {
		systemID string
		timeline int32
	}
	var mu sync.Mutex
	var calls []bound
	c := &fakeConsumer{}
	// The standby first: the Source must find the primary.
	cfg := e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url})
	cfg.ConnString = pgtest.MultiHostURL("relay", standby, primary)
	cfg.StreamFrom = func(_ context.Context, systemID string, timeline int32) error {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, bound{systemID, timeline})
		return nil
	}
	src, err := replication.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	waitStreaming(t, c, 1)
	e.insert(t, "before")
	waitFor(t, 10*time.Second, "the event", func() bool { return c.commitOf("before") != 0 })

	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, relay.ErrServerChanged) {
			t.Fatalf("Run = %v, want ErrServerChanged", err)
		}
		t.Logf("Run: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("Run did not end after the failover")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) == 0 || calls[0].timeline != 1 {
		t.Errorf("StreamFrom calls %v, want the first on timeline 1", calls)
	}
}

// TestCheckpointOnAnotherServerEndsSource: a checkpoint refused because the
// server written to is not the one streamed from (the pool reached a
// promoted standby, or a second primary, before the stream did) ends the
// session and Run with relay.ErrServerChanged, instead of holding the
// acknowledgement back forever.
func TestCheckpointOnAnotherServerEndsSource(t *testing.T) {
	e := newEnv(t)
	c := &fakeConsumer{}
	cp := &fakeCheckpoint{failWith: fmt.Errorf("save checkpoint: %w: the server is on timeline 2", relay.ErrServerChanged)}
	src, err := replication.New(e.config(t, c, cp, &claimRecorder{url: e.url}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	waitStreaming(t, c, 1)
	e.insert(t, "event")
	waitFor(t, 10*time.Second, "the event", func() bool { return c.commitOf("event") != 0 })
	cp.setFail(true)
	select {
	case err := <-done:
		if !errors.Is(err, relay.ErrServerChanged) {
			t.Fatalf("Run = %v, want ErrServerChanged", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Run goes on although its checkpoints land on another server")
	}
}
