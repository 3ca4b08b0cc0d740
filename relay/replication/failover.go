package replication

import (
	"context"
	"fmt"
	"slices"

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
	dropped, err := s.cfg.StreamFrom(ctx, o.systemID, o.timeline)
	if err != nil {
		return fmt.Errorf("bind the stream's outcomes to system %s timeline %d: %w", o.systemID, o.timeline, err)
	}
	if dropped > 0 {
		s.log.Warn().Int("events", dropped).Int32("timeline", o.timeline).
			Msg("the server changed (a promotion): outcomes of events streamed from the old primary are not written here; those of its events this server has come again and may be delivered twice")
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
// packets keeps it until wal_sender_timeout) is ended at once; any other
// holder — a former leader's walsender, after a failover or a leader change
// (the supervisor ends those as a term starts), or another client — is
// waited for.
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
	if pid == self || !slices.Contains(s.walsenders, pid) {
		return fmt.Errorf("START_REPLICATION: the slot is in use by process %d (a former leader's walsender, or another client); retrying until it is free: %w", pid, startErr)
	}
	var ended bool
	if err := conn.QueryRow(ctx, "SELECT pg_terminate_backend($1)", int32(pid)).Scan(&ended); err != nil {
		return fmt.Errorf("START_REPLICATION: the slot is held by walsender %d, an earlier connection of this relay; ending it failed (%v); retrying: %w", pid, err, startErr)
	}
	s.log.Warn().Uint32("pid", pid).Msg("ended the walsender of an earlier replication connection of this relay, which still held the slot")
	return fmt.Errorf("START_REPLICATION: the slot was held by walsender %d, an earlier connection of this relay: ended it; retrying: %w", pid, startErr)
}
