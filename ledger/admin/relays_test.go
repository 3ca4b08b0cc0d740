package admin_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// statementLog records the statements run through it.
type statementLog struct {
	db  admin.DB
	sql []string
}

func (l *statementLog) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	l.sql = append(l.sql, sql)
	return l.db.Exec(ctx, sql, args...)
}

func (l *statementLog) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	l.sql = append(l.sql, sql)
	return l.db.Query(ctx, sql, args...)
}

func (l *statementLog) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	l.sql = append(l.sql, sql)
	return l.db.QueryRow(ctx, sql, args...)
}

// TestReadRelays_NeverReadsTheOutbox: the relays' part of the status — the
// slot with its retained WAL and its lag behind the server's position, the
// checkpoint — comes from the server's views and the checkpoint's row
// alone, so the admin API may ask for it every few seconds.
func TestReadRelays_NeverReadsTheOutbox(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	MustExec(t, f.pool, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	MustExec(t, f.pool, "INSERT INTO "+f.tables.Checkpoint.Quoted()+" (slot_name, confirmed_lsn) VALUES ('outbox_relay', '0/16B3F10')")
	f.MustInsert(t, row{key: "a", status: "failed"})
	MustExec(t, f.pool, "SELECT pg_switch_wal()") // WAL the slot has not confirmed

	log := &statementLog{db: f.pool}
	st, err := admin.ReadRelays(ctx, log, f.tables, admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")})
	if err != nil {
		t.Fatal(err)
	}
	if !st.Slot.Exists || st.Slot.LagBytes == nil || *st.Slot.LagBytes <= 0 || st.Slot.RetainedWALBytes == nil ||
		st.Checkpoint == nil || st.Checkpoint.ConfirmedLSN != "0/16B3F10" || st.Mode != admin.ModeStopped {
		t.Errorf("relays: %+v, slot %+v", st, st.Slot)
	}
	if len(st.Rows) != 0 || len(st.DeliveredLastHour) != 0 {
		t.Errorf("ReadRelays counted rows: %v, %v", st.Rows, st.DeliveredLastHour)
	}
	for _, sql := range log.sql {
		if strings.Contains(sql, f.tables.Outbox.Quoted()) || strings.Contains(sql, f.tables.Ledger.Quoted()) {
			t.Errorf("ReadRelays reads the outbox or the ledger:\n%s", sql)
		}
	}

	// ReadStatus is ReadRelays and the counts.
	full, err := admin.ReadStatus(ctx, f.pool, f.tables, admin.Where{Slot: "outbox_relay", LeaderKey: ledger.LeaderLockKey("outbox_relay")})
	if err != nil || full.Rows["failed"] != 1 || full.Failed != 1 || full.Slot.LagBytes == nil {
		t.Errorf("status: %+v, %v", full, err)
	}
}
