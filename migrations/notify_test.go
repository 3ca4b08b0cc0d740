package migrations_test

import (
	"context"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// TestMigrate_NotifyState: migration 015 creates the dead-letter notifier's
// table and the partial index of the failed and held rows in settlement
// order; an INVALID build of that index is dropped and built again, like
// the other indexes on the outbox.
func TestMigrate_NotifyState(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustMigrate(t, conn, migrations.Options{})

	state := migrations.NotifyStateTable(relay.QualifiedName{Schema: "public", Name: "integration_outbox"})
	var cols string
	if err := conn.QueryRow(ctx, `SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
		FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped`, state.Quoted()).Scan(&cols); err != nil {
		t.Fatalf("read %s: %v", state, err)
	}
	if want := "channel text, notified_at timestamp with time zone, notified_id bigint, sent_at timestamp with time zone, attempted_at timestamp with time zone, attempted_by text"; cols != want {
		t.Errorf("%s columns: %s, want %s", state, cols, want)
	}

	const index = "integration_outbox_relay_dead_idx"
	var def string
	if err := conn.QueryRow(ctx, "SELECT pg_get_indexdef($1::regclass)", index).Scan(&def); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(def, "(processed_at, id)") || !strings.Contains(def, "'failed'::text, 'held'::text") {
		t.Errorf("dead-letter index: %s", def)
	}

	mustExec(t, conn, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = '`+index+`'::regclass`)
	mustExec(t, conn, `UPDATE integration_outbox_relay_version SET version = 14`)
	var oldOID uint32
	if err := conn.QueryRow(ctx, "SELECT $1::regclass::oid", index).Scan(&oldOID); err != nil {
		t.Fatal(err)
	}
	res := mustMigrate(t, conn, migrations.Options{})
	if res.From != 14 || res.To != migrations.Latest() {
		t.Fatalf("from %d to %d, want 14 → %d", res.From, res.To, migrations.Latest())
	}
	var valid bool
	var newOID uint32
	if err := conn.QueryRow(ctx, `SELECT indisvalid, indexrelid FROM pg_index WHERE indexrelid = $1::regclass`, index).Scan(&valid, &newOID); err != nil {
		t.Fatal(err)
	}
	if !valid || newOID == oldOID {
		t.Fatalf("index valid=%v rebuilt=%v, want a new valid index", valid, newOID != oldOID)
	}
}
