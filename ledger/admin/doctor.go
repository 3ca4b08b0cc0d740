package admin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// CheckStatus is the outcome of one doctor check.
type CheckStatus string

// Check outcomes. Only Fail makes doctor exit non-zero.
const (
	OK   CheckStatus = "ok"
	Warn CheckStatus = "warn"
	Fail CheckStatus = "FAIL"
	Skip CheckStatus = "skip"
)

// Check is one doctor finding. Fix, for Warn and Fail, is the exact
// statement or setting that resolves it.
type Check struct {
	Name   string      `json:"name"`
	Status CheckStatus `json:"status"`
	Detail string      `json:"detail"`
	Fix    string      `json:"fix,omitempty"`
}

// MinServerVersion is the oldest PostgreSQL the relay supports: 13 is the
// first release with pg_replication_slots.wal_status and
// max_slot_wal_keep_size.
const MinServerVersion = 130000

// staleReply is how long a process may hold the slot without sending a
// standby status update before doctor calls it stale; a relay sends one at
// least every second.
const staleReply = 15 * time.Second

// DiagnoseConfig says what Diagnose checks.
type DiagnoseConfig struct {
	// ConnString is the relay's database_url.
	ConnString string
	// ConnectTimeout bounds each connection attempt [10s].
	ConnectTimeout time.Duration
	Tables         Tables
	Publication    string
	Slot           string
	// Replication is true unless source.mode is poll: the stream path then
	// needs wal_level logical, the REPLICATION attribute, the publication
	// and the slot.
	Replication bool
	// Retention is retention.enabled: run then deletes done rows and needs
	// DELETE on the outbox.
	Retention bool
	// SlotMaxRetained is source.slot_max_retained, in bytes.
	SlotMaxRetained int64
}

// Diagnose checks the database side of a relay: the connection, the server
// version, that it is a primary, wal_level, the role's REPLICATION attribute
// and a replication connection, the schema version, the privileges the run
// role needs and those it has beyond them, the publication, the slot (state,
// holder, retained WAL), max_slot_wal_keep_size, (18+)
// idle_replication_slot_timeout, the settings that bound how long a
// vanished or cut-off relay's sessions outlive it (wal_sender_timeout, TCP
// keepalives, idle_session_timeout, idle_in_transaction_session_timeout;
// docs/operations-health.md) and, when physical standbys exist, what a
// failover to one needs (failover.go). On a managed service it recognises
// (DetectProvider) the fixes are that service's. It connects as the relay
// would, only reads, and reports every problem it finds with its fix; it
// never returns an error of its own.
func Diagnose(ctx context.Context, cfg DiagnoseConfig) []Check {
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = 10 * time.Second
	}
	d := &diagnosis{cfg: cfg}
	if cc, err := pgconn.ParseConfig(cfg.ConnString); err == nil {
		d.host, d.user = cc.Host, cc.User
	}
	// Before connecting, only the host name can tell the provider.
	d.provider = DetectProvider(ServerMarkers{Host: d.host})
	conn, err := d.connect(ctx)
	if err != nil {
		fix := "check database_url (or --database-url, DATABASE_URL, the PG* variables), that the server is up and that pg_hba.conf admits this role from this host"
		// An ordinary connection: a pooler's host alone says nothing.
		if classifyRefusal(err) != refusalUnknown {
			fix, _ = RefusalFix(d.provider, d.user, d.host, err)
		}
		d.add(Fail, "connection", fmt.Sprintf("cannot connect: %v", err), fix)
		return d.checks
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	d.conn = conn
	if !d.server(ctx) {
		return d.checks
	}
	d.detectProvider(ctx)
	d.walLevel(ctx)
	if !d.readRole(ctx) {
		return d.checks
	}
	d.replicationAttribute()
	d.replicationConnection(ctx)
	if d.schema(ctx) {
		d.privileges(ctx)
	}
	d.extraPrivileges()
	d.publication(ctx)
	d.slot(ctx)
	d.maxSlotWALKeepSize(ctx)
	d.idleSlotTimeout(ctx)
	d.walSenderTimeout(ctx)
	d.vanishedSessions(ctx)
	d.idleSessionTimeout(ctx)
	d.failover(ctx)
	return d.checks
}

type diagnosis struct {
	cfg    DiagnoseConfig
	conn   *pgx.Conn
	checks []Check

	// From the server and the role.
	walLevelSetting string
	version         int // server_version_num
	role            roleInfo
	// host and user are database_url's; provider is the managed service
	// the server belongs to (SelfManaged if none).
	host, user string
	provider   Provider
	// tables are the configured tables, schema-qualified when they exist.
	tables Tables
	exists map[relay.QualifiedName]bool
	// privs are the privileges on each existing table, by name.
	privs []tablePrivileges
}

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

func (d *diagnosis) add(status CheckStatus, name, detail, fix string) {
	d.checks = append(d.checks, Check{Name: name, Status: status, Detail: detail, Fix: fix})
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
	err := d.conn.QueryRow(ctx, `SELECT current_user, current_database(), current_setting('server_version'),
		current_setting('server_version_num')::int, pg_is_in_recovery()`).Scan(&user, &db, &version, &num, &standby)
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
	err := d.conn.QueryRow(ctx, `SELECT current_setting('wal_level'), current_setting('max_replication_slots')::int,
		current_setting('max_wal_senders')::int`).Scan(&d.walLevelSetting, &slots, &senders)
	if err != nil {
		d.add(Fail, "wal_level", fmt.Sprintf("read wal_level: %v", err), "")
		return
	}
	switch {
	case d.walLevelSetting != "logical" && !d.cfg.Replication:
		d.add(OK, "wal_level", d.walLevelSetting+" (enough for source.mode poll)", "")
	case d.walLevelSetting != "logical":
		d.add(Fail, "wal_level", fmt.Sprintf("%s: the stream path needs logical (until then the relay only polls, every poll_interval)", d.walLevelSetting),
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
	err := d.conn.QueryRow(ctx, `SELECT rolname, rolsuper, rolreplication, rolcreaterole, rolcreatedb, rolbypassrls,
		coalesce((SELECT pg_has_role(current_user, g.oid, 'MEMBER') FROM pg_roles g WHERE g.rolname = 'rds_replication'), false)
		FROM pg_roles WHERE rolname = current_user`).Scan(&r.name, &r.super, &r.replication, &r.createRole, &r.createDB, &r.bypass, &r.rdsReplication)
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
	case d.provider == RDS || d.provider == Aurora:
		d.add(Fail, "REPLICATION", fmt.Sprintf("role %s is not a member of rds_replication: it cannot open the replication connection (the relay only polls)", r.name),
			ReplicationFix(d.provider, r.name))
	default:
		d.add(Fail, "REPLICATION", fmt.Sprintf("role %s lacks the REPLICATION attribute: it cannot open the replication connection (the relay only polls)", r.name),
			ReplicationFix(d.provider, r.name))
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
		if err := d.conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", n.Quoted()).Scan(&ok); err != nil {
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
	err = d.conn.QueryRow(ctx, "SELECT version FROM "+vt.Quoted()).Scan(&version)
	pgErr, _ := errors.AsType[*pgconn.PgError](err)
	switch {
	case pgErr != nil && pgErr.Code == "42P01": // undefined_table
		d.add(Fail, "schema", fmt.Sprintf("%s has no version table %s: migrate has not run", t.Outbox, vt), migrate)
	case pgErr != nil && pgErr.Code == "42501": // insufficient_privilege: look at the catalog instead
		var replays bool
		if err := d.conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1)
			AND attname = 'replays' AND NOT attisdropped)`, t.Outbox.Quoted()).Scan(&replays); err != nil {
			d.add(Fail, "schema", fmt.Sprintf("read the columns of %s: %v", t.Outbox, err), "")
			return true
		}
		if !replays {
			d.add(Fail, "schema", fmt.Sprintf("%s lacks the replays column of migration %d", t.Outbox, latest), migrate)
			return true
		}
		d.add(OK, "schema", fmt.Sprintf("%s has the columns of migration %d (this role cannot read %s)", t.Outbox, latest, vt), "")
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

// tablePrivileges is what the role may do with one table.
type tablePrivileges struct {
	table     relay.QualifiedName // schema-qualified
	need      []string
	have      map[string]bool
	schemaUse bool
	owner     string
	owns      bool // the role is, or is a member of, the owner
}

// allTablePrivileges are the privileges has_table_privilege knows besides
// MAINTAIN (17+).
var allTablePrivileges = []string{"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER"}

// NeededPrivileges returns the table privileges run needs, by table.
func NeededPrivileges(t Tables, retention bool) []TableGrant {
	outbox := []string{"SELECT", "UPDATE"}
	if retention {
		outbox = append(outbox, "DELETE")
	}
	rw := []string{"SELECT", "INSERT", "UPDATE", "DELETE"}
	return []TableGrant{{t.Outbox, outbox}, {t.Ledger, rw}, {t.Checkpoint, rw}, {t.Delivered(), []string{"SELECT", "INSERT", "DELETE"}}}
}

// TableGrant is a set of privileges on one table.
type TableGrant struct {
	Table      relay.QualifiedName
	Privileges []string
}

// LeastPrivilegeRole returns the statements that create a role for run with
// exactly the rights it needs (docs/security.md, "a least-privilege role"): LOGIN and
// REPLICATION (unless the relay only polls), USAGE on the tables' schemas,
// and the table privileges of NeededPrivileges. The password is left for
// the reader to fill in.
func LeastPrivilegeRole(role string, t Tables, replication, retention bool) []string {
	attrs := "LOGIN"
	if replication {
		attrs += " REPLICATION"
	}
	q := relay.QuoteIdentifier(role)
	stmts := []string{fmt.Sprintf("CREATE ROLE %s %s PASSWORD '…';", q, attrs)}
	var schemas []string
	for _, g := range NeededPrivileges(t, retention) {
		if s := g.Table.Schema; s != "" && !slices.Contains(schemas, s) {
			schemas = append(schemas, s)
			stmts = append(stmts, fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s;", relay.QuoteIdentifier(s), q))
		}
	}
	for _, g := range NeededPrivileges(t, retention) {
		stmts = append(stmts, fmt.Sprintf("GRANT %s ON %s TO %s;", strings.Join(g.Privileges, ", "), g.Table.Quoted(), q))
	}
	return stmts
}

func (d *diagnosis) privileges(ctx context.Context) {
	role := relay.QuoteIdentifier(d.role.name)
	for _, g := range NeededPrivileges(d.tables, d.cfg.Retention) {
		if !d.exists[g.Table] {
			continue // reported by schema
		}
		p := tablePrivileges{table: g.Table, need: g.Privileges, have: map[string]bool{}}
		cols := make([]string, len(allTablePrivileges))
		dest := []any{&p.schemaUse, &p.owner, &p.owns}
		vals := make([]bool, len(allTablePrivileges))
		for i, priv := range allTablePrivileges {
			cols[i] = fmt.Sprintf("has_table_privilege(c.oid, '%s')", priv)
			dest = append(dest, &vals[i])
		}
		err := d.conn.QueryRow(ctx, `
SELECT has_schema_privilege(c.relnamespace, 'USAGE'), pg_get_userbyid(c.relowner),
       -- a superuser is a member of every role; it owns only what it owns
       CASE WHEN r.rolsuper THEN c.relowner = r.oid ELSE pg_has_role(c.relowner, 'MEMBER') END, `+
			strings.Join(cols, ", ")+`
  FROM pg_class c, pg_roles r WHERE c.oid = to_regclass($1) AND r.rolname = current_user`, g.Table.Quoted()).Scan(dest...)
		name := "privileges on " + g.Table.String()
		if err != nil {
			d.add(Fail, name, fmt.Sprintf("read privileges: %v", err), "")
			continue
		}
		for i, priv := range allTablePrivileges {
			p.have[priv] = vals[i]
		}
		d.privs = append(d.privs, p)

		var missing []string
		for _, priv := range g.Privileges {
			if !p.have[priv] {
				missing = append(missing, priv)
			}
		}
		var fix []string
		if !p.schemaUse {
			fix = append(fix, fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s;", relay.QuoteIdentifier(g.Table.Schema), role))
		}
		if len(missing) > 0 {
			fix = append(fix, fmt.Sprintf("GRANT %s ON %s TO %s;", strings.Join(missing, ", "), g.Table.Quoted(), role))
		}
		if len(fix) == 0 {
			d.add(OK, name, strings.Join(g.Privileges, ", "), "")
			continue
		}
		lacks := append([]string{}, missing...)
		if !p.schemaUse {
			lacks = append(lacks, "USAGE on schema "+g.Table.Schema)
		}
		why := ""
		if slices.Contains(missing, "DELETE") && g.Table == d.tables.Outbox {
			why = " (DELETE: retention.enabled prunes done rows)"
		}
		d.add(Fail, name, fmt.Sprintf("role %s lacks %s%s", d.role.name, strings.Join(lacks, ", "), why), strings.Join(fix, "\n"))
	}
}

// extraPrivileges warns about rights run has but does not need.
func (d *diagnosis) extraPrivileges() {
	r := d.role
	role := relay.QuoteIdentifier(r.name)
	var found, fix []string
	if r.super {
		found = append(found, "is a superuser (it may do anything, including dropping the outbox)")
	}
	var attrs []string
	for _, a := range []struct {
		has  bool
		name string
	}{{r.createRole, "CREATEROLE"}, {r.createDB, "CREATEDB"}, {r.bypass, "BYPASSRLS"}, {r.replication && !d.cfg.Replication, "REPLICATION"}} {
		if a.has {
			attrs = append(attrs, a.name)
		}
	}
	if len(attrs) > 0 && !r.super {
		found = append(found, "has "+strings.Join(attrs, ", "))
		fix = append(fix, fmt.Sprintf("ALTER ROLE %s WITH NO%s;", role, strings.Join(attrs, " NO")))
	}
	var owned []string
	for _, p := range d.privs {
		if p.owns {
			t := p.table.String()
			if p.owner != r.name {
				t += " (as a member of its owner " + p.owner + ")"
			}
			owned = append(owned, t)
			continue
		}
		if r.super {
			continue
		}
		var extra []string
		for _, priv := range allTablePrivileges {
			if p.have[priv] && !slices.Contains(p.need, priv) {
				extra = append(extra, priv)
			}
		}
		if len(extra) > 0 {
			found = append(found, fmt.Sprintf("has %s on %s", strings.Join(extra, ", "), p.table))
			fix = append(fix, fmt.Sprintf("REVOKE %s ON %s FROM %s;   -- or from the role or PUBLIC that grants it", strings.Join(extra, ", "), p.table.Quoted(), role))
		}
	}
	if len(owned) > 0 {
		found = append(found, fmt.Sprintf("owns %s (an owner may ALTER and DROP a table; only migrate needs that)", strings.Join(owned, ", ")))
	}
	if len(found) == 0 {
		d.add(OK, "least privilege", fmt.Sprintf("role %s has no rights beyond what run needs", r.name), "")
		return
	}
	if r.super || slices.ContainsFunc(d.privs, func(p tablePrivileges) bool { return p.owns }) {
		fix = append(fix, "-- run migrate as the table owner, and run as a role with only what it needs:")
		fix = append(fix, LeastPrivilegeRole("outbox_relay", d.tables, d.cfg.Replication, d.cfg.Retention)...)
	}
	d.add(Warn, "least privilege", fmt.Sprintf("role %s %s", r.name, strings.Join(found, "; ")), strings.Join(fix, "\n"))
}

func (d *diagnosis) publication(ctx context.Context) {
	if !d.cfg.Replication {
		return
	}
	outbox := d.tables.Outbox
	if !d.exists[outbox] {
		d.add(Skip, "publication "+d.cfg.Publication, "the outbox table does not exist", "")
		return
	}
	pub := relay.QuoteIdentifier(d.cfg.Publication)
	var covers, all, inserts, others bool
	err := d.conn.QueryRow(ctx, `
SELECT EXISTS (SELECT 1 FROM pg_publication_rel r WHERE r.prpubid = p.oid AND r.prrelid = to_regclass($2)),
       p.puballtables, p.pubinsert, p.pubupdate OR p.pubdelete OR p.pubtruncate
  FROM pg_publication p WHERE p.pubname = $1`, d.cfg.Publication, outbox.Quoted()).Scan(&covers, &all, &inserts, &others)
	name := "publication " + d.cfg.Publication
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		d.add(Fail, name, "does not exist: the stream path has nothing to stream",
			fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert');   -- as the table owner (outbox-relay migrate does this)", pub, outbox.Quoted()))
	case err != nil:
		d.add(Fail, name, fmt.Sprintf("read publication: %v", err), "")
	case !covers && !all:
		d.add(Fail, name, fmt.Sprintf("does not include %s", outbox),
			fmt.Sprintf("ALTER PUBLICATION %s ADD TABLE %s;   -- as the table owner", pub, outbox.Quoted()))
	case !inserts:
		d.add(Fail, name, "does not publish inserts", fmt.Sprintf("ALTER PUBLICATION %s SET (publish = 'insert');", pub))
	case all || others:
		d.add(Warn, name, "publishes more than the outbox's inserts (other tables or updates/deletes): the relay ignores them, but each is decoded and sent to it — every status UPDATE the relay makes comes back",
			fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert');   -- under a new name (source.publication), or ALTER PUBLICATION %s SET (publish = 'insert');",
				relay.QuoteIdentifier(d.cfg.Publication+"_outbox"), outbox.Quoted(), pub))
	default:
		d.add(OK, name, fmt.Sprintf("publishes inserts of %s", outbox), "")
	}
}

func (d *diagnosis) slot(ctx context.Context) {
	var (
		slotType, plugin, database, walStatus, app, client string
		invalidation                                       string
		sameDB, active                                     bool
		pid                                                int32
		retained                                           *int64
		backendStart                                       *time.Time
		replyAge                                           *float64
	)
	err := d.conn.QueryRow(ctx, `
SELECT s.slot_type, coalesce(s.plugin, ''), coalesce(s.database, ''), coalesce(s.database = current_database(), false),
       coalesce(s.wal_status, ''), coalesce(to_jsonb(s) ->> 'invalidation_reason', ''), s.active, coalesce(s.active_pid, 0),
       -- an invalidated slot retains nothing, whatever restart_lsn says (18 keeps it)
       CASE WHEN s.wal_status <> 'lost' AND to_jsonb(s) ->> 'invalidation_reason' IS NULL
            THEN pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint END,
       coalesce(a.application_name, ''), a.backend_start, coalesce(host(a.client_addr), ''),
       extract(epoch FROM now() - r.reply_time)::float8
  FROM pg_replication_slots s
  LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
  LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
 WHERE s.slot_name = $1`, d.cfg.Slot).Scan(&slotType, &plugin, &database, &sameDB, &walStatus, &invalidation, &active, &pid,
		&retained, &app, &backendStart, &client, &replyAge)
	name := "slot " + d.cfg.Slot
	drop := fmt.Sprintf("SELECT pg_drop_replication_slot(%s);", relay.QuoteLiteral(d.cfg.Slot))
	switch {
	case errors.Is(err, pgx.ErrNoRows) && d.cfg.Replication:
		d.add(OK, name, "does not exist yet: run creates it, handing the rows pending at that moment to the claim path", "")
		return
	case errors.Is(err, pgx.ErrNoRows):
		return
	case err != nil:
		fix := ""
		if classifyRefusal(err) != refusalUnknown { // Aurora refuses pg_current_wal_lsn() below wal_level logical
			fix, _ = RefusalFix(d.provider, d.role.name, d.host, err)
		}
		d.add(Fail, name, fmt.Sprintf("read pg_replication_slots: %v", err), fix)
		return
	}
	if !d.cfg.Replication {
		if !active {
			d.add(Warn, name, fmt.Sprintf("exists, but source.mode poll never consumes it: it retains %s of WAL and keeps growing", formatRetained(retained)), drop)
		}
		return
	}
	holder := fmt.Sprintf("pid %d (application_name %q", pid, app)
	if client != "" {
		holder += ", from " + client
	}
	if backendStart != nil {
		holder += ", since " + backendStart.UTC().Format(time.RFC3339)
	}
	holder += ")"
	terminate := fmt.Sprintf("SELECT pg_terminate_backend(%d);", pid)

	switch {
	case slotType != "logical":
		d.add(Fail, name, fmt.Sprintf("is a %s slot, not the relay's", slotType), "set source.slot to another name, or drop it: "+drop)
	case !sameDB:
		d.add(Fail, name, fmt.Sprintf("belongs to database %q", database), "set source.slot to another name")
	case plugin != "pgoutput":
		d.add(Fail, name, fmt.Sprintf("uses plugin %q, not pgoutput", plugin), "set source.slot to another name, or drop it: "+drop)
	case walStatus == "lost" || invalidation != "":
		d.add(Warn, name, fmt.Sprintf("was invalidated (%s); run drops and recreates it, and the claim path delivers the rows in between", invalidationCause(walStatus, invalidation)),
			"nothing is required; to drop it now: "+drop)
	case active && replyAge != nil && *replyAge > staleReply.Seconds():
		d.add(Fail, name, fmt.Sprintf("held by %s, which has sent no status for %.0fs: a stale process keeps the relay from streaming", holder, *replyAge), terminate)
	case active && !strings.HasPrefix(app, "outbox-relay"):
		d.add(Warn, name, fmt.Sprintf("held by %s, which is not outbox-relay: the relay cannot stream while it does", holder),
			"if that process should not consume the relay's slot: "+terminate)
	case active:
		d.add(OK, name, fmt.Sprintf("streaming to %s; if no relay should be running, end it: %s", holder, terminate), "")
	case walStatus == "unreserved":
		d.add(Warn, name, "retains more WAL than max_slot_wal_keep_size (wal_status unreserved): it is invalidated unless a relay consumes it soon",
			"start the relay (outbox-relay run); or, if it is no longer used: "+drop)
	default:
		d.add(OK, name, fmt.Sprintf("exists (wal_status %s), not in use: run resumes from it", walStatus), "")
	}

	if retained == nil {
		return
	}
	limit := d.cfg.SlotMaxRetained
	if limit > 0 && *retained > limit {
		d.add(Warn, "retained WAL", fmt.Sprintf("the slot retains %s, more than source.slot_max_retained (%s): run drops a slot it owns but cannot consume past that", FormatBytes(*retained), FormatBytes(limit)),
			"start the relay, or if it cannot catch up: "+drop)
		return
	}
	d.add(OK, "retained WAL", fmt.Sprintf("%s (source.slot_max_retained %s)", FormatBytes(*retained), FormatBytes(limit)), "")
}

// invalidationCause explains why the server invalidated a slot, from its
// wal_status and invalidation_reason (17+; "" before).
func invalidationCause(walStatus, reason string) string {
	switch reason {
	case "", "wal_removed":
		return "wal_status " + walStatus + ": it fell further behind than max_slot_wal_keep_size"
	case "idle_timeout":
		return "invalidation_reason idle_timeout: no one used it for longer than idle_replication_slot_timeout"
	case "wal_level_insufficient":
		return "invalidation_reason wal_level_insufficient: wal_level was set below logical"
	case "rows_removed":
		return "invalidation_reason rows_removed: rows it still needed were vacuumed away"
	}
	return "invalidation_reason " + reason
}

func formatRetained(b *int64) string {
	if b == nil {
		return "an unknown amount"
	}
	return FormatBytes(*b)
}

// recommendedKeepSize is the max_slot_wal_keep_size doctor suggests: ten
// times the relay's own limit, and at least 10 GiB.
func recommendedKeepSize(slotMaxRetained int64) int64 {
	return max(10<<30, 10*slotMaxRetained)
}

func (d *diagnosis) maxSlotWALKeepSize(ctx context.Context) {
	var mb int64
	if err := d.conn.QueryRow(ctx, `SELECT setting::bigint FROM pg_settings WHERE name = 'max_slot_wal_keep_size'`).Scan(&mb); err != nil {
		d.add(Fail, "max_slot_wal_keep_size", fmt.Sprintf("read setting: %v", err), "")
		return
	}
	if mb >= 0 {
		d.add(OK, "max_slot_wal_keep_size", FormatBytes(mb<<20), "")
		return
	}
	rec := recommendedKeepSize(d.cfg.SlotMaxRetained)
	fix := fmt.Sprintf("ALTER SYSTEM SET max_slot_wal_keep_size = '%dGB';   -- well above the relay's slot_max_retained, well below the free space of pg_wal's disk\nSELECT pg_reload_conf();", rec>>30)
	if d.provider != SelfManaged {
		fix = SettingFix(d.provider, "max_slot_wal_keep_size", sizeSetting(d.provider, rec>>30), false) + "   -- in MB when a plain number; well above the relay's slot_max_retained, well below the storage left for WAL"
	}
	d.add(Warn, "max_slot_wal_keep_size",
		"-1 (unlimited): a slot no one consumes keeps all WAL from its position on, until pg_wal fills the disk and the primary stops. "+
			"A running relay drops a slot it cannot consume (source.slot_max_unconsumed), but a relay that is down cannot. "+
			"With a limit the server invalidates such a slot instead; the relay recreates it and the claim path delivers the rows in between",
		fix)
}

// shortIdleSlotTimeout is the idle_replication_slot_timeout below which
// doctor warns: a relay restart or an HA takeover can leave the slot unused
// for that long.
const shortIdleSlotTimeout = 10 * time.Minute

// idleSlotTimeout reports idle_replication_slot_timeout (PostgreSQL 18+; on
// older servers there is nothing to report).
func (d *diagnosis) idleSlotTimeout(ctx context.Context) {
	if !d.cfg.Replication {
		return
	}
	var seconds int64
	err := d.conn.QueryRow(ctx, `SELECT setting::bigint FROM pg_settings WHERE name = 'idle_replication_slot_timeout'`).Scan(&seconds)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return
	case err != nil:
		d.add(Fail, "idle_replication_slot_timeout", fmt.Sprintf("read setting: %v", err), "")
		return
	}
	timeout := time.Duration(seconds) * time.Second
	switch {
	case seconds == 0:
		d.add(OK, "idle_replication_slot_timeout", "0 (slots are not invalidated for being unused)", "")
	case timeout < shortIdleSlotTimeout:
		d.add(Warn, "idle_replication_slot_timeout",
			fmt.Sprintf("%s: a relay restart or HA takeover that leaves the slot unused that long (until the next checkpoint) loses it; run recreates it and the claim path delivers the rows in between, more slowly than the stream", timeout),
			idleTimeoutFix(d.provider))
	default:
		d.add(OK, "idle_replication_slot_timeout", fmt.Sprintf("%s: a relay down longer than that loses its slot; run recreates it and the claim path delivers the rows in between", timeout), "")
	}
}

func idleTimeoutFix(p Provider) string {
	if p != SelfManaged {
		return SettingFix(p, "idle_replication_slot_timeout", durationSetting(p, 3600), false) + "   -- one hour (in seconds when a plain number): longer than any relay downtime you plan for"
	}
	return "ALTER SYSTEM SET idle_replication_slot_timeout = '1h';   -- longer than any relay downtime you plan for\nSELECT pg_reload_conf();"
}

// FormatBytes prints n bytes with a binary unit ("12.3 MiB").
func FormatBytes(n int64) string {
	const unit = 1024
	if n < unit && n > -unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit || m <= -unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// The timeouts that bound faults that are not crashes
// (docs/operations-health.md, "Timeouts, fences and health"). The relay
// asks for its own TCP keepalives on its lock connections; the server's
// settings decide how long the sessions of a relay that vanished, or whose
// network swallows packets, keep what they hold. Each is a setting a
// session may change, so the fixes set them for the relay's role alone.

// Bounds doctor holds the settings to.
const (
	// maxWALSenderTimeout: above it, a walsender whose relay vanished
	// holds the slot (and a relay waits for a silent connection
	// mid-transaction) longer than the documented minute.
	maxWALSenderTimeout = time.Minute
	// minWALSenderTimeout: below it, the relay's own receive limit (at
	// least 10 s) is longer than the server's, and a slow network or a
	// large transaction ends healthy streams.
	minWALSenderTimeout = 10 * time.Second
	// maxKeepaliveDetection: above it, the server keeps the sessions of a
	// relay host that vanished (an unfinished transaction's row locks)
	// for too long.
	maxKeepaliveDetection = 2 * time.Minute
	// minIdleSessionTimeout: below it, idle_session_timeout ends the
	// relay's lock connections between their pings (every second, each
	// taking up to 2 s).
	minIdleSessionTimeout = 10 * time.Second
	// maxIdleInTransaction: the relay's transactions last milliseconds;
	// one left idle longer than this was left by a relay that is gone.
	maxIdleInTransaction = 10 * time.Minute
)

// readDuration reads a time setting of this session (as the relay's role
// sees it) in the unit pg_settings reports it in; missing reports a
// setting the server does not have.
func (d *diagnosis) readDuration(ctx context.Context, name string) (value time.Duration, missing bool, err error) {
	var setting int64
	var unit string
	err = d.conn.QueryRow(ctx, `SELECT setting::bigint, coalesce(unit, '') FROM pg_settings WHERE name = $1`, name).Scan(&setting, &unit)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, true, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("read %s: %w", name, err)
	}
	switch unit {
	case "ms":
		return time.Duration(setting) * time.Millisecond, false, nil
	case "s":
		return time.Duration(setting) * time.Second, false, nil
	case "min":
		return time.Duration(setting) * time.Minute, false, nil
	}
	return 0, false, fmt.Errorf("read %s: unexpected unit %q", name, unit)
}

// roleSetFix is the statement that sets name for the relay's role alone.
func (d *diagnosis) roleSetFix(settings ...string) string {
	var b strings.Builder
	for i := 0; i+1 < len(settings); i += 2 {
		fmt.Fprintf(&b, "ALTER ROLE %s SET %s = '%s';\n", relay.QuoteIdentifier(d.role.name), settings[i], settings[i+1])
	}
	b.WriteString("-- applies to the relay's new sessions: restart the relay")
	return b.String()
}

// walSenderTimeout reports wal_sender_timeout: how long the server keeps a
// walsender whose relay stopped answering, and, since the relay's receive
// limit follows it, how long the relay waits for a silent replication
// connection mid-transaction.
func (d *diagnosis) walSenderTimeout(ctx context.Context) {
	if !d.cfg.Replication {
		return
	}
	const name = "wal_sender_timeout"
	timeout, missing, err := d.readDuration(ctx, name)
	switch {
	case err != nil:
		d.add(Fail, name, err.Error(), "")
		return
	case missing:
		return
	}
	fix := d.roleSetFix(name, "60s")
	switch {
	case timeout == 0:
		d.add(Warn, name, "0 (off): the server never ends a walsender whose relay vanished or whose network swallows packets, so it holds the slot until TCP gives up; "+
			"a new leader ends it, but the relay then waits up to 60 s for a silent replication connection mid-transaction", fix)
	case timeout > maxWALSenderTimeout:
		d.add(Warn, name, fmt.Sprintf("%s: a walsender whose relay vanished holds the slot that long, and the relay waits as long for a silent replication connection mid-transaction", timeout), fix)
	case timeout < minWALSenderTimeout:
		d.add(Warn, name, fmt.Sprintf("%s: shorter than the relay's own receive limit (10 s): a slow network or a large transaction ends healthy streams", timeout), d.roleSetFix(name, "30s"))
	default:
		d.add(OK, name, fmt.Sprintf("%s: the server ends a walsender whose relay stopped answering after that; the relay gives a silent replication connection up after %s mid-transaction, 6.5 s between transactions",
			timeout, max(timeout, minWALSenderTimeout)), "")
	}
}

// keepalives reads the server's TCP keepalives on this (the relay role's)
// connection and returns how long the server takes to notice that a relay
// host vanished, with a description; tcp is false on a Unix socket.
func (d *diagnosis) keepalives(ctx context.Context) (detect time.Duration, detail string, tcp bool, err error) {
	var idle, interval, count, userTimeout int64
	err = d.conn.QueryRow(ctx, `SELECT inet_server_addr() IS NOT NULL,
		current_setting('tcp_keepalives_idle')::bigint, current_setting('tcp_keepalives_interval')::bigint,
		current_setting('tcp_keepalives_count')::bigint, coalesce((SELECT setting::bigint FROM pg_settings WHERE name = 'tcp_user_timeout'), 0)`).
		Scan(&tcp, &idle, &interval, &count, &userTimeout)
	if err != nil || !tcp {
		return 0, "", tcp, err
	}
	// 0 is the operating system's default; SHOW reports the socket's own
	// values on a TCP connection, so a 0 here is unusual: take Linux's.
	if idle == 0 {
		idle = 7200
	}
	if interval == 0 {
		interval = 75
	}
	if count == 0 {
		count = 9
	}
	detect = time.Duration(idle+interval*count) * time.Second
	detail = fmt.Sprintf("idle %ds, interval %ds, count %d: the server notices a relay host that vanished after about %s", idle, interval, count, detect)
	if userTimeout > 0 {
		detail += fmt.Sprintf(" (tcp_user_timeout %s while it has data to send)", time.Duration(userTimeout)*time.Millisecond)
	}
	return detect, detail, true, nil
}

// vanishedSessions reports how long the sessions of a relay that vanished
// mid-transaction (its host gone, or its network swallowing packets) keep
// the rows they were updating: until the server's TCP keepalives notice,
// or idle_in_transaction_session_timeout ends them, whichever comes first.
// The relay's transactions last milliseconds. Either setting, for the
// relay's role, bounds it; both checks warn while neither does.
func (d *diagnosis) vanishedSessions(ctx context.Context) {
	detect, detail, tcp, err := d.keepalives(ctx)
	if err != nil {
		d.add(Fail, "tcp keepalives", fmt.Sprintf("read the keepalive settings: %v", err), "")
		return
	}
	const name = "idle_in_transaction_session_timeout"
	timeout, missing, err := d.readDuration(ctx, name)
	if err != nil {
		d.add(Fail, name, err.Error(), "")
		return
	}
	bounded := !missing && timeout > 0 && timeout <= maxIdleInTransaction
	slowKeepalives := tcp && detect > maxKeepaliveDetection
	keepaliveFix := d.roleSetFix("tcp_keepalives_idle", "5", "tcp_keepalives_interval", "2", "tcp_keepalives_count", "3")
	idleFix := d.roleSetFix(name, "1min")
	const consequence = "a relay that vanishes mid-transaction leaves its session holding the rows it was updating until then, though the relay's transactions last milliseconds " +
		"(setting either the keepalives or idle_in_transaction_session_timeout for the relay's role bounds it)"
	switch {
	case !tcp:
		d.add(Skip, "tcp keepalives", "connected over a Unix socket: keepalives do not apply", "")
	case slowKeepalives && !bounded:
		d.add(Warn, "tcp keepalives", detail+"; "+consequence+". The relay's lock connections ask for 5 s, 2 s and 3 already", keepaliveFix)
	default:
		d.add(OK, "tcp keepalives", detail, "")
	}
	shown := timeout.String()
	if timeout == 0 {
		shown = "0 (off)"
	}
	switch {
	case missing:
	case bounded:
		d.add(OK, name, shown, "")
	case slowKeepalives:
		d.add(Warn, name, shown+": "+consequence, idleFix)
	default:
		d.add(OK, name, shown+": TCP keepalives end a vanished relay's sessions soon enough", "")
	}
}

// idleSessionTimeout reports idle_session_timeout (PostgreSQL 14+), which
// would end the relay's lock connections if they idled longer than it
// between their pings.
func (d *diagnosis) idleSessionTimeout(ctx context.Context) {
	const name = "idle_session_timeout"
	timeout, missing, err := d.readDuration(ctx, name)
	switch {
	case err != nil:
		d.add(Fail, name, err.Error(), "")
	case missing:
	case timeout == 0:
		d.add(OK, name, "0 (off)", "")
	case timeout < minIdleSessionTimeout:
		d.add(Warn, name, fmt.Sprintf("%s: ends the relay's leader and owner lock connections when a ping is late (they ping every second, each ping allowed 2 s), which ends its leadership or its claims", timeout),
			d.roleSetFix(name, "0"))
	default:
		d.add(OK, name, fmt.Sprintf("%s: ends the relay's idle pool and LISTEN connections, which it opens again; it also ends the lock sessions of a relay cut off from the server after that long", timeout), "")
	}
}
