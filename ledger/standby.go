package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The primary's side of decoding on a standby (docs/standby.md): the slot
// lives on a physical standby (source.standby_url), while the ledger, the
// checkpoint, the hand-over record and the claim path stay here, on the
// primary. The replication source asks the primary what it needs through
// these methods (replication.Primary).

// Identify returns the primary's system identifier and the timeline it
// writes WAL on: what IDENTIFY_SYSTEM on a standby that replays this
// primary's WAL reports as well. It only reads.
func (s *Store) Identify(ctx context.Context) (systemID string, timeline int32, err error) {
	if err := s.pool.QueryRow(ctx, catalog.Get("ServerTimeline")).Scan(&systemID, &timeline); err != nil {
		return "", 0, fmt.Errorf("identify the primary: %w", err)
	}
	return systemID, timeline, nil
}

// WALFlushPosition returns the primary's flushed WAL position
// (pg_current_wal_flush_lsn()): every transaction committed synchronously
// before the call, and every asynchronous one committed before such a
// commit, ends at or before it, and no standby has received WAL past it.
// It only reads.
func (s *Store) WALFlushPosition(ctx context.Context) (relay.LSN, error) {
	var lsn relay.LSN
	if err := s.pool.QueryRow(ctx, catalog.Get("WALFlushPosition")).Scan(&lsn); err != nil {
		return 0, fmt.Errorf("read the primary's flushed WAL position: %w", err)
	}
	return lsn, nil
}

// LogStandbySnapshot writes a running-transactions record on the primary
// (pg_log_standby_snapshot(), PostgreSQL 16+). A logical slot being created
// on a standby waits for one; the primary logs one by itself at most every
// 15 s, and only while it is busy. It returns an error wrapping
// ErrNoStandbySnapshotPrivilege when the role may not call the function.
// Safe to repeat.
func (s *Store) LogStandbySnapshot(ctx context.Context) error {
	_, err := s.pool.Exec(ctx, catalog.Get("LogStandbySnapshot"))
	if hasSQLState(err, "42501") {
		return fmt.Errorf("%w: %w", ErrNoStandbySnapshotPrivilege, err)
	}
	if err != nil {
		return fmt.Errorf("pg_log_standby_snapshot(): %w", err)
	}
	return nil
}

// ErrNoStandbySnapshotPrivilege says the role may not call
// pg_log_standby_snapshot() (GRANT EXECUTE ON FUNCTION
// pg_log_standby_snapshot() TO the role, as a superuser).
var ErrNoStandbySnapshotPrivilege = errors.New("the role may not call pg_log_standby_snapshot()")

// MarkForClaimFromStandby is the slot-creation hand-over of a slot made on
// a standby (docs/standby.md, "the hand-over on a standby"). The standby
// cannot be written, so it reads on standby, in the snapshot that
// CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT exported there, the ids of the
// rows pending and not diverted: the rows
// committed before the slot's consistent point, which it will never stream.
// Then, on the primary, in one transaction, it marks those of them still
// pending and not diverted for the claim path, by id, and records the
// hand-over of slot as done at consistent. It returns how many rows it
// marked.
//
// It is exact when nothing but the claim path's own rows changed on the
// primary between the consistent point and the marking, and the consistent
// point is at or after every write the relay made before the slot was
// created: the caller waits for the standby to replay the primary's
// flushed position (read after BeginSlot) before it creates the slot. The
// replication connection that created the slot must stay open and run
// nothing else until it returns. Safe to repeat with a fresh slot and
// snapshot; on an error, the caller drops the slot and starts over.
func (s *Store) MarkForClaimFromStandby(ctx context.Context, standby *pgx.Conn, slot, snapshot string, consistent relay.LSN) (int64, error) {
	if snapshot == "" {
		return 0, errors.New("mark rows for the claim path: empty snapshot name")
	}
	return s.markSnapshotIDs(ctx, standby, slot, snapshot, consistent)
}

// DropSlot drops the replication slot named slot on the primary if it
// exists and nobody streams from it, and reports whether it did. While the
// relay decodes on a standby, its slot of the same name on the primary (from
// before source.standby_url) only pins WAL there: the table keeps the
// events, and the standby slot's hand-over gives the claim path what that
// slot had not delivered.
func (s *Store) DropSlot(ctx context.Context, slot string) (bool, error) {
	tag, err := s.pool.Exec(ctx, catalog.Get("DropIdleSlot"), slot)
	if err != nil {
		return false, fmt.Errorf("drop slot %s on the primary: %w", slot, err)
	}
	return tag.RowsAffected() > 0, nil
}

// SetDecodingStandby names the physical slot (primary_slot_name) through
// which the standby the stream decodes on streams from the primary, "" for
// none. SaveCheckpoint then does not wait for that slot when the primary
// names it in synchronized_standby_slots: that standby's logical walsender
// waits, at a fast shutdown, for the relay to acknowledge what it sent, and
// the relay would wait for the standby's WAL receiver, already stopped. The
// stream waits for that standby itself, bounded (docs/standby.md). Safe to
// call concurrently with SaveCheckpoint.
func (s *Store) SetDecodingStandby(physicalSlot string) {
	s.decodingStandbySlot.Store(&physicalSlot)
}
