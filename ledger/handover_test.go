package ledger_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// createdSlot is a slot made by MustCreateSlot.
type createdSlot struct {
	name       string
	snapshot   string         // the exported snapshot
	consistent relay.LSN      // the slot's consistent point
	repl       *pgconn.PgConn // the replication connection that made it
}

// MustCreateSlot creates a temporary logical slot with an exported snapshot
// on a new replication connection, which stays open (and idle, keeping the
// snapshot) until the test ends.
func (f *fixture) MustCreateSlot(tb testing.TB) createdSlot {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	repl, err := pgconn.Connect(ctx, f.url+"&replication=database")
	if err != nil {
		tb.Fatalf("replication connect: %v", err)
	}
	tb.Cleanup(func() { _ = repl.Close(context.Background()) })
	// Slot names are cluster-wide: reuse the database name's random suffix.
	slot := f.MustSlotName(tb)
	res, err := pglogrepl.CreateReplicationSlot(ctx, repl, slot, "pgoutput",
		pglogrepl.CreateReplicationSlotOptions{Temporary: true, SnapshotAction: "EXPORT_SNAPSHOT"})
	if err != nil {
		tb.Fatalf("create slot: %v", err)
	}
	if res.SnapshotName == "" {
		tb.Fatal("create slot: no snapshot exported")
	}
	consistent, err := relay.ParseLSN(res.ConsistentPoint)
	if err != nil {
		tb.Fatalf("create slot: consistent point: %v", err)
	}
	return createdSlot{name: slot, snapshot: res.SnapshotName, consistent: consistent, repl: repl}
}

// MustSlotName is the name MustCreateSlot gives the fixture's slot.
func (f *fixture) MustSlotName(tb testing.TB) string {
	tb.Helper()
	var db string
	if err := f.pool.QueryRow(context.Background(), "SELECT current_database()").Scan(&db); err != nil {
		tb.Fatal(err)
	}
	return "ledger_test_" + db[len(db)-12:]
}

// mustOpenHandOver makes a new slot for the fixture the way the stream
// source does (BeginSlot, then the slot with its exported snapshot) and
// opens its hand-over on store.
func (f *fixture) mustOpenHandOver(tb testing.TB, store *ledger.Store) (slot string, created createdSlot, h relay.HandOverRows) {
	tb.Helper()
	ctx := context.Background()
	slot = f.MustSlotName(tb)
	if err := store.BeginSlot(ctx, slot); err != nil {
		tb.Fatalf("BeginSlot: %v", err)
	}
	created = f.MustCreateSlot(tb)
	h, err := store.OpenHandOver(ctx, created.snapshot)
	if err != nil {
		tb.Fatalf("OpenHandOver: %v", err)
	}
	return slot, created, h
}

// handOverRecord is the checkpoint row of slot: handover_lsn (0 when NULL)
// and confirmed_lsn.
func (f *fixture) handOverRecord(tb testing.TB, slot string) (handover, confirmed relay.LSN) {
	tb.Helper()
	var h *string
	err := f.pool.QueryRow(context.Background(),
		`SELECT handover_lsn::text, confirmed_lsn::text FROM relay_checkpoint WHERE slot_name = $1`, slot).Scan(&h, &confirmed)
	if err != nil {
		tb.Fatalf("read the checkpoint row of %s: %v", slot, err)
	}
	if h != nil {
		if handover, err = relay.ParseLSN(*h); err != nil {
			tb.Fatal(err)
		}
	}
	return handover, confirmed
}

// handOver runs a whole hand-over of the slot's snapshot: open, read the
// aggregates, deliver into a feedLog.
func (f *fixture) handOver(ctx context.Context, slot string, created createdSlot) (aggs []relay.AggregateKey, fed *feedLog, err error) {
	h, err := f.store.OpenHandOver(ctx, created.snapshot)
	if err != nil {
		return nil, nil, err
	}
	defer h.Close()
	if aggs, err = h.Aggregates(ctx); err != nil {
		return nil, nil, err
	}
	fed = &feedLog{}
	n, err := fed.deliver(ctx, h, slot, created.consistent)
	if err == nil && n != int64(len(fed.events)) {
		err = fmt.Errorf("Deliver reported %d rows, fed %d", n, len(fed.events))
	}
	return aggs, fed, err
}

// feedLog records what a hand-over's Deliver gives its consumer: the rows
// fed, in order, the size of each feed, the aggregates reported fed after
// each slice, and how many rows had been fed when settled was called.
type feedLog struct {
	events    []*relay.Event
	feeds     []int
	reports   [][]string
	settledAt []int
	// onFeed and onSettled, when set, run in feed and settled; an error
	// fails the call.
	onFeed    func([]*relay.Event) error
	onSettled func() error
}

func (l *feedLog) deliver(ctx context.Context, h relay.HandOverRows, slot string, consistent relay.LSN) (int64, error) {
	return h.Deliver(ctx, slot, consistent, l.feed, l.fed, l.settled)
}

func (l *feedLog) feed(_ context.Context, events []*relay.Event) error {
	if l.onFeed != nil {
		if err := l.onFeed(events); err != nil {
			return err
		}
	}
	l.events = append(l.events, events...)
	l.feeds = append(l.feeds, len(events))
	return nil
}

func (l *feedLog) fed(aggs []relay.AggregateKey) {
	var ids []string
	for _, a := range aggs {
		ids = append(ids, a.ID)
	}
	slices.Sort(ids)
	l.reports = append(l.reports, ids)
}

func (l *feedLog) settled(context.Context) error {
	l.settledAt = append(l.settledAt, len(l.events))
	if l.onSettled != nil {
		return l.onSettled()
	}
	return nil
}

// keys returns the event keys fed, in order.
func (l *feedLog) keys() []string {
	var out []string
	for _, ev := range l.events {
		out = append(out, ev.EventKey)
	}
	return out
}

// ids returns the ids fed, in order.
func (l *feedLog) ids() []int64 {
	var out []int64
	for _, ev := range l.events {
		out = append(out, ev.ID)
	}
	return out
}

func TestHandOver(t *testing.T) {
	tests := []struct {
		name string
		// changeAfterSlot updates a row that was pending before the slot, in
		// a transaction that commits after the snapshot: it is delivered
		// all the same, as it reads then (by id, at READ COMMITTED).
		changeAfterSlot bool
	}{
		{name: "in the snapshot"},
		{name: "row changed after the snapshot", changeAfterSlot: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := MustFixture(t)
			ctx := context.Background()
			before := f.MustInsert(t,
				row{Key: "pending-1", AggType: ptr("order"), AggID: ptr("1")},
				row{Key: "pending-2", AggType: ptr("order"), AggID: ptr("1")},
				row{Key: "pending-null-available", NoAvailableAt: true},
				row{Key: "diverted", Diverted: true},
				row{Key: "done", Status: "done"},
				row{Key: "processing", Status: "processing"},
			)
			pending := before[:3]
			availableAt := f.MustRow(t, pending[0]).AvailableAt

			slot := f.MustSlotName(t)
			if err := f.store.BeginSlot(ctx, slot); err != nil {
				t.Fatalf("BeginSlot: %v", err)
			}
			created := f.MustCreateSlot(t)
			after := f.MustInsert(t, row{Key: "after-slot"})
			if tt.changeAfterSlot {
				f.MustExec(t, "UPDATE integration_outbox SET attempts = attempts + 1 WHERE id = $1", pending[1])
			}
			if done, err := f.store.HandedOver(ctx, slot); err != nil || done {
				t.Fatalf("HandedOver before the hand-over = %v, %v; want false", done, err)
			}

			aggs, fed, err := f.handOver(ctx, slot, created)
			if err != nil {
				t.Fatalf("hand-over: %v", err)
			}
			// Exactly the rows pending before the slot, not diverted: in
			// id order within their aggregate, the unordered one first.
			if got, want := fed.keys(), []string{"pending-null-available", "pending-1", "pending-2"}; !slices.Equal(got, want) {
				t.Errorf("rows fed %q, want %q", got, want)
			}
			if len(fed.settledAt) != 1 || fed.settledAt[0] != 3 {
				t.Errorf("settled waited for at %v rows fed, want once, after all 3", fed.settledAt)
			}
			// The pending rows' aggregates; rows without one are not ordered.
			if want := []relay.AggregateKey{{Type: "order", ID: "1"}}; !slices.Equal(aggs, want) {
				t.Errorf("Aggregates = %v, want %v", aggs, want)
			}
			for _, ev := range fed.events {
				if ev.Status != "pending" || !ev.CommitTime.IsZero() || ev.Payload == nil || ev.CreatedAt.IsZero() {
					t.Errorf("row fed %+v: want status pending, a payload, created_at, no commit time", ev)
				}
				switch ev.EventKey {
				case "pending-1":
					if !ev.AvailableAt.Equal(availableAt) || deref(ev.AggregateID) != "1" {
						t.Errorf("row fed %+v: want available_at %v and aggregate 1", ev, availableAt)
					}
				case "pending-2":
					if tt.changeAfterSlot && ev.Attempts != 1 {
						t.Errorf("row changed after the snapshot fed with attempts %d, want 1 (read now)", ev.Attempts)
					}
				case "pending-null-available":
					if !ev.AvailableAt.IsZero() {
						t.Errorf("row without available_at fed with %v, want zero", ev.AvailableAt)
					}
				}
			}
			// Nothing is marked for the claim path.
			for _, id := range append(before[:3], after...) {
				if got := f.MustRow(t, id); got.DivertedAt != nil {
					t.Errorf("row %d marked for the claim path, want untouched", id)
				}
			}
			// The hand-over is recorded at the consistent point.
			if done, err := f.store.HandedOver(ctx, slot); err != nil || !done {
				t.Errorf("HandedOver after the hand-over = %v, %v; want true", done, err)
			}
			if handover, confirmed := f.handOverRecord(t, slot); handover != created.consistent || confirmed < created.consistent {
				t.Errorf("handover_lsn %s, confirmed_lsn %s; want both at the consistent point %s", handover, confirmed, created.consistent)
			}
		})
	}
}

// TestHandOverFreesTheSlotAndDeliversInSlices: once OpenHandOver returns,
// the replication connection that exported the snapshot may run other
// commands (the slot streams while the rows are delivered), and Deliver
// still feeds exactly the rows pending in the snapshot — a slice at a
// time — and records the hand-over last.
func TestHandOverFreesTheSlotAndDeliversInSlices(t *testing.T) {
	defer ledger.SetHandOverSlice(5_000)()
	f := MustFixture(t)
	ctx := context.Background()
	const n = 12_000 // more than two slices
	f.MustExec(t, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'test.event', 'order', (g % 7)::text, 'backlog-' || g, '{}' FROM generate_series(1, $1::int) AS g`, n)
	slot, created, h := f.mustOpenHandOver(t, f.store)
	defer h.Close()
	// The exporting connection runs another command: its snapshot is gone;
	// the hand-over has read what it needs.
	if _, err := pglogrepl.IdentifySystem(ctx, created.repl); err != nil {
		t.Fatalf("IDENTIFY_SYSTEM on the slot's connection: %v", err)
	}
	after := f.MustInsert(t, row{Key: "after-slot", AggType: ptr("order"), AggID: ptr("1")})

	aggs, err := h.Aggregates(ctx)
	if err != nil {
		t.Fatalf("Aggregates: %v", err)
	}
	if len(aggs) != 7 {
		t.Errorf("Aggregates = %v, want the 7 aggregates of the backlog", aggs)
	}
	if done, err := f.store.HandedOver(ctx, slot); err != nil || done {
		t.Fatalf("HandedOver before Deliver = %v, %v; want false", done, err)
	}
	fed := &feedLog{onSettled: func() error {
		if done, err := f.store.HandedOver(ctx, slot); err != nil || done {
			t.Errorf("HandedOver while the rows settle = %v, %v; want false", done, err)
		}
		return nil
	}}
	delivered, err := fed.deliver(ctx, h, slot, created.consistent)
	if err != nil {
		t.Fatalf("Deliver: %v", err)
	}
	if delivered != n || len(fed.events) != n {
		t.Errorf("Deliver reported %d rows and fed %d, want %d", delivered, len(fed.events), n)
	}
	if slices.Contains(fed.ids(), after[0]) {
		t.Errorf("row committed after the slot fed")
	}
	if want := []int{5_000, 5_000, 2_000}; !slices.Equal(fed.feeds, want) {
		t.Errorf("fed in slices of %v, want %v", fed.feeds, want)
	}
	if got := f.MustCount(t, `SELECT count(*) FROM integration_outbox WHERE handoff_at IS NOT NULL`); got != 0 {
		t.Errorf("%d rows marked for the claim path, want none", got)
	}
	if done, err := f.store.HandedOver(ctx, slot); err != nil || !done {
		t.Errorf("HandedOver after Deliver = %v, %v; want true", done, err)
	}
}

// TestHandOverFeedsTheSmallestAggregatesFirst: the hand-over feeds the
// aggregates with the fewest rows first (a live aggregate's last row, which
// its new events wait behind), each from its oldest row, and rows without
// an aggregate before them all.
func TestHandOverFeedsTheSmallestAggregatesFirst(t *testing.T) {
	defer ledger.SetHandOverSlice(1)()
	f := MustFixture(t)
	ctx := context.Background()
	ids := f.MustInsert(t,
		row{Key: "big-1", AggType: ptr("order"), AggID: ptr("big")},
		row{Key: "big-2", AggType: ptr("order"), AggID: ptr("big")},
		row{Key: "small", AggType: ptr("order"), AggID: ptr("small")},
		row{Key: "big-3", AggType: ptr("order"), AggID: ptr("big")},
		row{Key: "unordered"},
	)
	slot := f.MustSlotName(t)
	if err := f.store.BeginSlot(ctx, slot); err != nil {
		t.Fatal(err)
	}
	_, fed, err := f.handOver(ctx, slot, f.MustCreateSlot(t))
	if err != nil {
		t.Fatalf("hand-over: %v", err)
	}
	if want := []int64{ids[4], ids[2], ids[0], ids[1], ids[3]}; !slices.Equal(fed.ids(), want) {
		t.Errorf("fed in the order %v, want %v (unordered, small, then big from its oldest)", fed.ids(), want)
	}
}

func TestHandOverBadSnapshot(t *testing.T) {
	f := MustFixture(t)
	if err := f.store.BeginSlot(context.Background(), "slot"); err != nil {
		t.Fatal(err)
	}
	for _, snapshot := range []string{"", "00000003-00000002-1", "x'; DROP TABLE integration_outbox; --"} {
		if h, err := f.store.OpenHandOver(context.Background(), snapshot); err == nil {
			h.Close()
			t.Errorf("OpenHandOver(%q) = nil, want an error", snapshot)
		} else if snapshot != "" && !strings.Contains(err.Error(), "import snapshot") {
			t.Errorf("OpenHandOver(%q) = %v, want the import error", snapshot, err)
		}
	}
	if n := f.MustCount(t, "SELECT count(*) FROM integration_outbox"); n != 0 {
		t.Errorf("count = %d", n)
	}
	if done, err := f.store.HandedOver(context.Background(), "slot"); err != nil || done {
		t.Errorf("HandedOver after failed hand-overs = %v, %v; want false", done, err)
	}
}

// TestHandOverRecord: BeginSlot records that a slot's hand-over has not
// happened (HandedOver false) until the hand-over records it; checkpoints
// saved since keep the record; a BeginSlot for a new slot of the same name
// clears it again without moving the confirmed position back.
func TestHandOverRecord(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	if done, err := f.store.HandedOver(ctx, "no_such_slot"); err != nil || done {
		t.Fatalf("HandedOver(no checkpoint row) = %v, %v; want false", done, err)
	}

	slot := f.MustSlotName(t)
	for range 2 { // safe to repeat
		if err := f.store.BeginSlot(ctx, slot); err != nil {
			t.Fatalf("BeginSlot: %v", err)
		}
	}
	if done, err := f.store.HandedOver(ctx, slot); err != nil || done {
		t.Fatalf("HandedOver after BeginSlot = %v, %v; want false", done, err)
	}
	if lsn, err := f.store.LoadCheckpoint(ctx, slot); err != nil || lsn != 0 {
		t.Fatalf("LoadCheckpoint after BeginSlot = %v, %v; want 0", lsn, err)
	}

	created := f.MustCreateSlot(t)
	if _, _, err := f.handOver(ctx, slot, created); err != nil {
		t.Fatalf("hand-over: %v", err)
	}
	if done, err := f.store.HandedOver(ctx, slot); err != nil || !done {
		t.Fatalf("HandedOver after the hand-over = %v, %v; want true", done, err)
	}
	// The confirmed position starts at the consistent point: the slot
	// never streams anything before it.
	if lsn, err := f.store.LoadCheckpoint(ctx, slot); err != nil || lsn != created.consistent {
		t.Errorf("LoadCheckpoint after the hand-over = %v, %v; want the consistent point %s", lsn, err, created.consistent)
	}

	ahead := created.consistent + 0x1000
	if err := f.store.SaveCheckpoint(ctx, slot, ahead); err != nil {
		t.Fatalf("SaveCheckpoint: %v", err)
	}
	if done, err := f.store.HandedOver(ctx, slot); err != nil || !done {
		t.Errorf("HandedOver after SaveCheckpoint = %v, %v; want true", done, err)
	}
	if handover, _ := f.handOverRecord(t, slot); handover != created.consistent {
		t.Errorf("handover_lsn = %s after SaveCheckpoint, want %s kept", handover, created.consistent)
	}

	// The slot is made again (dropped, lost): not handed over until the
	// new slot's hand-over, and the checkpoint does not move back.
	if err := f.store.BeginSlot(ctx, slot); err != nil {
		t.Fatalf("BeginSlot: %v", err)
	}
	if done, err := f.store.HandedOver(ctx, slot); err != nil || done {
		t.Errorf("HandedOver after a second BeginSlot = %v, %v; want false", done, err)
	}
	if lsn, err := f.store.LoadCheckpoint(ctx, slot); err != nil || lsn != ahead {
		t.Errorf("LoadCheckpoint after a second BeginSlot = %v, %v; want %s kept", lsn, err, ahead)
	}
}

// TestHandOverRecordBackfilled: a checkpoint row written before migration
// 007 belongs to a slot whose hand-over finished (a relay saved its first
// checkpoint only after its slot's hand-over), so migrating marks it handed
// over and the slot is kept. The migrator cannot stop at version 6, so the test
// migrates fully and then puts the schema back as version 6 left it: the
// column dropped, the version table at 6, a checkpoint row as that relay
// wrote it. Migrate then runs the real 007.
func TestHandOverRecordBackfilled(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustExec(t, `ALTER TABLE relay_checkpoint DROP COLUMN handover_lsn`)
	f.MustExec(t, `UPDATE integration_outbox_relay_version SET version = 6`)
	f.MustExec(t, `INSERT INTO relay_checkpoint (slot_name, confirmed_lsn) VALUES ('old_slot', '16/B374D848')`)

	conn, err := pgx.Connect(ctx, f.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	res, err := migrations.Migrate(ctx, conn, migrations.Options{Names: f.names})
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if res.From != 6 || len(res.Applied) == 0 || res.Applied[0] != "007_handover_record" {
		t.Fatalf("migrate from %d applied %v, want from 6: 007_handover_record and the later ones", res.From, res.Applied)
	}

	if done, err := f.store.HandedOver(ctx, "old_slot"); err != nil || !done {
		t.Errorf("HandedOver(checkpoint from before 007) = %v, %v; want true", done, err)
	}
	if handover, confirmed := f.handOverRecord(t, "old_slot"); handover != confirmed || confirmed != 0x16_B374D848 {
		t.Errorf("handover_lsn %s, confirmed_lsn %s; want both 16/B374D848", handover, confirmed)
	}
}

// TestPendingScanWaitsForAHandOver: while a new slot's hand-over delivers
// the rows pending before it, the pending scan reports none of them stuck
// (they are being delivered; during a long hand-over the alarm told the
// operator to run reconcile), and it resumes once the hand-over ends.
func TestPendingScanWaitsForAHandOver(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	store := f.store
	f.MustInsert(t, row{Key: "backlog-1"}, row{Key: "backlog-2"})
	time.Sleep(10 * time.Millisecond)
	if n, _, err := store.Stuck(ctx, 0); err != nil || n != 2 {
		t.Fatalf("Stuck before the hand-over = %d, %v; want the 2 rows", n, err)
	}
	slot, created, h := f.mustOpenHandOver(t, store)
	if n, _, err := store.Stuck(ctx, 0); err != nil || n != 0 {
		t.Errorf("Stuck while the hand-over delivers = %d, %v; want 0", n, err)
	}
	fed := &feedLog{}
	fed.onSettled = func() error {
		if n, _, err := store.Stuck(ctx, 0); err != nil || n != 0 {
			t.Errorf("Stuck while the hand-over's rows settle = %d, %v; want 0", n, err)
		}
		// As the engine settles them: delivered and marked done.
		f.MustExec(t, `UPDATE integration_outbox SET status = 'done' WHERE id = ANY($1)`, fed.ids())
		return nil
	}
	if _, err := fed.deliver(ctx, h, slot, created.consistent); err != nil {
		t.Fatal(err)
	}
	h.Close() // after Deliver: a no-op
	f.MustInsert(t, row{Key: "after"})
	time.Sleep(10 * time.Millisecond)
	if n, _, err := store.Stuck(ctx, 0); err != nil || n != 1 {
		t.Errorf("Stuck after the hand-over = %d, %v; want 1 (the row after it; the backlog is delivered)", n, err)
	}
}

// TestHandOverClosedFeedsNothing: a hand-over closed before its Deliver
// (its session ended) cannot record itself as done without its rows.
func TestHandOverClosedFeedsNothing(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustInsert(t, row{Key: "backlog"})
	slot, created, h := f.mustOpenHandOver(t, f.store)
	// Until its rows are read the hand-over holds the snapshot, in two
	// transactions on connections of the pool (the read's and Pending's);
	// Close ends them.
	if n := f.pool.Stat().AcquiredConns(); n != 2 {
		t.Errorf("%d connections acquired while the snapshot is held, want 2", n)
	}
	h.Close()
	if n := f.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections acquired after Close, want 0: the snapshot's transaction is left open", n)
	}
	if aggs, err := h.Aggregates(ctx); err == nil {
		t.Errorf("Aggregates after Close = %v, nil; want an error", aggs)
	}
	fed := &feedLog{}
	if n, err := fed.deliver(ctx, h, slot, created.consistent); err == nil || len(fed.events) != 0 {
		t.Errorf("Deliver after Close = %d, nil, %d rows fed; want an error and none", n, len(fed.events))
	}
	if done, err := f.store.HandedOver(ctx, slot); err != nil || done {
		t.Errorf("HandedOver = %v, %v; want false", done, err)
	}
}

// TestHandOverReadsItsSnapshotWhenAsked: OpenHandOver only imports the
// snapshot (the slot streams while the rows are read); the rows Aggregates
// reads later are still the snapshot's, not those committed since, and the
// read lets the snapshot's transaction go.
func TestHandOverReadsItsSnapshotWhenAsked(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustInsert(t, row{Key: "backlog", AggType: ptr("order"), AggID: ptr("1")})
	_, _, h := f.mustOpenHandOver(t, f.store)
	defer h.Close()
	f.MustInsert(t, row{Key: "streamed", AggType: ptr("order"), AggID: ptr("2")})
	aggs, err := h.Aggregates(ctx)
	if err != nil {
		t.Fatalf("Aggregates: %v", err)
	}
	if want := []relay.AggregateKey{{Type: "order", ID: "1"}}; !slices.Equal(aggs, want) || h.Len() != 1 {
		t.Errorf("read %d rows of aggregates %v, want 1 of %v (the snapshot's)", h.Len(), aggs, want)
	}
	if n := f.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections acquired after the read, want 0: the snapshot's transaction is left open", n)
	}
	if again, err := h.Aggregates(ctx); err != nil || !slices.Equal(again, aggs) {
		t.Errorf("Aggregates again = %v, %v; want the same, read once", again, err)
	}
}

// TestHandOverPendingAsksTheSnapshot: while the rows are not read yet,
// Pending answers from the snapshot (the stream's first events ask it);
// after the read, from the rows read, with the same answer: the aggregates
// with rows pending and not diverted in the snapshot.
func TestHandOverPendingAsksTheSnapshot(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustInsert(t,
		row{Key: "one", AggType: ptr("order"), AggID: ptr("1")},
		row{Key: "handed", AggType: ptr("order"), AggID: ptr("2"), Diverted: true})
	_, _, h := f.mustOpenHandOver(t, f.store)
	defer h.Close()
	f.MustInsert(t, row{Key: "after", AggType: ptr("order"), AggID: ptr("3")})
	ask := []relay.AggregateKey{{Type: "order", ID: "1"}, {Type: "order", ID: "2"}, {Type: "order", ID: "3"}, {Type: "order", ID: "4"}}
	want := []relay.AggregateKey{{Type: "order", ID: "1"}}
	if got, err := h.Pending(ctx, ask); err != nil || !slices.Equal(got, want) {
		t.Errorf("Pending before the read = %v, %v; want %v", got, err, want)
	}
	if _, err := h.Aggregates(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err := h.Pending(ctx, ask); err != nil || !slices.Equal(got, want) {
		t.Errorf("Pending after the read = %v, %v; want %v", got, err, want)
	}
	h.Close()
	if got, err := h.Pending(ctx, ask); err == nil {
		t.Errorf("Pending after Close = %v, nil; want an error", got)
	}
}

// TestHandOverEarlyFeedsTheNewestCompleteAggregates: before the read ends,
// NewestUnblocked feeds the newest rows whose aggregates have no other row pending in
// the snapshot (the events committed just before the slot), in id order,
// with rows without an aggregate; an aggregate with an older row waits for
// Deliver, which leaves NewestUnblocked's rows out and counts them.
func TestHandOverEarlyFeedsTheNewestCompleteAggregates(t *testing.T) {
	defer ledger.SetEarlySlice(4)()
	f := MustFixture(t)
	ctx := context.Background()
	agg := func(key, id string) row { return row{Key: key, AggType: ptr("order"), AggID: ptr(id)} }
	f.MustInsert(t, agg("big-1", "big"), agg("big-2", "big"), agg("big-3", "big"),
		agg("s1", "s1"), agg("s2-1", "s2"), row{Key: "free"}, agg("s2-2", "s2"), agg("big-4", "big"))
	slot, created, h := f.mustOpenHandOver(t, f.store)
	defer h.Close()
	events, aggs, err := h.NewestUnblocked(ctx)
	if err != nil {
		t.Fatalf("NewestUnblocked: %v", err)
	}
	early := &feedLog{events: events}
	// The newest four: s2-1, free, s2-2, big-4; big has older rows.
	if got := early.keys(); !slices.Equal(got, []string{"s2-1", "free", "s2-2"}) {
		t.Errorf("NewestUnblocked fed %v, want [s2-1 free s2-2]", got)
	}
	if want := []relay.AggregateKey{{Type: "order", ID: "s2"}}; !slices.Equal(aggs, want) {
		t.Errorf("NewestUnblocked's aggregates %v, want %v", aggs, want)
	}
	if _, err := h.Aggregates(ctx); err != nil {
		t.Fatal(err)
	}
	fed := &feedLog{}
	n, err := fed.deliver(ctx, h, slot, created.consistent)
	if err != nil {
		t.Fatalf("Deliver: %v", err)
	}
	if got := fed.keys(); !slices.Equal(got, []string{"s1", "big-1", "big-2", "big-3", "big-4"}) {
		t.Errorf("Deliver fed %v, want [s1 big-1 big-2 big-3 big-4] (NewestUnblocked's rows left out)", got)
	}
	if n != 8 {
		t.Errorf("Deliver reported %d rows, want 8 (NewestUnblocked's three counted)", n)
	}
}

// TestHandOverEarlyAfterTheReadFeedsNothing: once the read is done Deliver
// has every row; NewestUnblocked leaves them to it.
func TestHandOverEarlyAfterTheReadFeedsNothing(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustInsert(t, row{Key: "s1", AggType: ptr("order"), AggID: ptr("s1")})
	_, _, h := f.mustOpenHandOver(t, f.store)
	defer h.Close()
	if _, err := h.Aggregates(ctx); err != nil {
		t.Fatal(err)
	}
	if events, aggs, err := h.NewestUnblocked(ctx); err != nil || len(events)+len(aggs) != 0 {
		t.Errorf("NewestUnblocked after the read = %d rows, %v, %v; want nothing", len(events), aggs, err)
	}
}

// TestHandOverReportsEachAggregateOnceFed: after each slice Deliver
// reports the aggregates whose every row it has now fed, so the stream's
// pin on them ends then, not with the whole hand-over; it waits for the
// rows to settle once, after the last slice, before the record
// (docs/architecture.md, "Slot creation").
func TestHandOverReportsEachAggregateOnceFed(t *testing.T) {
	defer ledger.SetHandOverSlice(2)()
	f := MustFixture(t)
	ctx := context.Background()
	// Aggregates a and b of a row each, c of three: slices a1 b1 | c1 c2 | c3.
	f.MustExec(t, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'test.event', 'order', a, 'backlog-' || g, '{}'
		  FROM unnest(ARRAY['c', 'a', 'c', 'b', 'c']) WITH ORDINALITY AS u(a, g)`)
	slot, created, h := f.mustOpenHandOver(t, f.store)
	defer h.Close()
	fed := &feedLog{}
	if n, err := fed.deliver(ctx, h, slot, created.consistent); err != nil || n != 5 {
		t.Fatalf("Deliver = %d, %v; want 5 rows", n, err)
	}
	if want := []int{2, 2, 1}; !slices.Equal(fed.feeds, want) {
		t.Errorf("fed %v rows at a time, want %v", fed.feeds, want)
	}
	if want := [][]string{{"a", "b"}, nil, {"c"}}; !slices.EqualFunc(fed.reports, want, slices.Equal) {
		t.Errorf("aggregates reported fed after each slice: %q, want %q", fed.reports, want)
	}
	if want := []string{"backlog-2", "backlog-4", "backlog-1", "backlog-3", "backlog-5"}; !slices.Equal(fed.keys(), want) {
		t.Errorf("fed %q, want %q", fed.keys(), want)
	}
	if !slices.Equal(fed.settledAt, []int{5}) {
		t.Errorf("settled waited for at %v rows fed, want once after all 5", fed.settledAt)
	}
	if done, err := f.store.HandedOver(ctx, slot); err != nil || !done {
		t.Errorf("HandedOver after Deliver = %v, %v; want true", done, err)
	}
}

// TestHandOverLeavesOutRowsSettledSinceTheSnapshot: a row of the snapshot
// that another relay settled (its status done), diverted or claimed
// before its slice is read is not fed again.
func TestHandOverLeavesOutRowsSettledSinceTheSnapshot(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	store := f.store
	ids := f.MustInsert(t, row{Key: "delivered"}, row{Key: "diverted"}, row{Key: "claimed"}, row{Key: "kept"})
	slot, created, h := f.mustOpenHandOver(t, store)
	defer h.Close()
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts) VALUES ('delivered', 'nats', 'delivered', 1)`)
	f.MustExec(t, `UPDATE integration_outbox SET status = 'done', processed_at = now() WHERE id = $1`, ids[0])
	f.MustExec(t, `UPDATE integration_outbox SET handoff_at = now() WHERE id = $1`, ids[1])
	f.MustExec(t, `UPDATE integration_outbox SET status = 'processing' WHERE id = $1`, ids[2])
	fed := &feedLog{}
	if n, err := fed.deliver(ctx, h, slot, created.consistent); err != nil || n != 1 {
		t.Fatalf("Deliver = %d, %v; want 1 row", n, err)
	}
	if want := []string{"kept"}; !slices.Equal(fed.keys(), want) {
		t.Errorf("fed %q, want %q", fed.keys(), want)
	}
}

// TestHandOverEndsWhenItsFeedFails: a feed that fails (the session's
// context ended, the engine stopped) or a settlement that does not finish
// ends the hand-over without its record, so the next session makes the
// slot again.
func TestHandOverEndsWhenItsFeedFails(t *testing.T) {
	defer ledger.SetHandOverSlice(2)()
	for _, failSettled := range []bool{false, true} {
		t.Run(fmt.Sprintf("settled fails %v", failSettled), func(t *testing.T) {
			f := MustFixture(t)
			ctx := context.Background()
			f.MustExec(t, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
				SELECT 'test.event', 'order', g::text, 'backlog-' || g, '{}' FROM generate_series(1, 5) AS g`)
			slot, created, h := f.mustOpenHandOver(t, f.store)
			defer h.Close()
			fed := &feedLog{}
			want := 5
			if failSettled {
				fed.onSettled = func() error { return relay.ErrEngineStopped }
			} else {
				want = 2
				fed.onFeed = func([]*relay.Event) error {
					if len(fed.events) == 2 {
						return context.Canceled
					}
					return nil
				}
			}
			n, err := fed.deliver(ctx, h, slot, created.consistent)
			if err == nil || n != int64(want) {
				t.Errorf("Deliver = %d, %v; want %d rows and an error", n, err, want)
			}
			if done, err := f.store.HandedOver(ctx, slot); err != nil || done {
				t.Errorf("HandedOver after a hand-over that failed = %v, %v; want false", done, err)
			}
		})
	}
}
