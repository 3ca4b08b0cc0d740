package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Provider is a managed PostgreSQL service doctor recognises, so that its
// fixes are the ones that service allows (none of them allows ALTER SYSTEM
// or editing pg_hba.conf). docs/managed-postgres.md has each one's settings,
// grants and caveats, with the provider documentation they come from.
type Provider string

// The providers doctor recognises; SelfManaged is any other server.
const (
	SelfManaged   Provider = ""
	RDS           Provider = "Amazon RDS for PostgreSQL"
	Aurora        Provider = "Amazon Aurora PostgreSQL"
	CloudSQL      Provider = "Google Cloud SQL for PostgreSQL"
	Azure         Provider = "Azure Database for PostgreSQL flexible server"
	Supabase      Provider = "Supabase"
	Neon          Provider = "Neon"
	CrunchyBridge Provider = "Crunchy Bridge"
)

// ServerMarkers is what DetectProvider looks at: the host of database_url
// and what the server's catalog shows.
type ServerMarkers struct {
	// Host is the host name database_url connects to.
	Host string
	// Settings are the names of the server's settings that belong to a
	// provider (rds.*, cloudsql.*, azure.*, neon.*, ...).
	Settings []string
	// Roles are the provider roles that exist (rds_superuser,
	// cloudsqlsuperuser, azure_pg_admin, supabase_admin, neon_superuser, ...).
	Roles []string
	// AuroraVersion is whether the function aurora_version() exists.
	AuroraVersion bool
}

// markerRoles are the roles DetectProvider knows, each created by one
// provider on every server it runs.
var markerRoles = []string{"rds_superuser", "rds_replication", "cloudsqlsuperuser", "azure_pg_admin", "supabase_admin", "neon_superuser"}

// markerSettingPrefixes are the prefixes of the provider-specific settings
// DetectProvider knows.
var markerSettingPrefixes = []string{"rds.", "apg_", "aurora.", "cloudsql.", "azure.", "neon.", "supautils."}

// markerSettings are provider settings read by name as well: pg_settings
// leaves out settings marked not to be shown, and a setting an extension
// has not defined yet.
var markerSettings = []string{"rds.logical_replication", "rds.extensions", "cloudsql.logical_decoding", "cloudsql.iam_authentication",
	"azure.extensions", "neon.tenant_id", "neon.timeline_id", "supautils.reserved_roles"}

// DetectProvider names the managed service the server belongs to, from the
// catalog first (a connection through a proxy or a custom DNS name hides
// the provider's host name) and then from the host name. It returns
// SelfManaged when nothing matches.
func DetectProvider(m ServerMarkers) Provider {
	hasSetting := func(prefix string) bool {
		for _, s := range m.Settings {
			if strings.HasPrefix(s, prefix) {
				return true
			}
		}
		return false
	}
	hasRole := func(name string) bool {
		for _, r := range m.Roles {
			if r == name {
				return true
			}
		}
		return false
	}
	host := strings.ToLower(strings.TrimSuffix(m.Host, "."))
	switch {
	case m.AuroraVersion || hasSetting("apg_") || hasSetting("aurora."):
		return Aurora
	case hasSetting("rds.") || hasRole("rds_superuser") || hasRole("rds_replication"):
		if strings.Contains(host, ".cluster-") && strings.HasSuffix(host, ".rds.amazonaws.com") {
			return Aurora
		}
		return RDS
	case hasSetting("cloudsql.") || hasRole("cloudsqlsuperuser"):
		return CloudSQL
	case hasSetting("azure.") || hasRole("azure_pg_admin"):
		return Azure
	case hasSetting("neon.") || hasRole("neon_superuser"):
		return Neon
	case hasRole("supabase_admin") || hasSetting("supautils."):
		return Supabase
	}
	switch {
	case strings.HasSuffix(host, ".rds.amazonaws.com") && strings.Contains(host, ".cluster-"):
		return Aurora
	case strings.HasSuffix(host, ".rds.amazonaws.com"):
		return RDS
	case strings.HasSuffix(host, ".postgres.database.azure.com"):
		return Azure
	case strings.HasSuffix(host, ".supabase.co") || strings.HasSuffix(host, ".supabase.com"):
		return Supabase
	case strings.HasSuffix(host, ".neon.tech"):
		return Neon
	case strings.HasSuffix(host, ".postgresbridge.com"):
		return CrunchyBridge
	}
	return SelfManaged
}

// readMarkers reads the catalog markers of DetectProvider. Errors leave a
// marker out: detection is a hint, never a failure.
func readMarkers(ctx context.Context, conn *pgx.Conn, host string) ServerMarkers {
	m := ServerMarkers{Host: host}
	var patterns []string
	for _, p := range markerSettingPrefixes {
		patterns = append(patterns, p+"%")
	}
	_ = conn.QueryRow(ctx, catalogSQL("ProviderSettings"), patterns, markerSettings).Scan(&m.Settings)
	_ = conn.QueryRow(ctx, catalogSQL("ProviderRoles"), markerRoles).Scan(&m.Roles)
	_ = conn.QueryRow(ctx, catalogSQL("ProviderAuroraVersion")).Scan(&m.AuroraVersion)
	return m
}

// WALLevelFix is how to turn on wal_level=logical on p.
func WALLevelFix(p Provider) string {
	switch p {
	case RDS:
		return "set rds.logical_replication = 1 in the instance's custom DB parameter group (a static parameter: reboot the instance); RDS then runs with wal_level = logical"
	case Aurora:
		return "set rds.logical_replication = 1 in the cluster's custom DB cluster parameter group, then reboot the writer instance; Aurora then runs with wal_level = logical"
	case CloudSQL:
		return "set the database flag cloudsql.logical_decoding = on (console: Edit > Flags, or gcloud sql instances patch INSTANCE --database-flags=cloudsql.logical_decoding=on,... listing every flag to keep: the option replaces them all); the instance restarts"
	case Azure:
		return "set the server parameter wal_level = logical (portal: Server parameters, or az postgres flexible-server parameter set --resource-group RG --server-name SERVER --name wal_level --value logical), then restart the server"
	case Neon:
		return "in the Neon Console: Project settings > Logical replication > Enable (restarts the project's computes and cannot be turned off again)"
	case Supabase:
		return "Supabase projects run with wal_level = logical; if this one does not, ask Supabase support"
	case CrunchyBridge:
		return "Crunchy Bridge clusters run with wal_level = logical by default; if it was changed, set it back in the cluster's configuration parameters and restart"
	}
	return "ALTER SYSTEM SET wal_level = logical;\n-- then restart PostgreSQL: wal_level takes effect only at server start"
}

// ReplicationFix is how to let role stream from a logical slot on p.
func ReplicationFix(p Provider, role string) string {
	q := relay.QuoteIdentifier(role)
	switch p {
	case RDS, Aurora:
		return fmt.Sprintf("GRANT rds_replication TO %s;   -- as the master user (rds_superuser); RDS has no REPLICATION attribute to give", q)
	case CloudSQL:
		return fmt.Sprintf("ALTER USER %s WITH REPLICATION;   -- as a cloudsqlsuperuser member, such as the postgres user", q)
	case Azure:
		return fmt.Sprintf("ALTER ROLE %s WITH REPLICATION;   -- as the server's administrator (azure_pg_admin)", q)
	case Supabase:
		return fmt.Sprintf("ALTER ROLE %s WITH REPLICATION;   -- as the postgres role, in the SQL editor", q)
	case Neon:
		return fmt.Sprintf("ALTER ROLE %s WITH REPLICATION;   -- as a role created in the Neon Console (member of neon_superuser); roles created there can replicate", q)
	case CrunchyBridge:
		return fmt.Sprintf("ALTER ROLE %s WITH REPLICATION;   -- as the postgres superuser", q)
	}
	return fmt.Sprintf("ALTER ROLE %s WITH REPLICATION;", q)
}

// SettingFix is how to set a server setting (max_slot_wal_keep_size,
// max_replication_slots, max_wal_senders) to value on p; restart says
// whether the setting needs a server restart.
func SettingFix(p Provider, name, value string, restart bool) string {
	then := "SELECT pg_reload_conf();"
	if restart {
		then = "-- then restart PostgreSQL"
	}
	reboot := ""
	if restart {
		reboot = "; reboot to apply"
	}
	switch p {
	case RDS:
		return fmt.Sprintf("set %s = %s in the instance's custom DB parameter group%s", name, value, reboot)
	case Aurora:
		return fmt.Sprintf("set %s = %s in the cluster's custom DB cluster parameter group%s", name, value, reboot)
	case CloudSQL:
		return fmt.Sprintf("set the database flag %s = %s (gcloud sql instances patch INSTANCE --database-flags=...: list every flag to keep)", name, value)
	case Azure:
		return fmt.Sprintf("az postgres flexible-server parameter set --resource-group RG --server-name SERVER --name %s --value %s%s", name, value, reboot)
	case Neon:
		return fmt.Sprintf("%s is managed by Neon and cannot be set; see docs/managed-postgres.md (Neon)", name)
	case Supabase:
		return fmt.Sprintf("supabase postgres-config update --config %s=%s (the Supabase CLI's custom Postgres config; restarts the database when needed)", name, value)
	case CrunchyBridge:
		return fmt.Sprintf("set %s = %s in the cluster's configuration parameters (Crunchy Bridge dashboard or cb CLI)", name, value)
	}
	return fmt.Sprintf("ALTER SYSTEM SET %s = '%s';\n%s", name, value, then)
}

// numericOnly reports whether p's parameter store takes plain numbers in the
// setting's base unit (MB, seconds) rather than values with units.
func numericOnly(p Provider) bool {
	return p == RDS || p == Aurora || p == CloudSQL || p == Azure
}

// sizeSetting is a size in GiB as p's parameter store takes it: a plain
// number of MB, or with a unit.
func sizeSetting(p Provider, gib int64) string {
	if numericOnly(p) {
		return fmt.Sprintf("%d", gib<<10)
	}
	return fmt.Sprintf("%dGB", gib)
}

// durationSetting is a duration in seconds as p's parameter store takes it:
// a plain number of seconds, or with a unit.
func durationSetting(p Provider, seconds int64) string {
	if numericOnly(p) {
		return fmt.Sprintf("%d", seconds)
	}
	return fmt.Sprintf("%ds", seconds)
}

// refusal is a kind of error a server answers when it refuses the relay
// something it needs.
type refusal int

const (
	refusalUnknown refusal = iota
	// The role may not use replication slots or start a WAL sender.
	refusalReplicationPrivilege
	// wal_level is below logical.
	refusalWALLevel
	// max_replication_slots is 0, or every slot is taken.
	refusalSlots
	// max_wal_senders is 0, or every WAL sender is busy.
	refusalWALSenders
	// A connection pooler in front of the server refused the replication
	// connection.
	refusalPooler
	// pg_hba.conf has no line for the connection.
	refusalHBA
)

// classifyRefusal recognises err by SQLSTATE and message. The messages are
// PostgreSQL's own (their wording differs between versions: 16 changed the
// privilege messages, 17 quotes setting names) and the texts poolers and
// Aurora answer with; see TestRefusalFix for each one's source.
func classifyRefusal(err error) refusal {
	if err == nil {
		return refusalUnknown
	}
	msg := strings.ToLower(err.Error())
	var code string
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		code = pgErr.Code
		msg = strings.ToLower(pgErr.Message + "\n" + pgErr.Detail + "\n" + pgErr.Hint)
	}
	has := func(subs ...string) bool {
		for _, s := range subs {
			if strings.Contains(msg, s) {
				return true
			}
		}
		return false
	}
	switch {
	case has("unsupported startup parameter: replication"):
		return refusalPooler
	case has("must be superuser or replication role", "permission denied to start wal sender", "permission denied to use replication slots",
		"only roles with the replication attribute"):
		return refusalReplicationPrivilege
	case has("logical decoding requires wal_level >= logical", `logical decoding requires "wal_level" >= "logical"`,
		"wal_level must be set to 'logical'", "wal control functions cannot be executed when wal_level < logical"):
		return refusalWALLevel
	case code == "53400" || has("all replication slots are in use", "replication slots can only be used if max_replication_slots > 0",
		`replication slots can only be used if "max_replication_slots" > 0`):
		return refusalSlots
	case has("number of requested standby connections exceeds max_wal_senders", `number of requested standby connections exceeds "max_wal_senders"`):
		return refusalWALSenders
	case code == "28000" && has("pg_hba.conf"), has("no pg_hba.conf entry"):
		return refusalHBA
	}
	return refusalUnknown
}

// RefusalFix returns the fix, on provider p, for err: a server's (or a
// pooler's) refusal of something the relay needs, such as a replication
// connection or CREATE_REPLICATION_SLOT refused for want of the replication
// privilege, of wal_level=logical, of a free slot or WAL sender, or a pooled
// endpoint that cannot carry replication (any error from a Neon or
// Supabase pooler host counts, so pass only errors of a replication
// connection or a slot). role is the role the relay connects as and host
// the host of database_url. It reports false for an error it does not
// recognise.
func RefusalFix(p Provider, role, host string, err error) (string, bool) {
	switch classifyRefusal(err) {
	case refusalReplicationPrivilege:
		return ReplicationFix(p, role), true
	case refusalWALLevel:
		return WALLevelFix(p), true
	case refusalSlots:
		return "drop a replication slot no one uses (SELECT slot_name, active, wal_status FROM pg_replication_slots;), or raise max_replication_slots: " +
			SettingFix(p, "max_replication_slots", "20", true), true
	case refusalWALSenders:
		return "raise max_wal_senders (every streaming relay, standby and backup takes one): " + SettingFix(p, "max_wal_senders", "20", true), true
	case refusalPooler:
		return poolerFix(p, host), true
	case refusalHBA:
		return hbaFix(p), true
	}
	if err != nil && pooledHost(host) {
		return poolerFix(p, host), true
	}
	return "", false
}

// pooledHost reports whether host is a provider's connection pooler
// endpoint (Neon's -pooler hosts, Supabase's Supavisor), whatever it answers
// to a replication connection.
func pooledHost(host string) bool {
	host = strings.ToLower(host)
	return strings.HasSuffix(host, ".pooler.supabase.com") || (strings.HasSuffix(host, ".neon.tech") && strings.Contains(host, "-pooler."))
}

// poolerFix says where the direct endpoint is when a pooler refused the
// replication connection.
func poolerFix(p Provider, host string) string {
	switch p {
	case Neon:
		return fmt.Sprintf("connect to the direct endpoint: the host without -pooler (%s); Neon's pooler (PgBouncer) cannot carry replication connections", strings.Replace(host, "-pooler.", ".", 1))
	case Supabase:
		return "connect to the direct connection (db.<project-ref>.supabase.co:5432, IPv6 unless the IPv4 add-on is on), not the Supavisor pooler (*.pooler.supabase.com): a pooler cannot carry replication connections"
	}
	return "database_url goes through a connection pooler (PgBouncer, Pgpool, a cloud proxy's pooled port), which cannot carry replication connections: point it at PostgreSQL itself"
}

// hbaFix is how to admit the relay's connections where pg_hba.conf cannot
// be edited.
func hbaFix(p Provider) string {
	switch p {
	case RDS, Aurora:
		return "RDS manages pg_hba.conf: check the security group admits this host, the role's password, and rds.force_ssl (connect with sslmode=require)"
	case CloudSQL:
		return "Cloud SQL manages pg_hba.conf: add this host to the instance's authorized networks, or connect through the Cloud SQL Auth Proxy"
	case Azure:
		return "Azure manages pg_hba.conf: add a firewall rule for this host (az postgres flexible-server firewall-rule create) and connect with sslmode=require"
	case Supabase, Neon, CrunchyBridge:
		return "the provider manages pg_hba.conf: check the role's password, sslmode=require, and the project's network restrictions (allowed IPs)"
	}
	return "add a pg_hba.conf line for this role and database (a logical replication connection matches the database name, not the keyword \"replication\"), then SELECT pg_reload_conf();"
}
