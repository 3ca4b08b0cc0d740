package admin_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// MustConnect opens a connection with application_name app.
func MustConnect(tb testing.TB, url, app string) *pgx.Conn {
	tb.Helper()
	cc, err := pgx.ParseConfig(url)
	if err != nil {
		tb.Fatal(err)
	}
	cc.RuntimeParams["application_name"] = app
	conn, err := pgx.ConnectConfig(context.Background(), cc)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// MustStream starts streaming from slot on a replication connection named
// app and returns the connection (its walsender holds the slot).
func MustStream(tb testing.TB, url, slot, publication, app string) *pgconn.PgConn {
	tb.Helper()
	ctx := context.Background()
	pc, err := pgconn.ParseConfig(url)
	if err != nil {
		tb.Fatal(err)
	}
	pc.RuntimeParams["replication"] = "database"
	pc.RuntimeParams["application_name"] = app
	conn, err := pgconn.ConnectConfig(ctx, pc)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close(context.Background()) })
	// The walsender of a stream closed a moment ago may still hold the slot
	// (55006 object_in_use): it exits on its own.
	deadline := time.Now().Add(10 * time.Second)
	for {
		err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
			PluginArgs: []string{"proto_version '1'", fmt.Sprintf("publication_names '%s'", publication)},
		})
		pgErr, _ := errors.AsType[*pgconn.PgError](err)
		if err == nil || pgErr == nil || pgErr.Code != "55006" || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		tb.Fatalf("start replication: %v", err)
	}
	return conn
}

func TestReadStatus_Counts(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustInsert(t, row{key: "p1", status: "pending", created: 10 * time.Minute})
	f.MustInsert(t, row{key: "p2", status: "pending", created: time.Minute})
	f.MustInsert(t, row{key: "h", status: "held"})
	f.MustInsert(t, row{key: "f1", status: "failed"})
	f.MustInsert(t, row{key: "f2", status: "failed"})
	f.MustInsert(t, row{key: "d", status: "done"})
	f.MustInsert(t, row{key: "x", status: "discarded"})
	f.MustLedger(t, "d", "nats", "delivered", 10*time.Minute)
	f.MustLedger(t, "d", "n8n", "delivered", 2*time.Hour) // not in the last hour
	f.MustLedger(t, "h", "n8n", "unknown", 0)
	f.MustLedger(t, "f1", "nats", "delivered", 0)
	// A NULL status is pending (ledger.Pending).
	MustExec(t, f.pool, "UPDATE "+f.tables.Outbox.Quoted()+" SET status = NULL WHERE event_key = 'p1'")

	st, err := admin.ReadStatus(ctx, f.pool, f.tables, admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"pending": 2, "processing": 0, "held": 1, "failed": 2, "done": 1, "discarded": 1}
	if fmt.Sprint(st.Rows) != fmt.Sprint(want) || st.Held != 1 || st.Failed != 2 {
		t.Fatalf("rows %v held %d failed %d, want %v", st.Rows, st.Held, st.Failed, want)
	}
	if st.OldestPendingSeconds == nil || *st.OldestPendingSeconds < 595 || *st.OldestPendingSeconds > 700 {
		t.Fatalf("oldest pending %v s, want about 600", st.OldestPendingSeconds)
	}
	if fmt.Sprint(st.DeliveredLastHour) != "map[nats:2]" {
		t.Fatalf("delivered last hour: %v", st.DeliveredLastHour)
	}
	if st.Mode != admin.ModeStopped || st.Leader != nil || st.Slot.Exists || st.Relays != 0 || len(st.Connections) != 0 || st.Checkpoint != nil {
		t.Fatalf("status of a database without relays: %+v", st)
	}

	// Nothing pending: no age.
	MustExec(t, f.pool, "UPDATE "+f.tables.Outbox.Quoted()+" SET status = 'done' WHERE status = 'pending' OR status IS NULL")
	if st, err = admin.ReadStatus(ctx, f.pool, f.tables, admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")}); err != nil || st.OldestPendingSeconds != nil {
		t.Fatalf("oldest pending with none pending: %v %v", st.OldestPendingSeconds, err)
	}
}

func TestReadStatus_ModeAndLeader(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	read := func() *admin.Status {
		t.Helper()
		st, err := admin.ReadStatus(ctx, f.pool, f.tables, admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")})
		if err != nil {
			t.Fatal(err)
		}
		return st
	}

	// An operator command's session is not a relay.
	MustConnect(t, f.url, admin.CLIApplicationName)
	if st := read(); st.Mode != admin.ModeStopped {
		t.Fatalf("mode %s with only a CLI session, want stopped", st.Mode)
	}

	// A relay polling: connected, no slot.
	poller := MustConnect(t, f.url, "outbox-relay")
	st := read()
	if st.Mode != admin.ModePoll || len(st.Connections) != 1 || st.Connections[0].PID != int32(poller.PgConn().PID()) || st.Leader != nil {
		t.Fatalf("polling relay: %+v", st)
	}

	// It takes the leader lock.
	MustExec(t, poller, "SELECT pg_advisory_lock($1)", ledger.LeaderLockKey("outbox_relay"))
	st = read()
	if st.Leader == nil || st.Leader.By != "lock" || st.Leader.PID != int32(poller.PgConn().PID()) || st.Leader.ApplicationName != "outbox-relay" || st.Leader.BackendStart == nil {
		t.Fatalf("leader by lock: %+v", st.Leader)
	}
	// A lock on another key is not the leader's.
	MustExec(t, poller, "SELECT pg_advisory_unlock($1)", ledger.LeaderLockKey("outbox_relay"))
	MustExec(t, poller, "SELECT pg_advisory_lock($1)", ledger.LeaderLockKey("another_slot"))
	if st = read(); st.Leader != nil {
		t.Fatalf("leader from another lock: %+v", st.Leader)
	}
	// Keys with the sign bit set split into classid/objid the same way.
	MustExec(t, poller, "SELECT pg_advisory_lock(-5)")
	if st, err := admin.ReadStatus(ctx, f.pool, f.tables, admin.Where{Slot: "outbox_relay", LeaderKey: -5}); err != nil || st.Leader == nil || st.Leader.By != "lock" {
		t.Fatalf("leader by a negative key: %+v %v", st, err)
	}

	// A slot that exists but is not consumed.
	MustExec(t, f.pool, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	MustExec(t, f.pool, "INSERT INTO "+f.tables.Checkpoint.Quoted()+" (slot_name, confirmed_lsn) VALUES ('outbox_relay', '0/16B3F10')")
	st = read()
	if !st.Slot.Exists || st.Slot.Active || st.Slot.WALStatus != "reserved" || st.Slot.RetainedWALBytes == nil || st.Slot.ConfirmedFlushLSN == "" || st.Mode != admin.ModePoll {
		t.Fatalf("idle slot: %+v mode %s", st.Slot, st.Mode)
	}
	if st.Checkpoint == nil || st.Checkpoint.ConfirmedLSN != "0/16B3F10" {
		t.Fatalf("checkpoint: %+v", st.Checkpoint)
	}

	// Streaming: replication mode, the walsender leads (no lock held).
	stream := MustStream(t, f.url, "outbox_relay", "outbox_relay", "outbox-relay")
	waitFor(t, func() bool { return read().Slot.Active })
	st = read()
	if st.Mode != admin.ModeReplication || st.Slot.Holder == nil || st.Slot.Holder.PID != int32(stream.PID()) ||
		st.Leader == nil || st.Leader.By != "slot" || st.Leader.PID != int32(stream.PID()) {
		t.Fatalf("streaming: mode %s slot %+v leader %+v", st.Mode, st.Slot, st.Leader)
	}
	if len(st.Connections) != 2 {
		t.Fatalf("connections: %+v, want the poller and the walsender", st.Connections)
	}
}

// mustSlot reads the slot outbox_relay of f's database, as status does.
func mustSlot(tb testing.TB, f *fixture) admin.SlotStatus {
	tb.Helper()
	s, err := admin.ReadSlot(context.Background(), f.pool, admin.Where{Slot: "outbox_relay"})
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// TestReadStatus_RelaysAreNotConnections: a relay holds several sessions
// (its leader lock, its owner lock, its walsender); status counts relays
// by the one session each holds — for the slot's leader lock, held or
// waited for — and lists every connection apart. A relay of another slot
// is not this slot's; relays in poll mode hold no leader session and are
// counted by their owner locks.
func TestReadStatus_RelaysAreNotConnections(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	read := func() *admin.Status {
		t.Helper()
		st, err := admin.ReadStatus(ctx, f.pool, f.tables, admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")})
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	// Poll mode: two relays, each with its owner lock.
	owner1 := MustConnect(t, f.url, "outbox-relay owner lock")
	MustConnect(t, f.url, "outbox-relay owner lock")
	if st := read(); st.Relays != 2 || len(st.Connections) != 2 {
		t.Fatalf("two polling relays: relays %d, connections %+v", st.Relays, st.Connections)
	}
	owner1.Close(ctx)

	// One relay streaming: leader lock, owner lock, walsender.
	leader := MustConnect(t, f.url, "outbox-relay leader outbox_relay")
	MustExec(t, leader, "SELECT pg_advisory_lock($1)", ledger.LeaderLockKey("outbox_relay"))
	MustExec(t, f.pool, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	MustStream(t, f.url, "outbox_relay", "outbox_relay", "outbox-relay")
	waitFor(t, func() bool { return read().Slot.Active })
	if st := read(); st.Relays != 1 || len(st.Connections) != 3 || st.Mode != admin.ModeReplication || st.Slot.Server != "primary" {
		t.Fatalf("one streaming relay: relays %d, connections %+v, mode %s, slot on %q", st.Relays, st.Connections, st.Mode, st.Slot.Server)
	}

	// A second relay stands by, waiting for the lock; a relay of another
	// slot is not counted, though its session is a connection.
	MustConnect(t, f.url, "outbox-relay leader outbox_relay")
	MustConnect(t, f.url, "outbox-relay leader another_slot")
	if st := read(); st.Relays != 2 || len(st.Connections) != 5 {
		t.Fatalf("a standby relay and another slot's: relays %d, connections %d", st.Relays, len(st.Connections))
	}
}

// TestReadStatus_StandbyUnreachable: with source.standby_url the slot is
// the standby's; when the standby cannot be reached status says so instead
// of reading the primary's slot of that name.
func TestReadStatus_StandbyUnreachable(t *testing.T) {
	f := MustFixture(t)
	MustExec(t, f.pool, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	st, err := admin.ReadStatus(context.Background(), f.pool, f.tables,
		admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay"), StandbyErr: errors.New("connection refused")})
	if err != nil {
		t.Fatal(err)
	}
	if st.Slot.Server != "standby" || st.Slot.Exists || !strings.Contains(st.Slot.Error, "connection refused") {
		t.Fatalf("slot %+v, want the standby's, unknown, with the reason", st.Slot)
	}
}

// TestReadProgress: what status can know of a stall from the tables. Rows
// that have waited longer than stall_after on a path that shows no
// progress as long are a stall; rows that wait while the path progresses
// are a note (a backlog, or rows the stream will never send).
func TestReadProgress(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	const stallAfter = 5 * time.Minute
	read := func() *admin.Progress {
		t.Helper()
		p, err := admin.ReadProgress(ctx, f.pool, f.tables, mustSlot(t, f), stallAfter)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	outbox, checkpoint := f.tables.Outbox.Quoted(), f.tables.Checkpoint.Quoted()

	// Nothing waits.
	f.MustInsert(t, row{key: "new", created: time.Minute})
	if p := read(); p.Stalled != "" || p.Note != "" || p.StreamWaiting != 0 || p.ClaimWaiting != 0 {
		t.Fatalf("a row a minute old: %+v", p)
	}

	// No slot: every pending row is the claim path's; one due 10 minutes
	// ago (of its own aggregate: it waits behind nothing), and the claim
	// path has never done anything.
	f.MustInsert(t, row{key: "old", created: 10 * time.Minute})
	MustExec(t, f.pool, "UPDATE "+outbox+" SET available_at = now() - interval '10 minutes', aggregate_id = 'A2' WHERE event_key = 'old'")
	p := read()
	if p.ClaimWaiting != 1 || p.StreamWaiting != 0 || !strings.Contains(p.Stalled, "the claim path last claimed or settled a row never while 1 rows due have waited longer than 5m0s (the oldest 10m0s)") {
		t.Fatalf("claim path, no activity: %+v", p)
	}
	// It claimed a row a moment ago: a backlog, not a stall.
	f.MustInsert(t, row{key: "claimed", status: "processing"})
	MustExec(t, f.pool, "UPDATE "+outbox+" SET locked_at = now() WHERE event_key = 'claimed'")
	if p := read(); p.Stalled != "" || !strings.Contains(p.Note, "1 rows due for the claim path have waited longer than 5m0s") {
		t.Fatalf("claim path working: %+v", p)
	}
	MustExec(t, f.pool, "UPDATE "+outbox+" SET locked_at = now() - interval '6 minutes' WHERE event_key = 'claimed'")
	if p := read(); !strings.Contains(p.Stalled, "the claim path last claimed or settled a row 6m0s ago") {
		t.Fatalf("claim path quiet for 6m: %+v", p)
	}
	f.MustLedger(t, "claimed", "n8n", "delivered", time.Second)
	if p := read(); p.Stalled != "" {
		t.Fatalf("a ledger delivery a second ago: %+v", p)
	}

	// A slot: the row not diverted is the stream's, and the stream has
	// never written its checkpoint.
	MustExec(t, f.pool, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	p = read()
	if p.StreamWaiting != 1 || p.ClaimWaiting != 0 || !strings.Contains(p.Stalled, "the stream last wrote its checkpoint never while 1 rows it owns have waited longer than 5m0s (the oldest 10m0s)") {
		t.Fatalf("stream, no checkpoint: %+v", p)
	}
	MustExec(t, f.pool, "INSERT INTO "+checkpoint+" (slot_name, confirmed_lsn, updated_at) VALUES ('outbox_relay', '0/1', now() - interval '7 minutes')")
	if p := read(); !strings.Contains(p.Stalled, "the stream last wrote its checkpoint 7m0s ago") {
		t.Fatalf("stream, checkpoint 7m old: %+v", p)
	}
	// It checkpoints: the row is one it may never stream.
	MustExec(t, f.pool, "UPDATE "+checkpoint+" SET updated_at = now()")
	if p := read(); p.Stalled != "" || !strings.Contains(p.Note, "outbox-relay reconcile") {
		t.Fatalf("stream checkpointing: %+v", p)
	}
	// Settled by the stream (its status written with its ledger row):
	// nothing waits.
	f.MustLedger(t, "old", "nats", "delivered", time.Second)
	MustExec(t, f.pool, "UPDATE "+outbox+" SET status = 'done', processed_at = now() WHERE event_key = 'old'")
	if p := read(); p.StreamWaiting != 0 || p.Stalled != "" || p.Note != "" {
		t.Fatalf("the old row delivered: %+v", p)
	}
	// Diverted instead, it is the claim path's, whose last sign of life
	// is the settlement above.
	MustExec(t, f.pool, "DELETE FROM "+f.tables.Ledger.Quoted()+" WHERE event_key = 'old'")
	MustExec(t, f.pool, "UPDATE "+outbox+" SET status = 'pending', handoff_at = now() WHERE event_key = 'old'")
	if p := read(); p.StreamWaiting != 0 || p.ClaimWaiting != 1 || p.Stalled != "" {
		t.Fatalf("diverted: %+v", p)
	}
	MustExec(t, f.pool, "SELECT pg_drop_replication_slot('outbox_relay')")
}

// TestReadProgress_HeldAggregateIsNoStall: a held row blocks its aggregate
// until a person decides (dlq); the next row of that aggregate, due long
// ago, correctly waits and is not claimed. The stall detector counts only
// rows the claim query could take: on an idle database this is no stall.
// Before, status reported the claim path STALLED ("1 rows due have waited
// longer than 5m").
func TestReadProgress_HeldAggregateIsNoStall(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustInsert(t, row{key: "held", status: "held", created: 20 * time.Minute})
	f.MustInsert(t, row{key: "next", created: 10 * time.Minute}) // the same aggregate, due 10 minutes ago
	MustExec(t, f.pool, "UPDATE "+f.tables.Outbox.Quoted()+" SET handoff_at = now() - interval '10 minutes', available_at = now() - interval '10 minutes' WHERE event_key = 'next'")
	p, err := admin.ReadProgress(ctx, f.pool, f.tables, mustSlot(t, f), 5*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if p.Stalled != "" || p.ClaimWaiting != 0 {
		t.Fatalf("a row waiting behind a held one: %+v, want no stall and nothing the claim path could take", p)
	}
	// A row of another aggregate due as long ago is a stall.
	MustExec(t, f.pool, "INSERT INTO "+f.tables.Outbox.Quoted()+` (event_type, aggregate_type, aggregate_id, event_key, payload, created_at, available_at, handoff_at)
		VALUES ('order.created', 'order', 'B2', 'other', '{}', now() - interval '10 minutes', now() - interval '10 minutes', now())`)
	if p, err = admin.ReadProgress(ctx, f.pool, f.tables, mustSlot(t, f), 5*time.Minute); err != nil || p.ClaimWaiting != 1 || p.Stalled == "" {
		t.Fatalf("a row of another aggregate: %+v, %v; want it waiting and a stall", p, err)
	}
}

// TestReadStatus_SinksDown: the pending rows whose last attempt found a
// configured sink down (its failure's class, or its circuit open), per
// sink, with the newest row's reason; rows waiting for another reason, or
// no longer pending, are not counted.
func TestReadStatus_SinksDown(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.tables.Sinks = []admin.Sink{{Name: "nats"}, {Name: "n8n"}, {Name: "nats2"}}
	f.MustInsert(t, row{key: "a", lastError: "sink nats: sink-down: publish a: nats connection to nats://n1:4222 is RECONNECTING"})
	f.MustInsert(t, row{key: "b", lastError: "sink n8n: transient: 503; sink nats: circuit open: sink is down"})
	f.MustInsert(t, row{key: "c", lastError: "sink n8n: transient: 503 Service Unavailable"})
	f.MustInsert(t, row{key: "d", status: "failed", lastError: "sink n8n: sink-down: 401"})

	st, err := admin.ReadStatus(ctx, f.pool, f.tables, admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]admin.SinkDown{"nats": {Waiting: 2, LastError: "sink n8n: transient: 503; sink nats: circuit open: sink is down"}}
	if fmt.Sprint(st.SinksDown) != fmt.Sprint(want) {
		t.Fatalf("sinks down: %+v, want %+v", st.SinksDown, want)
	}
}
