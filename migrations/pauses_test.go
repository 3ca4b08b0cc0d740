package migrations_test

import (
	"context"
	"testing"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// TestMigrate_SinkPauses: migration 016 creates the paused sinks' table
// beside the outbox, and a database at 015 gets it from migrate.
func TestMigrate_SinkPauses(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustMigrate(t, conn, migrations.Options{})

	pauses := migrations.SinkPausesTable(relay.QualifiedName{Schema: "public", Name: "integration_outbox"})
	cols := func() string {
		var cols *string
		if err := conn.QueryRow(ctx, `SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
			FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped`, pauses.Quoted()).Scan(&cols); err != nil {
			t.Fatalf("read %s: %v", pauses, err)
		}
		if cols == nil {
			return ""
		}
		return *cols
	}
	const want = "sink text, paused_at timestamp with time zone, reason text, paused_by text"
	if got := cols(); got != want {
		t.Errorf("%s columns: %s, want %s", pauses, got, want)
	}

	mustExec(t, conn, "DROP TABLE "+pauses.Quoted())
	mustExec(t, conn, `UPDATE integration_outbox_relay_version SET version = 15`)
	res := mustMigrate(t, conn, migrations.Options{})
	if res.From != 15 || res.To != migrations.Latest() {
		t.Fatalf("from %d to %d, want 15 → %d", res.From, res.To, migrations.Latest())
	}
	if got := cols(); got != want {
		t.Errorf("%s after 015 → 016: %s, want %s", pauses, got, want)
	}
}
