package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// MinServerVersion is the oldest PostgreSQL the relay supports: 13 is the
// first release with pg_replication_slots.wal_status and
// max_slot_wal_keep_size.
const MinServerVersion = 130000

type roleInfo struct {
	name                                             string
	super, replication, createRole, createDB, bypass bool
	// rdsReplication is membership in Amazon RDS's rds_replication role,
	// which stands for the REPLICATION attribute there (rolreplication
	// stays false).
	rdsReplication bool
}

// canReplicate reports whether the role may open a replication connection
// and use replication slots.
func (r roleInfo) canReplicate() bool { return r.super || r.replication || r.rdsReplication }

// detectProvider recognises a managed service from the catalog and the
// host, and says which one when it finds one.
func (d *diagnosis) detectProvider(ctx context.Context) {
	m := readMarkers(ctx, d.conn, d.host)
	d.provider = DetectProvider(m)
	if d.provider == SelfManaged {
		return
	}
	var seen []string
	seen = append(seen, m.Settings...)
	seen = append(seen, m.Roles...)
	if m.AuroraVersion {
		seen = append(seen, "aurora_version()")
	}
	if len(seen) == 0 {
		seen = append(seen, "host "+d.host)
	}
	if len(seen) > 4 {
		seen = append(seen[:4], "...")
	}
	d.add(OK, "provider", fmt.Sprintf("%s (recognised by %s): fixes below are that service's; see docs/managed-postgres.md", d.provider, strings.Join(seen, ", ")), "")
}

func (d *diagnosis) connect(ctx context.Context) (*pgx.Conn, error) {
	cc, err := pgx.ParseConfig(d.cfg.ConnString)
	if err != nil {
		// pgx's parse errors can quote the string, password included.
		return nil, errors.New("database_url does not parse as a PostgreSQL URL or key=value string")
	}
	cc.RuntimeParams["application_name"] = CLIApplicationName
	if cc.ConnectTimeout == 0 || cc.ConnectTimeout > d.cfg.ConnectTimeout {
		cc.ConnectTimeout = d.cfg.ConnectTimeout
	}
	return pgx.ConnectConfig(ctx, cc)
}

// server checks the version and that this is a primary; false stops the
// diagnosis (the catalog queries below need 13+).
func (d *diagnosis) server(ctx context.Context) bool {
	var (
		user, db, version string
		num               int
		standby           bool
	)
	err := d.conn.QueryRow(ctx, catalogSQL("DoctorServer")).Scan(&user, &db, &version, &num, &standby)
	if err != nil {
		d.add(Fail, "connection", fmt.Sprintf("connected, but reading the server settings failed: %v", err), "")
		return false
	}
	d.version = num
	cc := d.conn.Config()
	d.add(OK, "connection", fmt.Sprintf("%s@%s on %s:%d", user, db, cc.Host, cc.Port), "")
	if num < MinServerVersion {
		d.add(Fail, "server version", fmt.Sprintf("PostgreSQL %s; the relay needs 13 or newer (pg_replication_slots.wal_status, max_slot_wal_keep_size)", version),
			"upgrade PostgreSQL to 13 or newer (tested on 15)")
		return false
	}
	d.add(OK, "server version", "PostgreSQL "+version, "")
	if standby {
		d.add(Fail, "primary", "the server is a standby (in recovery): the relay writes the outbox and its ledger and needs the primary",
			"point database_url at the primary (with several hosts: target_session_attrs=read-write)")
		return false
	}
	return true
}

func (d *diagnosis) walLevel(ctx context.Context) {
	var slots, senders int
	err := d.conn.QueryRow(ctx, catalogSQL("DoctorWALLevel")).Scan(&d.walLevelSetting, &slots, &senders)
	if err != nil {
		d.add(Fail, "wal_level", fmt.Sprintf("read wal_level: %v", err), "")
		return
	}
	switch {
	case d.walLevelSetting != "logical" && !d.cfg.Replication:
		d.add(OK, "wal_level", d.walLevelSetting+" (enough for source.mode poll)", "")
	case d.walLevelSetting != "logical" && !d.cfg.ReplicationRequired:
		// Polling is what auto mode does here by design (docs/configuration.md,
		// source.mode): the trade-off is latency, not correctness.
		d.add(Warn, "wal_level", fmt.Sprintf("%s: auto mode polls here: the claim path finds a new row at its next poll, every poll_interval (%s), "+
			"or at commit with source.notify_trigger: true; streaming, within milliseconds of commit, needs logical",
			d.walLevelSetting, d.pollInterval()),
			WALLevelFix(d.provider)+"\nor, to poll by choice, set source.mode: poll")
	case d.walLevelSetting != "logical":
		d.add(Fail, "wal_level", fmt.Sprintf("%s: source.mode replication needs logical: run does not start until then", d.walLevelSetting),
			WALLevelFix(d.provider))
	case d.cfg.Replication && (slots == 0 || senders == 0):
		fix := "ALTER SYSTEM SET max_replication_slots = 10;\nALTER SYSTEM SET max_wal_senders = 10;\n-- then restart PostgreSQL"
		if d.provider != SelfManaged {
			fix = SettingFix(d.provider, "max_replication_slots", "10", true) + "\n" + SettingFix(d.provider, "max_wal_senders", "10", true)
		}
		d.add(Fail, "wal_level", fmt.Sprintf("logical, but max_replication_slots = %d and max_wal_senders = %d leave no room for the relay's slot", slots, senders), fix)
	default:
		d.add(OK, "wal_level", "logical", "")
	}
}

func (d *diagnosis) readRole(ctx context.Context) bool {
	r := &d.role
	err := d.conn.QueryRow(ctx, catalogSQL("DoctorRole")).Scan(&r.name, &r.super, &r.replication, &r.createRole, &r.createDB, &r.bypass, &r.rdsReplication)
	if err != nil {
		d.add(Fail, "role", fmt.Sprintf("read the role's attributes: %v", err), "")
		return false
	}
	return true
}

func (d *diagnosis) replicationAttribute() {
	r := d.role
	switch {
	case !d.cfg.Replication:
		d.add(OK, "REPLICATION", "not needed in source.mode poll", "")
	case r.super:
		d.add(OK, "REPLICATION", fmt.Sprintf("role %s is a superuser", r.name), "")
	case r.replication:
		d.add(OK, "REPLICATION", fmt.Sprintf("role %s has REPLICATION", r.name), "")
	case r.rdsReplication:
		d.add(OK, "REPLICATION", fmt.Sprintf("role %s is a member of rds_replication", r.name), "")
	case !d.cfg.ReplicationRequired && d.walLevelSetting != "logical":
		// As wal_level: auto mode polls here until both are in place.
		d.add(Warn, "REPLICATION", fmt.Sprintf("role %s cannot open a replication connection: streaming needs that too, once wal_level is logical", r.name),
			ReplicationFix(d.provider, r.name))
	case d.provider == RDS || d.provider == Aurora:
		d.add(Fail, "REPLICATION", fmt.Sprintf("role %s is not a member of rds_replication: it cannot open the replication connection (the relay only polls)", r.name),
			ReplicationFix(d.provider, r.name))
	default:
		d.add(Fail, "REPLICATION", fmt.Sprintf("role %s lacks the REPLICATION attribute: it cannot open the replication connection (the relay only polls)", r.name),
			ReplicationFix(d.provider, r.name))
	}
}

// pollInterval is source.poll_interval, 1s when not given.
func (d *diagnosis) pollInterval() time.Duration {
	if d.cfg.PollInterval > 0 {
		return d.cfg.PollInterval
	}
	return time.Second
}

// notifyTrigger checks the poll-mode wake-up while the relay polls (poll
// mode, or auto mode below wal_level logical): without it a new row waits
// for the next poll; with source.notify_trigger the trigger migrate
// installs must be there, since run only listens.
func (d *diagnosis) notifyTrigger(ctx context.Context) {
	polls := !d.cfg.Replication || (!d.cfg.ReplicationRequired && d.walLevelSetting != "logical")
	if !polls || !d.exists[d.tables.Outbox] {
		return
	}
	trigger := migrations.NotifyTriggerName(d.tables.Outbox)
	var installed bool
	if err := d.conn.QueryRow(ctx, catalogSQL("DoctorTriggerExists"), d.tables.Outbox.Quoted(), trigger).Scan(&installed); err != nil {
		d.add(Fail, "notify_trigger", fmt.Sprintf("look up trigger %s: %v", trigger, err), "")
		return
	}
	interval := d.pollInterval()
	migrate := "outbox-relay migrate --config FILE   # as the owner of " + d.tables.Outbox.String() + ": installs the trigger"
	switch {
	case !d.cfg.NotifyTrigger:
		d.add(Warn, "notify_trigger", fmt.Sprintf("off: while the relay polls, a new row at a low event rate waits for the next poll: %s (half of poll_interval %s) at the median",
			interval/2, interval),
			"set source.notify_trigger: true, then run "+migrate+"\n(a statement-level trigger whose NOTIFY wakes the claim path at commit; docs/configuration.md)")
	case !installed:
		d.add(Warn, "notify_trigger", fmt.Sprintf("source.notify_trigger is true, but its trigger %s is not installed on %s: new rows wait for the next poll, every %s",
			trigger, d.tables.Outbox, interval), migrate)
	default:
		d.add(OK, "notify_trigger", fmt.Sprintf("trigger %s on %s wakes the claim path at commit", trigger, d.tables.Outbox), "")
	}
}

// replicationConnection opens the connection the stream path uses, which
// pg_hba.conf may treat differently from ordinary ones.
func (d *diagnosis) replicationConnection(ctx context.Context) {
	if !d.cfg.Replication || d.walLevelSetting != "logical" || !d.role.canReplicate() {
		return
	}
	pc, err := pgconn.ParseConfig(d.cfg.ConnString)
	if err != nil {
		return // connect already parsed it
	}
	pc.RuntimeParams["replication"] = "database"
	pc.RuntimeParams["application_name"] = CLIApplicationName
	if pc.ConnectTimeout == 0 || pc.ConnectTimeout > d.cfg.ConnectTimeout {
		pc.ConnectTimeout = d.cfg.ConnectTimeout
	}
	conn, err := pgconn.ConnectConfig(ctx, pc)
	if err == nil {
		_, err = pglogrepl.IdentifySystem(ctx, conn)
		closeCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = conn.Close(closeCtx)
		cancel()
	}
	if err == nil {
		d.add(OK, "replication connection", "IDENTIFY_SYSTEM answered", "")
		return
	}
	fix, _ := RefusalFix(d.provider, d.role.name, d.host, err)
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "28000" && d.provider == SelfManaged {
		fix = fmt.Sprintf("add a pg_hba.conf line for this role and database (a logical replication connection matches the database name, not the keyword \"replication\"), e.g.\nhost  %s  %s  10.0.0.0/8  scram-sha-256\n-- then SELECT pg_reload_conf();",
			pc.Database, d.role.name)
	}
	d.add(Fail, "replication connection", fmt.Sprintf("cannot open a replication connection: %v", err), fix)
}

// schema checks that migrate has run: the three tables exist and the
// version table records the latest version. It returns whether any table
// exists (the privilege check needs one).
func (d *diagnosis) schema(ctx context.Context) bool {
	migrate := "outbox-relay migrate --config FILE   # as the outbox table's owner"
	t, err := Resolve(ctx, d.conn, d.cfg.Tables)
	if err != nil {
		d.add(Fail, "schema", err.Error(), "")
		return false
	}
	d.tables = t
	d.exists = map[relay.QualifiedName]bool{}
	var missing []string
	for _, n := range []relay.QualifiedName{t.Outbox, t.Ledger, t.Checkpoint} {
		var ok bool
		if err := d.conn.QueryRow(ctx, catalogSQL("DoctorTableExists"), n.Quoted()).Scan(&ok); err != nil {
			d.add(Fail, "schema", fmt.Sprintf("look up %s: %v", n, err), "")
			return false
		}
		d.exists[n] = ok
		if !ok {
			missing = append(missing, n.String())
		}
	}
	if !d.exists[t.Outbox] {
		d.add(Fail, "schema", fmt.Sprintf("the outbox table %s does not exist (or this role cannot see its schema)", t.Outbox), migrate)
		return len(missing) < 3
	}
	if len(missing) > 0 {
		d.add(Fail, "schema", fmt.Sprintf("%s missing: migrate has not run", strings.Join(missing, ", ")), migrate)
		return true
	}

	latest := migrations.Latest()
	vt := migrations.VersionTable(t.Outbox)
	var version int32
	err = d.conn.QueryRow(ctx, t.sql("DoctorSchemaVersion")).Scan(&version)
	pgErr, _ := errors.AsType[*pgconn.PgError](err)
	switch {
	case pgErr != nil && pgErr.Code == "42P01": // undefined_table
		d.add(Fail, "schema", fmt.Sprintf("%s has no version table %s: migrate has not run", t.Outbox, vt), migrate)
	case pgErr != nil && pgErr.Code == "42501": // insufficient_privilege: look at the catalog instead
		var replays bool
		if err := d.conn.QueryRow(ctx, catalogSQL("DoctorHasReplaysColumn"), t.Outbox.Quoted()).Scan(&replays); err != nil {
			d.add(Fail, "schema", fmt.Sprintf("read the columns of %s: %v", t.Outbox, err), "")
			return true
		}
		if !replays {
			d.add(Fail, "schema", fmt.Sprintf("%s lacks the replays column of migration 006: migrate has not run to the end", t.Outbox), migrate)
			return true
		}
		d.add(OK, "schema", fmt.Sprintf("%s has the replays column of migration 006 (this role cannot read %s, so whether migration %d ran is for run to check)", t.Outbox, vt, latest), "")
	case err != nil:
		d.add(Fail, "schema", fmt.Sprintf("read %s: %v", vt, err), "")
	case version < latest:
		d.add(Fail, "schema", fmt.Sprintf("%s is at schema version %d; this build needs %d", t.Outbox, version, latest), migrate)
	case version > latest:
		d.add(Warn, "schema", fmt.Sprintf("%s is at schema version %d, newer than this build's %d", t.Outbox, version, latest),
			"upgrade outbox-relay to the release that migrated the schema")
	default:
		d.add(OK, "schema", fmt.Sprintf("%s, %s, %s at version %d", t.Outbox, t.Ledger, t.Checkpoint, version), "")
	}
	return true
}
