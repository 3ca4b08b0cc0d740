package ledger_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

func TestCheckpoint(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()

	if lsn, err := f.store.LoadCheckpoint(ctx, "slot_a"); err != nil || lsn != 0 {
		t.Fatalf("LoadCheckpoint(no row) = %v, %v; want 0, nil", lsn, err)
	}
	high := relay.LSN(0x16_B374D848)
	steps := []struct {
		name string
		save relay.LSN
		want relay.LSN
	}{
		{"first save", 0x1_00000000, 0x1_00000000},
		{"forward", high, high},
		{"repeat", high, high},
		{"backwards is ignored", 0x1_00000000, high},
		{"zero is ignored", 0, high},
	}
	for _, step := range steps {
		if err := f.store.SaveCheckpoint(ctx, "slot_a", step.save); err != nil {
			t.Fatalf("%s: SaveCheckpoint(%v): %v", step.name, step.save, err)
		}
		got, err := f.store.LoadCheckpoint(ctx, "slot_a")
		if err != nil || got != step.want {
			t.Errorf("%s: LoadCheckpoint = %v, %v; want %v", step.name, got, err, step.want)
		}
	}
	var text string
	if err := f.pool.QueryRow(ctx, "SELECT confirmed_lsn::text FROM relay_checkpoint WHERE slot_name = 'slot_a'").Scan(&text); err != nil || text != "16/B374D848" {
		t.Errorf("stored confirmed_lsn = %q, %v; want 16/B374D848", text, err)
	}

	if lsn, err := f.store.LoadCheckpoint(ctx, "slot_b"); err != nil || lsn != 0 {
		t.Errorf("LoadCheckpoint(other slot) = %v, %v; want 0, nil", lsn, err)
	}
}

// TestSaveCheckpointSynchronous saves with synchronous_commit = off as the
// database default and checks the setting the transaction ran with.
func TestSaveCheckpointSynchronous(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	var db string
	if err := f.pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	f.MustExec(t, "ALTER DATABASE "+relay.QuoteIdentifier(db)+" SET synchronous_commit = off")
	f.pool.Reset() // new connections pick up the database default
	f.MustExec(t, `CREATE TABLE commit_modes (mode text)`)
	f.MustExec(t, `CREATE FUNCTION record_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO commit_modes VALUES (current_setting('synchronous_commit')); RETURN NEW; END $$`)
	f.MustExec(t, `CREATE TRIGGER record_commit_mode BEFORE INSERT OR UPDATE ON relay_checkpoint
		FOR EACH ROW EXECUTE FUNCTION record_commit_mode()`)

	var def string
	if err := f.pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&def); err != nil || def != "off" {
		t.Fatalf("database default synchronous_commit = %q, %v; want off", def, err)
	}
	if err := f.store.SaveCheckpoint(ctx, "slot", 1); err != nil {
		t.Fatalf("SaveCheckpoint: %v", err)
	}
	var mode string
	if err := f.pool.QueryRow(ctx, "SELECT mode FROM commit_modes").Scan(&mode); err != nil || mode != "on" {
		t.Errorf("SaveCheckpoint ran with synchronous_commit = %q, %v; want on", mode, err)
	}
}

// TestDeliveredRowsMeetAConcurrentWriterOfTheSamePairs: the stream writes
// the delivered ledger rows of pairs it did not claim with a plain INSERT
// of the pairs the ledger lacks (a speculative insertion, ON CONFLICT,
// costs more per row and doubles the WAL records the walsender decodes);
// a pair another session inserts at the same moment — two relays around a
// takeover — is then a unique violation when that session commits.
// SettleStream must still succeed, each pair recorded once: the write is
// made again the careful way. Pairs already delivered and repeats in one
// batch are left out by the plain INSERT itself.
func TestDeliveredRowsMeetAConcurrentWriterOfTheSamePairs(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at) VALUES ('e1', 's', 'delivered', 1, now())`)

	other, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := other.Exec(ctx, `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at) VALUES ('e3', 's', 'delivered', 1, now())`); err != nil {
		t.Fatal(err)
	}
	done := relay.Decision{Kind: relay.Done}
	works := []*relay.Work{ // e1 recorded, e2 twice, e3 being inserted by the other session
		streamWork(1, "e1", done, outcomePair("s", relay.Delivered)),
		streamWork(2, "e2", done, outcomePair("s", relay.Delivered)),
		streamWork(2, "e2", done, outcomePair("s", relay.Delivered)),
		streamWork(3, "e3", done, outcomePair("s", relay.Delivered)),
		streamWork(4, "e4", done, outcomePair("s", relay.Delivered)),
	}
	settled := make(chan error, 1)
	go func() {
		_, err := f.store.SettleStream(ctx, works, "relay-a")
		settled <- err
	}()
	// The INSERT waits for the other session's e3.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var waiting bool
		if err := f.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO%integration_idempotency%' AND pid <> pg_backend_pid())`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the ledger INSERT never waited for the other session's pair")
		}
	}
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-settled; err != nil {
		t.Fatalf("SettleStream after another session recorded one of its pairs: %v", err)
	}
	var keys []string
	if err := f.pool.QueryRow(ctx, `SELECT array_agg(event_key ORDER BY event_key) FROM integration_idempotency WHERE state = 'delivered'`).Scan(&keys); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(keys, []string{"e1", "e2", "e3", "e4"}) {
		t.Errorf("delivered ledger rows = %v, want e1 e2 e3 e4 once each", keys)
	}
}
