package replication

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/relay"
)

// failoverVersion is the first server_version_num whose logical slots can
// be synchronized to physical standbys (the slot's failover property,
// sync_replication_slots, synchronized_standby_slots): PostgreSQL 17.
const failoverVersion = 170000

// origin is a server as IDENTIFY_SYSTEM names it. A promoted standby keeps
// the system identifier and moves to a new timeline.
type origin struct {
	systemID string
	timeline int32
}

// checkOrigin ends the Source when a session streams from another server
// than the first one (a failover), and tells Config.StreamFrom which server
// this session streams from (docs/failover.md).
func (s *Source) checkOrigin(ctx context.Context, sys pglogrepl.IdentifySystemResult) error {
	o := origin{systemID: sys.SystemID, timeline: sys.Timeline}
	if s.origin == nil {
		s.origin = &o
	} else if *s.origin != o {
		return fmt.Errorf("%w: the stream moved from system %s timeline %d to system %s timeline %d",
			relay.ErrServerChanged, s.origin.systemID, s.origin.timeline, o.systemID, o.timeline)
	}
	if s.cfg.StreamFrom == nil {
		return nil
	}
	if err := s.cfg.StreamFrom(ctx, o.systemID, o.timeline); err != nil {
		return fmt.Errorf("bind the stream's outcomes to system %s timeline %d: %w", o.systemID, o.timeline, err)
	}
	return nil
}

// createSlot creates the logical slot with an exported snapshot; on
// PostgreSQL 17 and later with failover enabled, so that standbys with
// sync_replication_slots keep a copy to continue from after a promotion.
// pglogrepl has no FAILOVER option: the command is sent as written in the
// replication protocol's documentation, and its result parsed as pglogrepl
// parses it.
func createSlot(ctx context.Context, conn *pgconn.PgConn, slot string, version int) (pglogrepl.CreateReplicationSlotResult, error) {
	if version < failoverVersion {
		return pglogrepl.CreateReplicationSlot(ctx, conn, slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
			SnapshotAction: "EXPORT_SNAPSHOT",
			Mode:           pglogrepl.LogicalReplication,
		})
	}
	// The slot name passed relay.ValidateSlotName: lower-case letters,
	// digits and underscores, safe unquoted.
	sql := fmt.Sprintf("CREATE_REPLICATION_SLOT %s LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)", slot)
	return pglogrepl.ParseCreateReplicationSlot(conn.Exec(ctx, sql))
}

// enableFailover turns on the failover property of the relay's existing
// slot (made before PostgreSQL 17, or by someone else), when no process
// streams from it: ALTER_REPLICATION_SLOT acquires the slot. A failure is
// logged and tried again at the next session.
func (s *Source) enableFailover(ctx context.Context, conn *pgconn.PgConn, activePID int32) {
	if activePID != 0 {
		s.log.Warn().Int32("pid", activePID).Msg("replication slot has failover disabled, and another process streams from it: enabling it at a later session")
		return
	}
	sql := fmt.Sprintf("ALTER_REPLICATION_SLOT %s (FAILOVER true)", s.cfg.Slot)
	if _, err := conn.Exec(ctx, sql).ReadAll(); err != nil {
		s.log.Warn().Err(err).Msg("could not enable failover on the replication slot: standbys will not sync it (docs/failover.md)")
		return
	}
	s.log.Info().Msg("enabled failover on the replication slot: standbys with sync_replication_slots keep a copy")
}

// maxWalsenders bounds the pids rememberWalsender keeps.
const maxWalsenders = 16

// rememberWalsender records the backend pid of one of this Source's
// replication connections.
func (s *Source) rememberWalsender(pid uint32) {
	if pid == 0 || slices.Contains(s.walsenders, pid) {
		return
	}
	s.walsenders = append(s.walsenders, pid)
	if len(s.walsenders) > maxWalsenders {
		s.walsenders = slices.Delete(s.walsenders, 0, len(s.walsenders)-maxWalsenders)
	}
}

// slotInUse explains START_REPLICATION's "replication slot is active for
// PID" (55006), which the session retries: the walsender of an earlier
// connection of this Source that outlived it (a network that swallowed its
// packets keeps it until wal_sender_timeout: docs/operations-health.md) is
// ended at once; any other holder — a former leader's walsender, after a
// failover or a leader change (the supervisor ends those as a term
// starts), or another client — is waited for.
func (s *Source) slotInUse(ctx context.Context, self uint32, startErr error) error {
	conn, err := pgx.ConnectConfig(ctx, s.queryConfig)
	if err != nil {
		return fmt.Errorf("START_REPLICATION: the slot is in use by another process; retrying until it is free: %w", startErr)
	}
	defer closeConn(conn)
	slot, err := lookUpSlot(ctx, conn, s.cfg.Slot)
	if err != nil || slot.activePID == 0 {
		return fmt.Errorf("START_REPLICATION: the slot was in use by another process; retrying: %w", startErr)
	}
	pid := uint32(slot.activePID)
	if !s.ownStaleWalsender(pid, self) {
		return fmt.Errorf("START_REPLICATION: the slot is in use by process %d (a former leader's walsender, or another client); retrying until it is free: %w", pid, startErr)
	}
	if err := s.endOwnWalsender(ctx, conn, pid); err != nil {
		return fmt.Errorf("START_REPLICATION: %w; retrying: %w", err, startErr)
	}
	return fmt.Errorf("START_REPLICATION: the slot was held by walsender %d, an earlier connection of this relay: ended it; retrying: %w", pid, startErr)
}

// ownStaleWalsender reports whether pid is the walsender of one of this
// Source's earlier replication connections (not the current one, self).
func (s *Source) ownStaleWalsender(pid, self uint32) bool {
	return pid != 0 && pid != self && slices.Contains(s.walsenders, pid)
}

// endOwnWalsender ends pid, the walsender of an earlier replication
// connection of this Source that the server still keeps streaming from the
// slot (a connection given up as dead: docs/operations-health.md), and
// waits up to closeTimeout for the slot to be free. Failing that,
// START_REPLICATION fails with "in use" and the session is retried.
func (s *Source) endOwnWalsender(ctx context.Context, conn *pgx.Conn, pid uint32) error {
	var ended bool
	if err := conn.QueryRow(ctx, "SELECT pg_terminate_backend($1)", int32(pid)).Scan(&ended); err != nil || !ended {
		s.log.Warn().Uint32("pid", pid).Err(err).Msg("the slot is still streamed by an earlier connection of this relay; could not end it (the server ends it after wal_sender_timeout)")
		return fmt.Errorf("the slot is held by walsender %d, an earlier connection of this relay; ending it failed (%v)", pid, err)
	}
	deadline := time.Now().Add(closeTimeout)
	for time.Now().Before(deadline) {
		var active bool
		if err := conn.QueryRow(ctx, "SELECT coalesce(bool_or(active_pid = $2), false) FROM pg_replication_slots WHERE slot_name = $1",
			s.cfg.Slot, int32(pid)).Scan(&active); err != nil || !active || !relay.Sleep(ctx, 20*time.Millisecond) {
			break
		}
	}
	s.log.Warn().Uint32("pid", pid).Msg("ended the walsender of an earlier replication connection of this relay, which still held the slot (its connection was given up as dead)")
	return nil
}
