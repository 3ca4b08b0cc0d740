package replication

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/relay"
)

// slotDetails is what ensureSlot needs to know about an existing slot.
type slotDetails struct {
	exists         bool
	slotType       string
	plugin         string
	database       string
	sameDatabase   bool
	walStatus      string
	confirmedFlush relay.LSN
	activePID      int32
	// failover is pg_replication_slots.failover (17+): the slot is synced
	// to standbys with sync_replication_slots; false on older servers.
	failover bool

	// invalidationReason is pg_replication_slots.invalidation_reason (17+),
	// "" when the slot is valid or the server is older.
	invalidationReason string
	// synced is pg_replication_slots.synced (17+): on a standby, a copy of
	// the primary's slot that sync_replication_slots keeps.
	synced bool
}

// invalidated reports whether the server has invalidated the slot, so that
// it can no longer stream, and why. wal_status "lost" says so on every
// supported version: on 13-15 the one cause is WAL removed past
// max_slot_wal_keep_size, and from 16 on every invalidation shows as lost.
// From 17 on invalidation_reason names the cause ("wal_removed",
// "rows_removed", "wal_level_insufficient", and on 18 "idle_timeout" for a
// slot unused longer than idle_replication_slot_timeout); it is checked as
// well, so that no cause is missed whatever wal_status shows.
func (d slotDetails) invalidated() (bool, string) {
	switch {
	case d.invalidationReason != "":
		return true, d.invalidationReason
	case d.walStatus == "lost":
		return true, "wal_status lost"
	}
	return false, ""
}

func lookUpSlot(ctx context.Context, conn *pgx.Conn, slot string) (slotDetails, error) {
	d := slotDetails{exists: true}
	// to_jsonb(s) ->> 'invalidation_reason' is NULL on servers before 17,
	// which lack the column: one query for every version.
	err := conn.QueryRow(ctx, `
		SELECT slot_type, coalesce(plugin, ''), coalesce(database, ''),
		       coalesce(database = current_database(), false),
		       coalesce(wal_status, ''), coalesce(to_jsonb(s) ->> 'invalidation_reason', ''),
		       confirmed_flush_lsn::text, coalesce(active_pid, 0),
		       coalesce((to_jsonb(s) ->> 'failover')::bool, false),
		       coalesce((to_jsonb(s) ->> 'synced')::bool, false)
		  FROM pg_replication_slots s
		 WHERE slot_name = $1`, slot).
		Scan(&d.slotType, &d.plugin, &d.database, &d.sameDatabase, &d.walStatus, &d.invalidationReason, &d.confirmedFlush, &d.activePID, &d.failover, &d.synced)
	if errors.Is(err, pgx.ErrNoRows) {
		return slotDetails{}, nil
	}
	if err != nil {
		return slotDetails{}, fmt.Errorf("look up replication slot %q: %w", slot, err)
	}
	return d, nil
}

// SlotInfo reports the replication slot named slot from pg_replication_slots:
// whether it exists, its wal_status ("reserved", "extended", "unreserved" or
// "lost"; "" when it has none), its confirmed_flush_lsn (0 when it has none)
// and the PID of the process streaming from it (0 when none). It only reads,
// so it is safe to call at any time, on any ordinary connection.
func SlotInfo(ctx context.Context, conn *pgx.Conn, slot string) (exists bool, walStatus string, confirmedFlush relay.LSN, activePID int32, err error) {
	d, err := lookUpSlot(ctx, conn, slot)
	if err != nil {
		return false, "", 0, 0, err
	}
	return d.exists, d.walStatus, d.confirmedFlush, d.activePID, nil
}

// ensureSlot returns the position streaming will start from, creating the
// slot (through the snapshot hand-over) when it is missing or lost.
func (s *Source) ensureSlot(ctx context.Context, qconn *pgx.Conn, rconn *pgconn.PgConn, version int, onStandby bool) (relay.LSN, *handOver, error) {
	if onStandby {
		s.dropPrimarySlot(ctx)
	}
	slot, err := lookUpSlot(ctx, qconn, s.cfg.Slot)
	if err != nil {
		return 0, nil, err
	}
	foreign := false // the slot exists without the relay's hand-over record
	if slot.exists {
		switch {
		case onStandby && slot.synced:
			return 0, nil, errSyncedCopy
		case slot.slotType != "logical":
			return 0, nil, &UnavailableError{Reason: fmt.Sprintf("replication slot %q is a %s slot; choose another slot name", s.cfg.Slot, slot.slotType)}
		case !slot.sameDatabase:
			return 0, nil, &UnavailableError{Reason: fmt.Sprintf("replication slot %q belongs to database %q; choose another slot name", s.cfg.Slot, slot.database)}
		case slot.plugin != "pgoutput":
			return 0, nil, &UnavailableError{Reason: fmt.Sprintf("replication slot %q uses plugin %q, not pgoutput; drop it or choose another slot name", s.cfg.Slot, slot.plugin)}
		}
		handedOver, err := s.cfg.HandOver.HandedOver(ctx, s.cfg.Slot)
		if err != nil {
			return 0, nil, err
		}
		invalidated, reason := slot.invalidated()
		foreign = !invalidated && !handedOver
		switch {
		case invalidated:
			s.log.Warn().Str("reason", reason).Msg("replication slot was invalidated; dropping and recreating it")
		case !handedOver && s.cfg.Primary != nil:
			s.log.Warn().Msg("replication slot on the standby has no record of its hand-over (delivery moved to the primary since, or the relay stopped between creating it and handing the rows pending then to the claim path): dropping and recreating it")
		case !handedOver:
			// docs/failover.md "A slot without its hand-over record"
			s.log.Warn().Msg("replication slot has no record of its hand-over (another process created it, or the relay stopped between creating it and delivering the rows pending then): " +
				"the rows committed behind it may never be streamed, so the safe rule applies: dropping and recreating it, and delivering every row pending now beside the stream")
		default:
			if slot.walStatus == "unreserved" {
				s.log.Warn().Msg("replication slot retains more WAL than max_slot_wal_keep_size; it will be invalidated unless it catches up")
			}
			if s.ownStaleWalsender(uint32(slot.activePID), rconn.PID()) {
				_ = s.endOwnWalsender(ctx, qconn, uint32(slot.activePID))
			} else if slot.activePID != 0 {
				s.log.Warn().Int32("pid", slot.activePID).Msg("replication slot is in use by another process")
			}
			if version >= failoverVersion && !slot.failover && s.cfg.Primary == nil {
				s.enableFailover(ctx, rconn, slot.activePID)
			}
			return slot.confirmedFlush, nil, nil
		}
		if err := pglogrepl.DropReplicationSlot(ctx, rconn, s.cfg.Slot, pglogrepl.DropReplicationSlotOptions{}); err != nil {
			return 0, nil, fmt.Errorf("drop replication slot: %w", err)
		}
	}

	if s.cfg.WaitSettled != nil {
		if err := s.cfg.WaitSettled(ctx); err != nil {
			return 0, nil, fmt.Errorf("wait for the consumer to settle before creating the slot: %w", err)
		}
	}
	if err := s.cfg.HandOver.BeginSlot(ctx, s.cfg.Slot); err != nil {
		return 0, nil, err
	}
	var res pglogrepl.CreateReplicationSlotResult
	if onStandby {
		// The slot's consistent point must come after every write the
		// relay made before (BeginSlot included): docs/standby.md.
		if _, err := s.waitReplayed(ctx, qconn); err != nil {
			return 0, nil, err
		}
	}
	createCtx, cancel := context.WithTimeout(ctx, s.cfg.StallAfter)
	defer cancel()
	if onStandby {
		res, err = s.createStandbySlot(createCtx, rconn)
	} else {
		res, err = createSlot(createCtx, rconn, s.cfg.Slot, version)
	}
	if err != nil && ctx.Err() == nil && createCtx.Err() != nil {
		return 0, nil, fmt.Errorf("create replication slot: not done after %s: %s", s.cfg.StallAfter, s.slotCreationWaitsFor(ctx, qconn, onStandby))
	}
	if err != nil {
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "53400" {
			return 0, nil, &UnavailableError{Reason: "all replication slots are in use (raise max_replication_slots, or drop an unused slot)", Err: err}
		}
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && onStandby && pgErr.Code == "55000" && strings.Contains(pgErr.Message, "primary") {
			return 0, nil, &UnavailableError{Reason: "the primary's wal_level is not logical: decoding on a standby needs wal_level = logical on the primary (ALTER SYSTEM SET wal_level = logical there, then restart it)", Err: err}
		}
		return 0, nil, fmt.Errorf("create replication slot: %w", err)
	}
	consistent, err := relay.ParseLSN(res.ConsistentPoint)
	if err != nil {
		return 0, nil, fmt.Errorf("create replication slot: consistent point: %w", err)
	}

	// The snapshot stays valid while rconn runs no other command: the rows
	// pending in it are exactly the rows the new slot will never stream.
	if s.cfg.Primary != nil {
		n, err := s.cfg.Primary.MarkForClaimFromStandby(ctx, qconn, s.cfg.Slot, res.SnapshotName, consistent)
		if err != nil {
			// Without the hand-over those rows would stay pending unseen:
			// drop the slot so that the next attempt repeats it.
			s.dropAfterFailedHandOver(rconn)
			return 0, nil, fmt.Errorf("hand the rows pending at slot creation to the claim path: %w", err)
		}
		s.log.Info().Str("consistent_point", consistent.String()).Int64("rows_handed_to_claim_path", n).Bool("on_standby", onStandby).
			Msg("created replication slot; rows pending in its snapshot go to the claim path")
		return consistent, nil, nil
	}
	// On the primary the snapshot is imported into a transaction that
	// holds it, and the slot streams while its rows are read and delivered
	// (Source.deliverHandOver); the decoder waits for their aggregates' pin.
	rows, err := s.cfg.HandOver.OpenHandOver(ctx, res.SnapshotName)
	if err != nil {
		s.dropAfterFailedHandOver(rconn)
		return 0, nil, fmt.Errorf("import the new slot's snapshot: %w", err)
	}
	s.log.Info().Str("consistent_point", consistent.String()).Bool("failover", version >= failoverVersion).
		Msg("created replication slot; the rows pending in its snapshot are delivered while it streams")
	return consistent, &handOver{rows: rows, consistent: consistent, foreign: foreign, early: make(chan struct{}), pinned: make(chan struct{})}, nil
}

// slotCreationWaitsFor names what a slot's creation that did not finish
// waits for: on the primary, the transactions running when it began (the
// oldest open ones, read on qconn); on a standby, a running-transactions
// record from the primary.
func (s *Source) slotCreationWaitsFor(ctx context.Context, qconn *pgx.Conn, onStandby bool) string {
	if onStandby {
		return "on a standby it waits for a running-transactions record from the primary (pg_log_standby_snapshot(): see the warning above, if any), then for the primary's transactions running then to end"
	}
	what := "it waits for the transactions running when it began to end"
	qctx, cancel := context.WithTimeout(ctx, closeTimeout)
	defer cancel()
	rows, err := qconn.Query(qctx, `
		SELECT pid, coalesce(state, ''), application_name, xact_start
		  FROM pg_stat_activity
		 WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
		 ORDER BY xact_start
		 LIMIT 3`)
	if err != nil {
		return what
	}
	var open []string
	var (
		pid        int32
		state, app string
		started    time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&pid, &state, &app, &started}, func() error {
		open = append(open, fmt.Sprintf("pid %d (%s, application %q, open since %s)", pid, state, app, started.UTC().Format(time.RFC3339)))
		return nil
	})
	if err != nil || len(open) == 0 {
		return what
	}
	return what + "; the oldest open now: " + strings.Join(open, ", ")
}
