package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Decoding on a standby (docs/standby.md)
//
// With Config.Primary set, ConnString names a physical standby of the
// primary the ledger lives on (source.standby_url). The slot is made and
// streamed there, so that the primary spends nothing on decoding; the
// ledger, the checkpoint, the hand-over record and the claim path stay on
// the primary. What changes:
//
//   - IDENTIFY_SYSTEM on a standby reports the primary's system identifier
//     and the timeline it replays: the stream's outcomes are bound to the
//     primary it replicates (Config.StreamFrom) with no other rule. A
//     standby of another cluster is refused.
//   - The slot is made without FAILOVER (a standby refuses it) and only
//     once the standby has replayed the primary's flushed position read
//     after BeginSlot, so that its consistent point is past every write
//     the relay made before; while CREATE_REPLICATION_SLOT waits for a
//     running-transactions record from the primary, the relay asks the
//     primary for one (pg_log_standby_snapshot()).
//   - The hand-over reads the pending ids on the standby, in the slot's
//     exported snapshot, and marks them on the primary
//     (Primary.MarkForClaimFromStandby).
//   - The re-stream horizon is the primary's flushed position: no
//     walsender, on the standby or anywhere, can have sent WAL past it.

// standbyVersion is the first server_version_num that decodes on a
// standby: PostgreSQL 16.
const standbyVersion = 160000

// Primary is the primary server of the standby a Source decodes on
// (Config.Primary); ledger.Store implements it.
type Primary interface {
	// Identify returns the primary's system identifier and timeline.
	Identify(ctx context.Context) (systemID string, timeline int32, err error)
	// WALFlushPosition returns the primary's flushed WAL position.
	WALFlushPosition(ctx context.Context) (relay.LSN, error)
	// LogStandbySnapshot writes a running-transactions record on the
	// primary, which a slot being created on a standby waits for.
	LogStandbySnapshot(ctx context.Context) error
	// MarkForClaimFromStandby is the hand-over of a slot made on standby:
	// it reads there, in the exported snapshot, the ids of the rows pending
	// and marks them on the primary for the claim path, recording the
	// hand-over as done at consistent.
	MarkForClaimFromStandby(ctx context.Context, standby *pgx.Conn, slot, snapshot string, consistent relay.LSN) (int64, error)
	// DropSlot drops the primary's slot named slot, when nobody streams
	// from it, and reports whether it did.
	DropSlot(ctx context.Context, slot string) (bool, error)
	// SetDecodingStandby names the physical slot the standby streams from
	// the primary through ("" for none): the checkpoint does not wait for
	// it in synchronized_standby_slots (the stream waits for that standby
	// itself, bounded: receiver.waitStandbyReceived).
	SetDecodingStandby(physicalSlot string)
}

// DefaultStandbyCatchUp bounds how long a session waits for the standby to
// replay the primary's position before it creates a slot there, when
// Config.StandbyCatchUp is zero.
const DefaultStandbyCatchUp = 30 * time.Second

// standbySnapshotEvery is how often a slot creation on a standby asks the
// primary for a running-transactions record.
const standbySnapshotEvery = time.Second

// replayPositionSQL is the WAL position a server has applied: the replayed
// one on a standby, the flushed one on a primary (a promoted standby).
const replayPositionSQL = `SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_flush_lsn() END)::text`

// inRecovery reports whether the server conn is on is a standby.
func inRecovery(ctx context.Context, conn *pgx.Conn) (bool, error) {
	var standby bool
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&standby); err != nil {
		return false, fmt.Errorf("read pg_is_in_recovery(): %w", err)
	}
	return standby, nil
}

// checkStandby is the part of a session's checks that decoding on a standby
// adds: the server is recent enough, and is a standby of the primary (or
// was, and has been promoted: it is then the primary's successor).
func (s *Source) checkStandby(ctx context.Context, qconn *pgx.Conn, version int) error {
	if version < standbyVersion {
		return &UnavailableError{Reason: fmt.Sprintf(
			"source.standby_url names a PostgreSQL %d server; logical decoding on a standby needs PostgreSQL 16 or later (upgrade the standby, or remove source.standby_url to decode on the primary)", version/10000)}
	}
	var walLevel string
	if err := qconn.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return fmt.Errorf("show wal_level on the standby: %w", err)
	}
	if walLevel != "logical" {
		return &UnavailableError{Reason: fmt.Sprintf(
			"the standby's wal_level is %q; decoding on it needs wal_level = logical there and on the primary (set it in the standby's postgresql.conf, then restart it)", walLevel)}
	}
	return nil
}

// checkStandbyOrigin refuses a standby of another cluster (its system
// identifier differs from the primary's) and waits for one that is on
// another timeline (it has not followed a promotion yet, or the primary is
// a former one): retried.
func (s *Source) checkStandbyOrigin(ctx context.Context, sys pglogrepl.IdentifySystemResult) error {
	systemID, timeline, err := s.cfg.Primary.Identify(ctx)
	if err != nil {
		return err
	}
	if systemID != sys.SystemID {
		return &UnavailableError{Reason: fmt.Sprintf(
			"source.standby_url names a server of another cluster (system identifier %s; the primary's, database_url, is %s): it must be a physical standby of the primary", sys.SystemID, systemID)}
	}
	if timeline != sys.Timeline {
		return fmt.Errorf("the standby replays timeline %d and the primary writes timeline %d: waiting until they agree", sys.Timeline, timeline)
	}
	return nil
}

// waitReplayed waits until the server on qconn has applied the primary's
// flushed position, read now, or StandbyCatchUp passes.
func (s *Source) waitReplayed(ctx context.Context, qconn *pgx.Conn) (relay.LSN, error) {
	target, err := s.cfg.Primary.WALFlushPosition(ctx)
	if err != nil {
		return 0, err
	}
	deadline := time.Now().Add(s.cfg.StandbyCatchUp)
	for {
		var replayed relay.LSN
		if err := qconn.QueryRow(ctx, replayPositionSQL).Scan(&replayed); err != nil {
			return 0, fmt.Errorf("read the standby's replayed position: %w", err)
		}
		if replayed >= target {
			return target, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("the standby has replayed %s, not yet the primary's %s, after %s: it lags; the slot is made once it has", replayed, target, s.cfg.StandbyCatchUp)
		}
		if !relay.Sleep(ctx, 10*time.Millisecond) {
			return 0, ctx.Err()
		}
	}
}

// createStandbySlot runs CREATE_REPLICATION_SLOT on the standby (no
// FAILOVER: a standby refuses it) while asking the primary, every
// standbySnapshotEvery, for the running-transactions record the creation
// waits for.
func (s *Source) createStandbySlot(ctx context.Context, rconn *pgconn.PgConn) (pglogrepl.CreateReplicationSlotResult, error) {
	nudge, _ := relay.NewGroup(ctx)
	nudge.Go("running-transactions nudge", func(ctx context.Context) error {
		warned := false
		for relay.Sleep(ctx, 50*time.Millisecond) {
			err := s.cfg.Primary.LogStandbySnapshot(ctx)
			if err != nil && ctx.Err() == nil && !warned {
				warned = true
				s.log.Warn().Err(err).Msg("could not ask the primary for a running-transactions record (pg_log_standby_snapshot()): the slot on the standby is made once the primary logs one by itself, up to 15 s after it is busy, or never while it is idle (GRANT EXECUTE ON FUNCTION pg_log_standby_snapshot() TO the relay's role, as a superuser)")
			}
			if !relay.Sleep(ctx, standbySnapshotEvery) {
				break
			}
		}
		return nil
	})
	started := time.Now()
	res, err := createSlot(ctx, rconn, s.cfg.Slot, 0)
	if nerr := nudge.Stop(); err == nil {
		err = nerr // a nudge that failed (panicked) fails the creation
	}
	if err == nil {
		s.log.Debug().Dur("took", time.Since(started)).Msg("created the slot on the standby")
	}
	return res, err
}

// dropPrimarySlot drops the relay's slot of the same name on the primary, a
// leftover of decoding there, which pins WAL on the primary (see
// ledger.Store.DropSlot). A failure is logged; the watchdog drops it later.
func (s *Source) dropPrimarySlot(ctx context.Context) {
	dropped, err := s.cfg.Primary.DropSlot(ctx, s.cfg.Slot)
	switch {
	case err != nil:
		s.log.Warn().Err(err).Msg("could not drop the relay's slot on the primary, left from decoding there; the slot watchdog drops it once unconsumed for slot_max_unconsumed")
	case dropped:
		s.log.Warn().Msg("decoding on the standby: dropped the relay's slot on the primary, left from decoding there (it pinned WAL on the primary); the outbox table keeps the events")
	}
}

// errSyncedCopy says the standby holds a copy of a primary slot of the
// relay's name, synchronized from the primary (PostgreSQL 17+), which it
// can neither stream from nor drop.
var errSyncedCopy = errors.New("the standby holds a synchronized copy of the primary's slot of this name (sync_replication_slots): waiting for the standby to drop it now that the primary's is gone")

// standbyReceiveWait bounds how long an acknowledgement that passes events
// waits, after the checkpoint on the primary, for the standby to have
// received the primary's WAL up to it.
const standbyReceiveWait = time.Second

// receivedPositionSQL is the WAL position a standby has received (flushed
// from its WAL receiver), or replayed when more; a primary's flushed one.
const receivedPositionSQL = `SELECT (CASE WHEN pg_is_in_recovery()
  THEN greatest(coalesce(pg_last_wal_receive_lsn(), '0/0'), pg_last_wal_replay_lsn())
  ELSE pg_current_wal_flush_lsn() END)::text`

// noteDecodingStandby tells the primary which physical slot the standby
// streams through (its primary_slot_name), "" when the server is no
// standby (promoted).
func (s *Source) noteDecodingStandby(ctx context.Context, qconn *pgx.Conn, onStandby bool) error {
	name := ""
	if onStandby {
		if err := qconn.QueryRow(ctx, "SELECT current_setting('primary_slot_name')").Scan(&name); err != nil {
			return fmt.Errorf("read the standby's primary_slot_name: %w", err)
		}
	}
	s.cfg.Primary.SetDecodingStandby(name)
	return nil
}

// waitStandbyReceived waits, up to standbyReceiveWait, until the standby has
// received the primary's WAL up to the position flushed now (after a
// checkpoint): the outcomes of the events the acknowledgement passes are
// then on the standby, and a promotion of it cannot leave its slot past an
// event whose diversion it lacks. When the standby does not receive in time
// (it is shutting down: its logical walsender waits for this very
// acknowledgement; or it is cut off, which the standby watch sees), the
// acknowledgement goes out on the primary's durable record alone, with a
// warning once per session (docs/standby.md).
func (r *receiver) waitStandbyReceived(ctx context.Context) {
	s := r.s
	target, err := s.cfg.Primary.WALFlushPosition(ctx)
	if err != nil {
		return
	}
	deadline := time.Now().Add(standbyReceiveWait)
	for {
		if r.standbyConn == nil {
			cctx, cancel := context.WithDeadline(ctx, deadline)
			r.standbyConn, err = pgx.ConnectConfig(cctx, s.queryConfig)
			cancel()
			if err != nil {
				r.standbyConn = nil
			}
		}
		var received relay.LSN
		if r.standbyConn != nil {
			if err = r.standbyConn.QueryRow(ctx, receivedPositionSQL).Scan(&received); err != nil {
				r.closeStandbyConn()
			}
		}
		if err == nil && received >= target {
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			if !r.receiveSlow && ctx.Err() == nil {
				r.receiveSlow = true
				s.log.Warn().Err(err).Str("received", received.String()).Str("checkpoint", target.String()).
					Msg("the standby has not received the checkpoint's WAL within 1 s (shutting down, or cut off from the primary): acknowledging on the primary's durable record")
			}
			return
		}
		relay.Sleep(ctx, 2*time.Millisecond)
	}
}

func (r *receiver) closeStandbyConn() {
	if r.standbyConn != nil {
		closeConn(r.standbyConn)
		r.standbyConn = nil
	}
}
