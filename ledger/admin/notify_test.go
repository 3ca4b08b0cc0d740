package admin_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/notify"
)

// MustNotifyStore returns the notifier's store on f's outbox for owner.
func (f *fixture) MustNotifyStore(tb testing.TB, owner string) *admin.NotifyStore {
	tb.Helper()
	tables, err := admin.Resolve(context.Background(), f.pool, f.tables)
	if err != nil {
		tb.Fatal(err)
	}
	s, err := admin.NewNotifyStore(context.Background(), f.pool, tables.Outbox, owner)
	if err != nil {
		tb.Fatalf("NewNotifyStore: %v", err)
	}
	return s
}

// MustRead returns every dead letter Read returns after from.
func MustRead(tb testing.TB, s *admin.NotifyStore, from notify.Mark) []notify.DeadLetter {
	tb.Helper()
	var out []notify.DeadLetter
	n, err := s.Read(context.Background(), from, 1000, func(d notify.DeadLetter) { out = append(out, d) })
	if err != nil || n != len(out) {
		tb.Fatalf("Read = %d, %v (%d rows)", n, err, len(out))
	}
	return out
}

// mustDeadLetter marks row id failed, now, naming sink, on db.
func mustDeadLetter(tb testing.TB, db admin.DB, t admin.Tables, id int64, sink string) {
	tb.Helper()
	MustExec(tb, db, fmt.Sprintf(`UPDATE %s SET status = 'failed', processed_at = now(), last_error = $2 WHERE id = $1`,
		t.Outbox.Quoted()), id, "sink "+sink+": 400")
}

func ids(ds []notify.DeadLetter) []int64 {
	var out []int64
	for _, d := range ds {
		out = append(out, d.ID)
	}
	return out
}

// TestNotifyStore_ReadWaitsForOpenTransactions: a row dead-lettered by a
// transaction still open, and a later one already committed, are not read
// until the first commits; then both are, in the order they were settled.
// Read earlier, the later row would move the mark past the first, which
// would never be notified.
func TestNotifyStore_ReadWaitsForOpenTransactions(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	s := f.MustNotifyStore(t, "relay-a")
	marks, err := s.Marks(ctx, []string{"n8n"})
	if err != nil {
		t.Fatal(err)
	}
	first, later := f.MustInsert(t, row{key: "first"}), f.MustInsert(t, row{key: "later"})

	tx, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	mustDeadLetter(t, tx, f.tables, first, "n8n")
	time.Sleep(10 * time.Millisecond) // a later now() for the second
	mustDeadLetter(t, f.pool, f.tables, later, "n8n")

	if got := MustRead(t, s, marks["n8n"]); len(got) != 0 {
		t.Fatalf("read %v while the first dead letter's transaction is open, want nothing", ids(got))
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got := MustRead(t, s, marks["n8n"])
	if len(got) != 2 || got[0].ID != first || got[1].ID != later || !got[0].At.Before(got[1].At) {
		t.Fatalf("read %+v, want %d then %d", got, first, later)
	}
	if got[0].EventKey != "first" || got[0].Status != "failed" || got[0].LastError != "sink n8n: 400" {
		t.Errorf("dead letter %+v", got[0])
	}
	if rest := MustRead(t, s, got[0].Mark); len(rest) != 1 || rest[0].ID != later {
		t.Errorf("read after the first: %v, want %d", ids(rest), later)
	}
}

// TestNotifyStore_Marks: a channel's first mark is where it starts: dead
// letters settled before it are not read after it; marks move forward only.
func TestNotifyStore_Marks(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	s := f.MustNotifyStore(t, "relay-a")
	before := f.MustInsert(t, row{key: "before", status: "failed", lastError: "sink n8n: 400", processed: time.Second})

	marks, err := s.Marks(ctx, []string{"n8n", notify.AnySink})
	if err != nil || len(marks) != 2 {
		t.Fatalf("Marks = %v, %v", marks, err)
	}
	after := f.MustInsert(t, row{key: "after"})
	mustDeadLetter(t, f.pool, f.tables, after, "n8n")
	if got := ids(MustRead(t, s, marks["n8n"])); len(got) != 1 || got[0] != after {
		t.Fatalf("read %v after the first mark, want only %d (not %d, settled before)", got, after, before)
	}
	again, err := s.Marks(ctx, []string{"n8n", notify.AnySink, "nats"})
	if err != nil || again["n8n"] != marks["n8n"] || again[notify.AnySink] != marks[notify.AnySink] || len(again) != 3 {
		t.Fatalf("Marks again = %v, %v; want the same marks and a new one for nats", again, err)
	}

	to := MustRead(t, s, marks["n8n"])[0].Mark
	if err := s.Pass(ctx, []string{"n8n", notify.AnySink}, to); err != nil {
		t.Fatal(err)
	}
	if err := s.Pass(ctx, []string{"n8n"}, marks["n8n"]); err != nil { // backwards: no change
		t.Fatal(err)
	}
	if got, _ := s.Marks(ctx, []string{"n8n", notify.AnySink}); got["n8n"] != to || got[notify.AnySink] != to {
		t.Errorf("marks %v after Pass, want both at %v", got, to)
	}
}

// TestNotifyStore_Claim: of two relays, one claims a channel's next
// notification; nobody claims it again within the interval, nor with a mark
// that moved; Record moves the mark only for the claim's holder.
func TestNotifyStore_Claim(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	a, b := f.MustNotifyStore(t, "relay-a"), f.MustNotifyStore(t, "relay-b")
	marks, err := a.Marks(ctx, []string{"n8n"})
	if err != nil {
		t.Fatal(err)
	}
	from := marks["n8n"]
	to := notify.Mark{At: from.At.Add(time.Second), ID: 42}

	claim, ok, err := a.Claim(ctx, "n8n", from, time.Hour)
	if err != nil || !ok || claim.Channel != "n8n" || claim.At.IsZero() {
		t.Fatalf("first Claim = %+v, %v, %v; want it taken", claim, ok, err)
	}
	if _, ok, err := b.Claim(ctx, "n8n", from, time.Hour); err != nil || ok {
		t.Fatalf("second relay's Claim within the interval = %v, %v; want refused", ok, err)
	}
	if ok, err := b.Record(ctx, notify.Claim{Channel: "n8n", At: claim.At}, to); err != nil || ok {
		t.Fatalf("Record by a relay without the claim = %v, %v; want refused", ok, err)
	}
	if ok, err := a.Record(ctx, claim, to); err != nil || !ok {
		t.Fatalf("Record = %v, %v", ok, err)
	}
	if got, _ := a.Marks(ctx, []string{"n8n"}); got["n8n"] != to {
		t.Fatalf("mark %v after Record, want %v", got["n8n"], to)
	}
	// The interval has passed (0): the mark read before is stale all the same.
	if _, ok, err := b.Claim(ctx, "n8n", from, 0); err != nil || ok {
		t.Fatalf("Claim from the old mark = %v, %v; want refused", ok, err)
	}
	if _, ok, err := b.Claim(ctx, "n8n", to, 0); err != nil || !ok {
		t.Fatalf("Claim from the new mark after the interval = %v, %v; want it taken", ok, err)
	}
	var sentAt *time.Time
	if err := f.pool.QueryRow(ctx, fmt.Sprintf(`SELECT sent_at FROM %s WHERE channel = 'n8n'`,
		migrations.NotifyStateTable(relay.QualifiedName{Schema: "public", Name: "integration_outbox"}).Quoted())).Scan(&sentAt); err != nil || sentAt == nil {
		t.Errorf("sent_at = %v, %v; want the time of the recorded notification", sentAt, err)
	}
}

// TestNotifyStore_ReadUsesTheDeadLetterIndex: the read goes through the
// partial index of failed and held rows, not a scan of the outbox.
func TestNotifyStore_ReadUsesTheDeadLetterIndex(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	MustExec(t, f.pool, `INSERT INTO integration_outbox (event_type, event_key, payload, status, last_error, processed_at)
		SELECT 'order.created', 'k-' || g, '{}', CASE WHEN g % 500 = 0 THEN 'failed' ELSE 'done' END, 'sink n8n: 400', now()
		  FROM generate_series(1, 50000) AS g`)
	MustExec(t, f.pool, `ANALYZE integration_outbox`)
	var plan []string
	rows, err := f.pool.Query(ctx, "EXPLAIN (COSTS OFF) "+admin.NotifyReadSQL(relay.QualifiedName{Schema: "public", Name: "integration_outbox"}),
		time.Now().Add(-time.Hour), int64(0), time.Now(), 1000)
	if err != nil {
		t.Fatal(err)
	}
	if plan, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	text := strings.Join(plan, "\n")
	t.Logf("plan:\n%s", text)
	if !strings.Contains(text, "integration_outbox_relay_dead_idx") || regexp.MustCompile(`Seq Scan on integration_outbox\b`).MatchString(text) {
		t.Errorf("the read does not use the dead-letter index:\n%s", text)
	}
}

// TestNewNotifyStore_NeedsItsTable: without the grant, or before migrate,
// the store is refused with the fix.
func TestNewNotifyStore_NeedsItsTable(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	roleURL, role := MustRole(t, f.url, "", "GRANT USAGE ON SCHEMA public TO {{role}}")
	pool, err := pgxpool.New(ctx, roleURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	outbox := relay.QualifiedName{Schema: "public", Name: "integration_outbox"}
	_, err = admin.NewNotifyStore(ctx, pool, outbox, "relay-a")
	var perr *admin.PrivilegeError
	if !errors.As(err, &perr) || perr.Role != role || !strings.Contains(err.Error(), `GRANT SELECT, INSERT, UPDATE ON "public"."integration_outbox_relay_notify"`) {
		t.Fatalf("NewNotifyStore without the grant = %v, want a PrivilegeError with the GRANT", err)
	}

	MustExec(t, f.pool, "DROP TABLE "+migrations.NotifyStateTable(outbox).Quoted())
	if _, err := admin.NewNotifyStore(ctx, f.pool, outbox, "relay-a"); err == nil || !strings.Contains(err.Error(), "run outbox-relay migrate") {
		t.Fatalf("NewNotifyStore without its table = %v, want one that says to migrate", err)
	}
}

// TestNotifyStore_IdlePassWritesNothing: a pass with nothing new — the
// marks read, the horizon and the dead letters after the mark — takes no
// transaction id: it writes nothing, WAL included.
func TestNotifyStore_IdlePassWritesNothing(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	outbox := relay.QualifiedName{Schema: "public", Name: "integration_outbox"}
	f.MustNotifyStore(t, "relay-a").Marks(ctx, []string{"n8n", notify.AnySink}) // the marks exist
	f.MustInsert(t, row{key: "old", status: "failed", lastError: "sink n8n: 400", processed: time.Hour})

	err := pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
		s, err := admin.NewNotifyStore(ctx, tx, outbox, "relay-a")
		if err != nil {
			return err
		}
		marks, err := s.Marks(ctx, []string{"n8n", notify.AnySink})
		if err != nil || len(marks) != 2 {
			return fmt.Errorf("Marks = %v, %v", marks, err)
		}
		if n, err := s.Read(ctx, marks["n8n"], 1000, func(notify.DeadLetter) {}); err != nil || n != 0 {
			return fmt.Errorf("Read = %d, %v; want nothing new", n, err)
		}
		var xid *string
		if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id_if_assigned()::text`).Scan(&xid); err != nil {
			return err
		}
		if xid != nil {
			return fmt.Errorf("the pass took transaction id %s: it wrote", *xid)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestNotifyStore_OtherRolesDoNotHoldTheHorizon: an application's open
// transaction, under another role, does not hold notifications back; the
// relay's own role's does.
func TestNotifyStore_OtherRolesDoNotHoldTheHorizon(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	s := f.MustNotifyStore(t, "relay-a")
	marks, err := s.Marks(ctx, []string{"n8n"})
	if err != nil {
		t.Fatal(err)
	}
	appURL, _ := MustRole(t, f.url, "", "GRANT USAGE ON SCHEMA public TO {{role}}", "GRANT SELECT ON integration_outbox TO {{role}}")
	app, err := pgx.Connect(ctx, appURL)
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close(ctx)
	MustExec(t, app, "BEGIN")
	MustExec(t, app, "SELECT count(*) FROM integration_outbox")

	id := f.MustInsert(t, row{key: "k"})
	mustDeadLetter(t, f.pool, f.tables, id, "n8n")
	if got := ids(MustRead(t, s, marks["n8n"])); len(got) != 1 || got[0] != id {
		t.Fatalf("read %v with another role's transaction open, want %d", got, id)
	}
	MustExec(t, app, "ROLLBACK")
}
