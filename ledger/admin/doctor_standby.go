package admin

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

// standbyVersion is the first server_version_num that decodes on a
// standby (PostgreSQL 16).
const standbyVersion = 160000

// standby checks what decoding on a physical standby (source.standby_url,
// docs/standby.md) needs, each with its fix: the standby answers, on
// PostgreSQL 16+, a replication connection too; it is a standby of this
// primary (same system identifier); wal_level = logical on the standby (the
// primary's is the wal_level check); hot_standby_feedback on, through a
// physical slot on the primary that exists and is used; the role may call
// pg_log_standby_snapshot() on the primary (a slot made on a standby waits
// for a running-transactions record otherwise); the relay's slot there and
// the standby's max_slot_wal_keep_size, which bounds what it retains; and
// how long the standby takes to replay the primary's current position,
// against source.standby_max_lag. It also reports a slot of the relay's name
// on the primary, which decoding on the standby leaves unused.
func (d *diagnosis) standby(ctx context.Context) {
	d.primaryLeftoverSlot(ctx)
	cc, err := pgx.ParseConfig(d.cfg.StandbyURL)
	if err != nil {
		d.add(Fail, "standby connection", "source.standby_url does not parse as a PostgreSQL URL or key=value string", "fix source.standby_url")
		return
	}
	cc.RuntimeParams["application_name"] = CLIApplicationName
	if cc.ConnectTimeout == 0 || cc.ConnectTimeout > d.cfg.ConnectTimeout {
		cc.ConnectTimeout = d.cfg.ConnectTimeout
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		d.add(Fail, "standby connection", fmt.Sprintf("cannot connect to source.standby_url: %v", err),
			"check source.standby_url, that the standby is up and that its pg_hba.conf admits this role from this host; until then auto mode delivers on the primary")
		return
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()

	var (
		version             int
		recovery, feedback  bool
		walLevel, slotName  string
		systemID, primaryID string
	)
	err = conn.QueryRow(ctx, catalogSQL("StandbySettings")).
		Scan(&version, &recovery, &walLevel, &feedback, &slotName, &systemID)
	if err != nil {
		d.add(Fail, "standby connection", fmt.Sprintf("read the standby's settings: %v", err), "")
		return
	}
	if err := d.conn.QueryRow(ctx, catalogSQL("StandbySystemIdentifier")).Scan(&primaryID); err != nil {
		d.add(Fail, "standby", fmt.Sprintf("read the primary's system identifier: %v", err), "")
		return
	}
	switch {
	case version < standbyVersion:
		d.add(Fail, "standby version", fmt.Sprintf("PostgreSQL %d: logical decoding on a standby needs 16 or later", version/10000),
			"upgrade the standby (and the primary) to PostgreSQL 16 or later, or remove source.standby_url to decode on the primary")
		return
	case systemID != primaryID:
		d.add(Fail, "standby", fmt.Sprintf("source.standby_url is a server of another cluster (system identifier %s; the primary's is %s)", systemID, primaryID),
			"point source.standby_url at a physical standby of the database_url server")
		return
	case !recovery:
		d.add(Warn, "standby", "source.standby_url is not in recovery: a primary (a promoted standby?). The relay decodes there, at that server's cost",
			"after a failover, point source.standby_url at a standby of the new primary (or remove it)")
	default:
		d.add(OK, "standby", fmt.Sprintf("PostgreSQL %d, a physical standby of this primary (system identifier %s)", version/10000, systemID), "")
	}
	if walLevel != "logical" {
		d.add(Fail, "standby wal_level", fmt.Sprintf("wal_level is %q on the standby: decoding there needs logical, as on the primary", walLevel),
			"set wal_level = logical in the standby's postgresql.conf, then restart the standby")
	} else {
		d.add(OK, "standby wal_level", "logical", "")
	}
	d.standbyReplicationConnection(ctx, cc)
	if recovery {
		d.standbyFeedback(ctx, feedback, slotName)
	}
	d.standbySnapshotPrivilege(ctx)
	d.standbySlot(ctx, conn)
	// The relay's slot retains WAL on the standby, under the standby's own
	// limit; the primary's (checked apart) bounds the standby's physical
	// slot there.
	d.keepSize(ctx, conn, "standby max_slot_wal_keep_size", "on the standby: ")
	if recovery {
		d.standbyLag(ctx, conn)
	}
}

// primaryLeftoverSlot reports a slot of the relay's name on the primary:
// while the relay decodes on the standby nobody consumes it, and it pins WAL
// on the primary until run drops it.
func (d *diagnosis) primaryLeftoverSlot(ctx context.Context) {
	var active bool
	var retained *int64
	err := d.conn.QueryRow(ctx, catalogSQL("StandbyPrimaryLeftoverSlot"), d.cfg.Slot).Scan(&active, &retained)
	name := "slot " + d.cfg.Slot + " on the primary"
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		d.add(OK, name, "none: the relay's slot lives on the standby (source.standby_url)", "")
	case err != nil:
		d.add(Fail, name, fmt.Sprintf("read pg_replication_slots: %v", err), "")
	case active:
		d.add(Warn, name, "exists and a process streams from it (another relay decoding on the primary?) while this configuration decodes on the standby",
			"give every relay of this slot the same source.standby_url")
	default:
		d.add(Warn, name, fmt.Sprintf("left from decoding on the primary: it retains %s of WAL there; run drops it when it starts decoding on the standby", formatRetained(retained)),
			fmt.Sprintf("SELECT pg_drop_replication_slot(%s);   -- on the primary", relay.QuoteLiteral(d.cfg.Slot)))
	}
}

// standbyReplicationConnection opens a replication connection to the
// standby: its pg_hba.conf may differ from the primary's.
func (d *diagnosis) standbyReplicationConnection(ctx context.Context, cc *pgx.ConnConfig) {
	pc := cc.Config.Copy()
	pc.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, pc)
	if err == nil {
		_, err = pglogrepl.IdentifySystem(ctx, conn)
		closeCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = conn.Close(closeCtx)
		cancel()
	}
	if err == nil {
		d.add(OK, "standby replication connection", "IDENTIFY_SYSTEM answered on the standby", "")
		return
	}
	d.add(Fail, "standby replication connection", fmt.Sprintf("cannot open a replication connection to the standby: %v", err),
		fmt.Sprintf("on the standby, add a pg_hba.conf line for this role and database (a logical replication connection matches the database name), e.g.\nhost  %s  %s  10.0.0.0/8  scram-sha-256\n-- then reload the standby",
			pc.Database, d.role.name))
}

// standbyFeedback checks hot_standby_feedback on the standby and the
// physical slot it streams through on the primary. Without feedback the
// primary's VACUUM removes catalog rows the standby's logical slot still
// needs, and PostgreSQL invalidates the slot (rows_removed); without a
// physical slot the primary forgets the feedback while the standby is
// disconnected, and may remove WAL the standby still needs.
func (d *diagnosis) standbyFeedback(ctx context.Context, feedback bool, slotName string) {
	if feedback {
		d.add(OK, "standby hot_standby_feedback", "on", "")
	} else {
		d.add(Fail, "standby hot_standby_feedback", "off: the primary's VACUUM may remove catalog rows the slot on the standby needs, and PostgreSQL then invalidates it (rows_removed)",
			"on the standby: ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf();")
	}
	create := "on the primary: SELECT pg_create_physical_replication_slot('standby1');\non the standby: primary_slot_name = 'standby1' (ALTER SYSTEM SET primary_slot_name = 'standby1'; SELECT pg_reload_conf();)"
	if slotName == "" {
		d.add(Warn, "standby physical slot", "the standby streams without a physical slot: while it is disconnected the primary forgets its feedback (the slot on the standby may be invalidated) and may remove WAL it needs",
			create)
		return
	}
	var active, holdsXmin bool
	err := d.conn.QueryRow(ctx, catalogSQL("StandbyPhysicalSlot"), slotName).Scan(&active, &holdsXmin)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		d.add(Fail, "standby physical slot", fmt.Sprintf("the standby's primary_slot_name is %q, and the primary has no physical slot of that name: the standby cannot stream", slotName),
			fmt.Sprintf("on the primary: SELECT pg_create_physical_replication_slot(%s);", relay.QuoteLiteral(slotName)))
	case err != nil:
		d.add(Fail, "standby physical slot", fmt.Sprintf("read pg_replication_slots: %v", err), "")
	case !active:
		d.add(Warn, "standby physical slot", fmt.Sprintf("physical slot %s exists on the primary, but nobody streams through it now", slotName), "check the standby's primary_conninfo and its log")
	case !holdsXmin:
		d.add(Warn, "standby physical slot", fmt.Sprintf("physical slot %s is streaming but holds no xmin: the standby's feedback has not arrived yet", slotName), "")
	default:
		d.add(OK, "standby physical slot", fmt.Sprintf("physical slot %s on the primary, streaming, holding the standby's feedback", slotName), "")
	}
}

// standbySnapshotPrivilege checks that the role may call
// pg_log_standby_snapshot() on the primary: a slot made on a standby waits
// for a running-transactions record, which the primary logs by itself at
// most every 15 s and only while busy.
func (d *diagnosis) standbySnapshotPrivilege(ctx context.Context) {
	var may bool
	err := d.conn.QueryRow(ctx, catalogSQL("StandbyMayLogSnapshot")).Scan(&may)
	switch {
	case err != nil:
		d.add(Warn, "pg_log_standby_snapshot", fmt.Sprintf("check the privilege on the primary: %v", err), "")
	case may:
		d.add(OK, "pg_log_standby_snapshot", "the role may call it: a slot made on the standby does not wait for the primary's next running-transactions record", "")
	default:
		d.add(Warn, "pg_log_standby_snapshot", "the role may not call pg_log_standby_snapshot() on the primary: making the slot on the standby waits for a running-transactions record, which the primary logs at most every 15 s while busy, and never while idle",
			fmt.Sprintf("as a superuser on the primary: GRANT EXECUTE ON FUNCTION pg_log_standby_snapshot() TO %s;", relay.QuoteIdentifier(d.role.name)))
	}
}

// standbySlot reports the relay's slot on the standby.
func (d *diagnosis) standbySlot(ctx context.Context, conn *pgx.Conn) {
	var (
		active, conflicting bool
		walStatus, reason   string
		retained            *int64
	)
	err := conn.QueryRow(ctx, catalogSQL("StandbySlot"), d.cfg.Slot).Scan(&active, &walStatus, &conflicting, &reason, &retained)
	name := "slot " + d.cfg.Slot + " on the standby"
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		d.add(OK, name, "does not exist yet: run creates it on the standby, handing the rows pending then to the claim path", "")
	case err != nil:
		d.add(Fail, name, fmt.Sprintf("read the standby's pg_replication_slots: %v", err), "")
	case walStatus == "lost" || conflicting || reason != "":
		d.add(Warn, name, fmt.Sprintf("invalidated (%s): run drops it and makes a new one through the hand-over", firstNonEmpty(reason, "conflicting", walStatus)),
			"on the standby: hot_standby_feedback = on and a physical slot (above) keep it valid")
	case active:
		d.add(OK, name, fmt.Sprintf("streaming; it retains %s of WAL on the standby", formatRetained(retained)), "")
	default:
		d.add(OK, name, fmt.Sprintf("exists, not streaming now; it retains %s of WAL on the standby", formatRetained(retained)), "")
	}
}

func firstNonEmpty(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

// standbyLag measures how long the standby takes to replay the primary's
// flushed position, read now, up to source.standby_max_lag.
func (d *diagnosis) standbyLag(ctx context.Context, conn *pgx.Conn) {
	var target relay.LSN
	if err := d.conn.QueryRow(ctx, catalogSQL("StandbyPrimaryFlushLSN")).Scan(&target); err != nil {
		d.add(Warn, "standby lag", fmt.Sprintf("read the primary's position: %v", err), "")
		return
	}
	bound := d.cfg.StandbyMaxLag
	if bound <= 0 {
		bound = 30 * time.Second
	}
	began := time.Now()
	for {
		var replayed relay.LSN
		if err := conn.QueryRow(ctx, catalogSQL("StandbyReplayedLSN")).Scan(&replayed); err != nil {
			d.add(Warn, "standby lag", fmt.Sprintf("read the standby's replayed position: %v", err), "")
			return
		}
		if replayed >= target {
			d.add(OK, "standby lag", fmt.Sprintf("the standby replayed the primary's position %s in %s (source.standby_max_lag %s)",
				target, time.Since(began).Round(time.Millisecond), bound), "")
			return
		}
		if time.Since(began) > bound {
			d.add(Warn, "standby lag", fmt.Sprintf("the standby had not replayed the primary's position %s after %s (it is at %s): past source.standby_max_lag, auto mode delivers on the primary",
				target, bound, replayed), "check the standby's replication from the primary (its log, pg_stat_wal_receiver) and its load")
			return
		}
		if !relay.Sleep(ctx, 10*time.Millisecond) {
			return
		}
	}
}
