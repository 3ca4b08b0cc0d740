package admin_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

func TestDetectProvider(t *testing.T) {
	for _, tc := range []struct {
		name    string
		markers admin.ServerMarkers
		want    admin.Provider
	}{
		{"self-managed", admin.ServerMarkers{Host: "db.internal", Settings: nil, Roles: nil}, admin.SelfManaged},
		// RDS creates rds_superuser and rds_replication and has rds.* parameters (docs/managed-postgres.md, Amazon RDS).
		{"RDS by catalog, behind a custom DNS name", admin.ServerMarkers{Host: "orders-db.example.com", Settings: []string{"rds.force_ssl", "rds.logical_replication"}, Roles: []string{"rds_replication", "rds_superuser"}}, admin.RDS},
		{"RDS by host", admin.ServerMarkers{Host: "orders.abc123xyz.eu-west-1.rds.amazonaws.com"}, admin.RDS},
		{"Aurora by aurora_version()", admin.ServerMarkers{Host: "10.0.0.5", Settings: []string{"rds.logical_replication"}, Roles: []string{"rds_superuser"}, AuroraVersion: true}, admin.Aurora},
		{"Aurora by cluster endpoint", admin.ServerMarkers{Host: "orders.cluster-abc123xyz.eu-west-1.rds.amazonaws.com", Roles: []string{"rds_superuser"}}, admin.Aurora},
		{"Aurora by cluster endpoint only", admin.ServerMarkers{Host: "orders.cluster-ro-abc123xyz.eu-west-1.rds.amazonaws.com"}, admin.Aurora},
		// Through the Cloud SQL Auth Proxy the host is 127.0.0.1: only the catalog tells.
		{"Cloud SQL behind the Auth Proxy", admin.ServerMarkers{Host: "127.0.0.1", Settings: []string{"cloudsql.iam_authentication", "cloudsql.logical_decoding"}, Roles: []string{"cloudsqlsuperuser"}}, admin.CloudSQL},
		{"Azure by azure.extensions", admin.ServerMarkers{Host: "10.1.2.3", Settings: []string{"azure.extensions"}, Roles: []string{"azure_pg_admin"}}, admin.Azure},
		{"Azure by host", admin.ServerMarkers{Host: "orders.postgres.database.azure.com"}, admin.Azure},
		{"Neon by neon.* settings", admin.ServerMarkers{Host: "ep-cool-darkness-123456.us-east-2.aws.neon.tech", Settings: []string{"neon.tenant_id", "neon.timeline_id"}, Roles: []string{"neon_superuser"}}, admin.Neon},
		{"Neon pooler by host", admin.ServerMarkers{Host: "ep-cool-darkness-123456-pooler.us-east-2.aws.neon.tech"}, admin.Neon},
		{"Supabase by supabase_admin", admin.ServerMarkers{Host: "db.abcdefghijklmnop.supabase.co", Roles: []string{"supabase_admin"}}, admin.Supabase},
		{"Supabase pooler by host", admin.ServerMarkers{Host: "aws-0-eu-central-1.pooler.supabase.com"}, admin.Supabase},
		{"Crunchy Bridge by host", admin.ServerMarkers{Host: "p.abcdefghijklmnopqrstuvwxyz.db.postgresbridge.com"}, admin.CrunchyBridge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := admin.DetectProvider(tc.markers); got != tc.want {
				t.Errorf("DetectProvider(%+v) = %q, want %q", tc.markers, got, tc.want)
			}
		})
	}
}

// pgError is a server error as pgx returns it.
func pgError(code, message, detail, hint string) error {
	return &pgconn.PgError{Severity: "ERROR", Code: code, Message: message, Detail: detail, Hint: hint}
}

// TestRefusalFix feeds the refusals servers and poolers answer with, quoted
// from where they were seen, and checks each provider's fix. The same
// recognition runs against each server version's own texts in
// TestRefusalFix_ServerTexts and TestDiagnose_WALLevelReplica.
func TestRefusalFix(t *testing.T) {
	for _, tc := range []struct {
		name     string
		provider admin.Provider
		host     string
		err      error
		want     []string
	}{
		{
			// PostgreSQL 13-15, on RDS without rds_replication: quoted in
			// github.com/ClickHouse/ClickHouse/issues/47782 ("ERROR:  must be
			// superuser or replication role to use replication slots").
			name: "RDS, slot without rds_replication", provider: admin.RDS,
			err:  pgError("42501", "must be superuser or replication role to use replication slots", "", ""),
			want: []string{`GRANT rds_replication TO "relay";`},
		},
		{
			// Aurora, same refusal, with its own wording: quoted in the same
			// issue ("must be superuser or replication role to use logical
			// replication slots in the 'rds' namespace").
			name: "Aurora, slot without rds_replication", provider: admin.Aurora,
			err:  pgError("42501", "must be superuser or replication role to use logical replication slots in the 'rds' namespace", "", ""),
			want: []string{`GRANT rds_replication TO "relay";`},
		},
		{
			// PostgreSQL 16+, a replication connection by a role without
			// REPLICATION: quoted in github.com/pgbouncer/pgbouncer/issues/1164
			// ("FATAL:  permission denied to start WAL sender", "DETAIL:  Only
			// roles with the REPLICATION attribute may start a WAL sender
			// process.").
			name: "Cloud SQL, walsender without REPLICATION (16+)", provider: admin.CloudSQL,
			err: fmt.Errorf("failed to connect to `user=relay database=app`: %w",
				pgError("42501", "permission denied to start WAL sender", "Only roles with the REPLICATION attribute may start a WAL sender process.", "")),
			want: []string{`ALTER USER "relay" WITH REPLICATION;`, "cloudsqlsuperuser"},
		},
		{
			name: "Azure, walsender without REPLICATION (16+)", provider: admin.Azure,
			err:  pgError("42501", "permission denied to start WAL sender", "Only roles with the REPLICATION attribute may start a WAL sender process.", ""),
			want: []string{`ALTER ROLE "relay" WITH REPLICATION;`, "azure_pg_admin"},
		},
		{
			// PostgreSQL 13-15 postinit.c: "must be superuser or replication
			// role to start walsender".
			name: "Supabase, walsender without REPLICATION (13-15)", provider: admin.Supabase,
			err:  pgError("42501", "must be superuser or replication role to start walsender", "", ""),
			want: []string{`ALTER ROLE "relay" WITH REPLICATION;`, "postgres role"},
		},
		{
			// Cloud SQL without cloudsql.logical_decoding, or any server
			// below wal_level logical: "ERROR: logical decoding requires
			// wal_level >= logical" (github.com/cybertec-postgresql/pg_squeeze/issues/19,
			// github.com/tk0miya/testing.postgresql/issues/45).
			name: "Cloud SQL, logical decoding off", provider: admin.CloudSQL,
			err:  pgError("55000", "logical decoding requires wal_level >= logical", "", ""),
			want: []string{"cloudsql.logical_decoding=on", "replaces them all"},
		},
		{
			// PostgreSQL 17+ quotes setting names: `logical decoding on
			// standby requires "wal_level" >= "logical" on the primary`
			// (github.com/PeerDB-io/peerdb/pull/3516); on a primary the
			// message is `logical decoding requires "wal_level" >= "logical"`.
			name: "Neon, logical replication not enabled (17+)", provider: admin.Neon,
			err:  pgError("55000", `logical decoding requires "wal_level" >= "logical"`, "", ""),
			want: []string{"Project settings > Logical replication > Enable"},
		},
		{
			name: "RDS, rds.logical_replication off", provider: admin.RDS,
			err:  pgError("55000", "logical decoding requires wal_level >= logical", "", ""),
			want: []string{"rds.logical_replication = 1", "DB parameter group", "reboot"},
		},
		{
			// Aurora refuses WAL control functions below wal_level logical:
			// "ERROR:  wal_level must be set to 'logical'", "HINT:  WAL
			// control functions cannot be executed when wal_level < logical."
			// (github.com/jobinau/pg_gather/issues/9).
			name: "Aurora, pg_current_wal_lsn() refused", provider: admin.Aurora,
			err:  pgError("55000", "wal_level must be set to 'logical'", "", "WAL control functions cannot be executed when wal_level < logical."),
			want: []string{"rds.logical_replication = 1", "DB cluster parameter group", "writer instance"},
		},
		{
			// Neon's pooled endpoint (PgBouncer): "unsupported startup
			// parameter: replication" (github.com/neondatabase/neon/issues/6291).
			name: "Neon pooled endpoint", provider: admin.Neon, host: "ep-cool-darkness-123456-pooler.us-east-2.aws.neon.tech",
			err:  errors.New("failed to connect to `user=relay database=neondb`: 3.18.1.1:5432 (ep-cool-darkness-123456-pooler.us-east-2.aws.neon.tech): server error: FATAL: unsupported startup parameter: replication (SQLSTATE 08P01)"),
			want: []string{"ep-cool-darkness-123456.us-east-2.aws.neon.tech", "without -pooler"},
		},
		{
			// PgBouncer before 1.23: "ERROR:  Unsupported startup parameter:
			// replication" (github.com/pgbouncer/pgbouncer/issues/382).
			name: "Supabase pooler", provider: admin.Supabase, host: "aws-0-eu-central-1.pooler.supabase.com",
			err:  pgError("08P01", "Unsupported startup parameter: replication", "", ""),
			want: []string{"db.<project-ref>.supabase.co:5432", "Supavisor"},
		},
		{
			// Whatever Supavisor answers, its host says it is a pooler.
			name: "Supabase pooler, any refusal", provider: admin.Supabase, host: "aws-0-eu-central-1.pooler.supabase.com",
			err:  errors.New("failed to connect to `user=relay.abcdefghijklmnop database=postgres`: unexpected EOF"),
			want: []string{"db.<project-ref>.supabase.co:5432"},
		},
		{
			name: "self-managed PgBouncer", provider: admin.SelfManaged,
			err:  pgError("08P01", "unsupported startup parameter: replication", "", ""),
			want: []string{"connection pooler", "point it at PostgreSQL itself"},
		},
		{
			// PostgreSQL slot.c: "all replication slots are in use", HINT
			// "Free one or increase max_replication_slots." (17+ quotes the name).
			name: "Azure, no free slot", provider: admin.Azure,
			err:  pgError("53400", "all replication slots are in use", "", `Free one or increase "max_replication_slots".`),
			want: []string{"pg_replication_slots", "az postgres flexible-server parameter set", "max_replication_slots"},
		},
		{
			// PostgreSQL walsender.c (13-16): "number of requested standby
			// connections exceeds max_wal_senders (currently %d)".
			name: "Crunchy Bridge, no free WAL sender", provider: admin.CrunchyBridge,
			err:  pgError("53300", "number of requested standby connections exceeds max_wal_senders (currently 10)", "", ""),
			want: []string{"max_wal_senders", "Crunchy Bridge"},
		},
		{
			name: "RDS, no pg_hba.conf entry", provider: admin.RDS,
			err:  pgError("28000", `no pg_hba.conf entry for host "10.0.0.5", user "relay", database "app", no encryption`, "", ""),
			want: []string{"security group", "rds.force_ssl"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.err
			fix, ok := admin.RefusalFix(tc.provider, "relay", tc.host, err)
			if !ok {
				t.Fatalf("RefusalFix(%q, %v): not recognised", tc.provider, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(fix, w) {
					t.Errorf("RefusalFix(%q, %v) = %q; want it to mention %q", tc.provider, err, fix, w)
				}
			}
		})
	}
	if fix, ok := admin.RefusalFix(admin.RDS, "relay", "", errors.New("connection reset by peer")); ok {
		t.Errorf("an unrelated error was recognised: %q", fix)
	}
}

// TestRefusalFix_ServerTexts: this server version's own refusals of a role
// without REPLICATION (a replication connection, and a slot) are
// recognised. 16 reworded both.
func TestRefusalFix_ServerTexts(t *testing.T) {
	f := MustFixture(t)
	roleURL, role := MustRole(t, f.url, "")
	ctx := context.Background()

	cc, err := pgconn.ParseConfig(roleURL)
	if err != nil {
		t.Fatal(err)
	}
	cc.RuntimeParams["replication"] = "database"
	if conn, err := pgconn.ConnectConfig(ctx, cc); err == nil {
		conn.Close(ctx)
		t.Fatal("a role without REPLICATION opened a replication connection")
	} else if fix, ok := admin.RefusalFix(admin.RDS, role, "", err); !ok || !strings.Contains(fix, "GRANT rds_replication") {
		t.Errorf("replication connection refused with %q: RefusalFix = %q, %v", err, fix, ok)
	} else {
		t.Logf("refusal recognised: %v", err)
	}

	conn, err := pgx.Connect(ctx, roleURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "SELECT pg_create_logical_replication_slot('refused', 'pgoutput')")
	if err == nil {
		t.Fatal("a role without REPLICATION created a slot")
	}
	if fix, ok := admin.RefusalFix(admin.CloudSQL, role, "", err); !ok || !strings.Contains(fix, "WITH REPLICATION") {
		t.Errorf("slot refused with %q: RefusalFix = %q, %v", err, fix, ok)
	}
	t.Logf("refusal recognised: %v", err)
}

// TestDiagnose_RDS: on a server that looks like Amazon RDS (its roles
// rds_superuser and rds_replication exist), doctor names the provider,
// accepts membership in rds_replication for the REPLICATION attribute RDS
// never gives, and gives RDS's fixes instead of ALTER SYSTEM. A cluster of
// its own: roles are cluster-wide, and would make every test's server RDS.
func TestDiagnose_RDS(t *testing.T) {
	c := pgtest.NewCluster(t, pgtest.Options{})
	ctx := context.Background()
	if err := c.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, c.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := migrations.Migrate(ctx, conn, migrations.Options{Names: migrations.DefaultNames()}); err != nil {
		t.Fatal(err)
	}
	MustExec(t, conn, "CREATE ROLE rds_superuser NOLOGIN")
	MustExec(t, conn, "CREATE ROLE rds_replication NOLOGIN")

	memberURL, member := MustRole(t, c.URL("app"), "IN ROLE rds_replication")
	checks := diagnose(t, memberURL)
	requireCheck(t, checks, "provider", admin.OK, "Amazon RDS for PostgreSQL", "rds_replication", "docs/managed-postgres.md")
	requireCheck(t, checks, "REPLICATION", admin.OK, "member of rds_replication")
	// A real RDS lets the member stream; this server does not, and its
	// refusal gets RDS's fix.
	requireCheck(t, checks, "replication connection", admin.Fail, "GRANT rds_replication TO "+relayQuote(member))
	requireCheck(t, checks, "max_slot_wal_keep_size", admin.Warn, "custom DB parameter group")
	if c := checks["max_slot_wal_keep_size"]; strings.Contains(c.Fix, "ALTER SYSTEM") {
		t.Errorf("an RDS fix with ALTER SYSTEM: %s", c.Fix)
	}

	MustExec(t, conn, "REVOKE rds_replication FROM "+relayQuote(member))
	MustExec(t, conn, "GRANT rds_superuser TO "+relayQuote(member))
	requireCheck(t, diagnose(t, memberURL), "REPLICATION", admin.Fail, "not a member of rds_replication", "GRANT rds_replication TO "+relayQuote(member))
}

func relayQuote(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
