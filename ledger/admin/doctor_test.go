package admin_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// MustRole creates a login role for tb (roles are cluster-wide, so its name
// comes from the database's), runs the setup statements ({{role}} stands for
// its quoted name) and returns a URL that connects as it. The role is
// dropped when tb ends.
func MustRole(tb testing.TB, dbURL, attrs string, setup ...string) (roleURL, role string) {
	tb.Helper()
	ctx := context.Background()
	u, err := url.Parse(dbURL)
	if err != nil {
		tb.Fatal(err)
	}
	role = strings.TrimPrefix(u.Path, "/") + "_relay"
	q := relay.QuoteIdentifier(role)
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		tb.Fatal(err)
	}
	defer conn.Close(ctx)
	MustExec(tb, conn, fmt.Sprintf("CREATE ROLE %s LOGIN %s", q, attrs))
	tb.Cleanup(func() {
		conn, err := pgx.Connect(ctx, dbURL)
		if err != nil {
			tb.Error(err)
			return
		}
		defer conn.Close(ctx)
		MustExec(tb, conn, "DROP OWNED BY "+q)
		MustExec(tb, conn, "DROP ROLE "+q)
	})
	for _, s := range setup {
		MustExec(tb, conn, strings.ReplaceAll(s, "{{role}}", q))
	}
	u.User = url.User(role)
	return u.String(), role
}

func diagnose(t *testing.T, dbURL string, mutate ...func(*admin.DiagnoseConfig)) map[string]admin.Check {
	t.Helper()
	n := migrations.DefaultNames()
	cfg := admin.DiagnoseConfig{
		ConnString:      dbURL,
		Tables:          admin.Tables{Outbox: n.Outbox, Ledger: n.Ledger, Checkpoint: n.Checkpoint},
		Publication:     n.Publication,
		Slot:            "outbox_relay",
		Replication:     true,
		Retention:       true,
		SlotMaxRetained: 1 << 30,
	}
	for _, m := range mutate {
		m(&cfg)
	}
	checks := admin.Diagnose(context.Background(), cfg)
	out := map[string]admin.Check{}
	var text strings.Builder
	for _, c := range checks {
		if _, dup := out[c.Name]; dup {
			t.Errorf("check %q reported twice", c.Name)
		}
		out[c.Name] = c
		fmt.Fprintf(&text, "%-4s %s: %s\n", c.Status, c.Name, c.Detail)
		if c.Fix != "" {
			fmt.Fprintf(&text, "     fix: %s\n", c.Fix)
		}
	}
	t.Logf("doctor:\n%s", text.String())
	return out
}

// requireCheck fails unless the check exists with status and its detail and
// fix contain the strings in want.
func requireCheck(t *testing.T, checks map[string]admin.Check, name string, status admin.CheckStatus, want ...string) {
	t.Helper()
	c, ok := checks[name]
	if !ok {
		t.Errorf("no check %q", name)
		return
	}
	if c.Status != status {
		t.Errorf("check %q: %s (%s), want %s", name, c.Status, c.Detail, status)
	}
	for _, w := range want {
		if !strings.Contains(c.Detail+"\n"+c.Fix, w) {
			t.Errorf("check %q does not mention %q:\n%s\nfix: %s", name, w, c.Detail, c.Fix)
		}
	}
}

func noFailures(t *testing.T, checks map[string]admin.Check) {
	t.Helper()
	for _, c := range checks {
		if c.Status == admin.Fail {
			t.Errorf("check %q failed: %s", c.Name, c.Detail)
		}
	}
}

func TestDiagnose_HealthySuperuser(t *testing.T) {
	f := MustFixture(t)
	checks := diagnose(t, f.url)
	noFailures(t, checks)
	requireCheck(t, checks, "connection", admin.OK, "postgres@")
	requireCheck(t, checks, "server version", admin.OK, "PostgreSQL 1")
	if c, ok := checks["provider"]; ok {
		t.Errorf("a self-managed server recognised as a managed service: %s", c.Detail)
	}
	requireCheck(t, checks, "wal_level", admin.OK, "logical")
	requireCheck(t, checks, "REPLICATION", admin.OK, "superuser")
	requireCheck(t, checks, "replication connection", admin.OK)
	requireCheck(t, checks, "schema", admin.OK, fmt.Sprintf("at version %d", migrations.Latest()))
	requireCheck(t, checks, "privileges on public.integration_outbox", admin.OK, "SELECT, UPDATE, DELETE")
	requireCheck(t, checks, "least privilege", admin.Warn, "is a superuser", "owns public.integration_outbox",
		`CREATE ROLE "outbox_relay" LOGIN REPLICATION`, `GRANT SELECT, UPDATE, DELETE ON "public"."integration_outbox" TO "outbox_relay";`)
	requireCheck(t, checks, "publication outbox_relay", admin.OK, "publishes inserts of public.integration_outbox")
	requireCheck(t, checks, "slot outbox_relay", admin.OK, "does not exist yet")
	requireCheck(t, checks, "max_slot_wal_keep_size", admin.Warn, "unlimited", "fills the disk", "ALTER SYSTEM SET max_slot_wal_keep_size = '10GB';", "pg_reload_conf()")
}

// TestDiagnose_LeastPrivilegeRole: a role made with exactly the statements
// doctor recommends passes every check without a warning about its rights.
func TestDiagnose_LeastPrivilegeRole(t *testing.T) {
	f := MustFixture(t)
	n := migrations.DefaultNames()
	tables := admin.Tables{Outbox: n.Outbox.Sibling(n.Outbox.Name), Ledger: n.Ledger, Checkpoint: n.Checkpoint}
	tables.Outbox.Schema, tables.Ledger.Schema, tables.Checkpoint.Schema = "public", "public", "public"
	stmts := admin.LeastPrivilegeRole("x", tables, true, true)
	if !strings.HasPrefix(stmts[0], `CREATE ROLE "x" LOGIN REPLICATION PASSWORD`) {
		t.Fatalf("statements: %q", stmts)
	}
	var grants []string
	for _, s := range stmts[1:] {
		grants = append(grants, strings.ReplaceAll(strings.TrimSuffix(s, ";"), `"x"`, "{{role}}"))
	}
	roleURL, _ := MustRole(t, f.url, "REPLICATION", grants...)

	checks := diagnose(t, roleURL)
	noFailures(t, checks)
	requireCheck(t, checks, "least privilege", admin.OK, "no rights beyond what run needs")
	requireCheck(t, checks, "REPLICATION", admin.OK)
	requireCheck(t, checks, "replication connection", admin.OK)
	// It cannot read the version table: the catalog answers instead.
	requireCheck(t, checks, "schema", admin.OK, "has the replays column of migration 006 (this role cannot read")
}

func TestDiagnose_TooLittle(t *testing.T) {
	f := MustFixture(t)
	roleURL, role := MustRole(t, f.url, "", "GRANT SELECT ON integration_outbox TO {{role}}")
	checks := diagnose(t, roleURL)
	q := relay.QuoteIdentifier(role)
	requireCheck(t, checks, "REPLICATION", admin.Fail, fmt.Sprintf("ALTER ROLE %s WITH REPLICATION;", q))
	requireCheck(t, checks, "privileges on public.integration_outbox", admin.Fail,
		"lacks UPDATE, DELETE", "retention.enabled", fmt.Sprintf(`GRANT UPDATE, DELETE ON "public"."integration_outbox" TO %s;`, q))
	requireCheck(t, checks, "privileges on public.integration_idempotency", admin.Fail,
		fmt.Sprintf(`GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."integration_idempotency" TO %s;`, q))
	requireCheck(t, checks, "privileges on public.relay_checkpoint", admin.Fail,
		fmt.Sprintf(`GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."relay_checkpoint" TO %s;`, q))
	if _, ok := checks["replication connection"]; ok {
		t.Error("replication connection tried without REPLICATION")
	}

	// Without retention DELETE on the outbox is not needed.
	checks = diagnose(t, roleURL, func(c *admin.DiagnoseConfig) { c.Retention = false })
	requireCheck(t, checks, "privileges on public.integration_outbox", admin.Fail, "lacks UPDATE")
	if strings.Contains(checks["privileges on public.integration_outbox"].Fix, "DELETE") {
		t.Error("asks for DELETE with retention off")
	}
}

func TestDiagnose_TooMuch(t *testing.T) {
	f := MustFixture(t)
	roleURL, role := MustRole(t, f.url, "REPLICATION CREATEDB",
		"GRANT ALL ON integration_outbox, integration_idempotency, relay_checkpoint TO {{role}}",
		"CREATE TABLE owned_by_role (x int)",
		"ALTER TABLE relay_checkpoint OWNER TO {{role}}")
	checks := diagnose(t, roleURL, func(c *admin.DiagnoseConfig) { c.Retention = false })
	noFailures(t, checks)
	q := relay.QuoteIdentifier(role)
	requireCheck(t, checks, "least privilege", admin.Warn,
		"has CREATEDB", fmt.Sprintf("ALTER ROLE %s WITH NOCREATEDB;", q),
		"has INSERT, DELETE, TRUNCATE, REFERENCES, TRIGGER on public.integration_outbox",
		fmt.Sprintf(`REVOKE INSERT, DELETE, TRUNCATE, REFERENCES, TRIGGER ON "public"."integration_outbox" FROM %s;`, q),
		"has TRUNCATE, REFERENCES, TRIGGER on public.integration_idempotency",
		"owns public.relay_checkpoint", `CREATE ROLE "outbox_relay"`)
}

func TestDiagnose_WALLevelReplica(t *testing.T) {
	c := pgtest.NewCluster(t, pgtest.Options{WALLevel: "replica"})
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
	// Auto mode polls here by design: a warning with the trade-off, and
	// the poll-mode wake-up suggested.
	checks := diagnose(t, c.URL("app"))
	noFailures(t, checks)
	requireCheck(t, checks, "wal_level", admin.Warn, "replica", "auto mode polls", "poll_interval", "source.notify_trigger",
		"ALTER SYSTEM SET wal_level = logical;", "restart PostgreSQL", "source.mode: poll")
	requireCheck(t, checks, "notify_trigger", admin.Warn, "source.notify_trigger: true", "outbox-relay migrate")
	if _, ok := checks["replication connection"]; ok {
		t.Error("replication connection tried with wal_level replica")
	}
	// source.mode replication cannot start here.
	required := func(c *admin.DiagnoseConfig) { c.ReplicationRequired = true }
	checks = diagnose(t, c.URL("app"), required)
	requireCheck(t, checks, "wal_level", admin.Fail, "replica", "source.mode replication", "ALTER SYSTEM SET wal_level = logical;", "restart PostgreSQL")
	// This server version's own refusal of a slot is recognised, with each
	// provider's fix.
	_, err = conn.Exec(ctx, "SELECT pg_create_logical_replication_slot('refused', 'pgoutput')")
	if err == nil {
		t.Fatal("a logical slot was created with wal_level replica")
	}
	t.Logf("refusal: %v", err)
	for p, want := range map[admin.Provider]string{admin.SelfManaged: "ALTER SYSTEM SET wal_level = logical", admin.RDS: "rds.logical_replication = 1", admin.CloudSQL: "cloudsql.logical_decoding=on"} {
		if fix, ok := admin.RefusalFix(p, "relay", "", err); !ok || !strings.Contains(fix, want) {
			t.Errorf("RefusalFix(%q, %q) = %q, %v; want a fix with %q", p, err, fix, ok, want)
		}
	}
	// Cloud SQL with cloudsql.logical_decoding off, and Neon without
	// logical replication, look like this to doctor; their settings (set
	// here as placeholders for the database) give them away.
	for _, tc := range []struct{ setting, provider, fix string }{
		{"cloudsql.logical_decoding", string(admin.CloudSQL), "database flag cloudsql.logical_decoding = on"},
		{"neon.tenant_id", string(admin.Neon), "Project settings > Logical replication > Enable"},
	} {
		if _, err := conn.Exec(ctx, "ALTER DATABASE app SET "+tc.setting+" = 'off'"); err != nil {
			t.Fatal(err)
		}
		checks := diagnose(t, c.URL("app"), required)
		requireCheck(t, checks, "provider", admin.OK, tc.provider, tc.setting)
		requireCheck(t, checks, "wal_level", admin.Fail, "replica", tc.fix)
		if strings.Contains(checks["wal_level"].Fix, "ALTER SYSTEM") {
			t.Errorf("%s: a fix with ALTER SYSTEM: %s", tc.provider, checks["wal_level"].Fix)
		}
		if _, err := conn.Exec(ctx, "ALTER DATABASE app RESET "+tc.setting); err != nil {
			t.Fatal(err)
		}
	}

	// Poll mode does not need it.
	checks = diagnose(t, c.URL("app"), func(c *admin.DiagnoseConfig) { c.Replication = false })
	noFailures(t, checks)
	requireCheck(t, checks, "wal_level", admin.OK, "enough for source.mode poll")
}

// TestDiagnose_NotifyTrigger: while the relay polls, doctor suggests the
// poll-mode wake-up when it is off, and says when it is on but migrate has
// not installed its trigger.
func TestDiagnose_NotifyTrigger(t *testing.T) {
	f := MustFixture(t)
	poll := func(c *admin.DiagnoseConfig) { c.Replication, c.PollInterval = false, time.Second }
	requireCheck(t, diagnose(t, f.url, poll), "notify_trigger", admin.Warn,
		"off", "500ms", "source.notify_trigger: true", "outbox-relay migrate --config FILE")

	on := func(c *admin.DiagnoseConfig) { c.NotifyTrigger = true }
	requireCheck(t, diagnose(t, f.url, poll, on), "notify_trigger", admin.Warn,
		"not installed", "outbox-relay migrate --config FILE")

	conn, err := pgx.Connect(context.Background(), f.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := migrations.Migrate(context.Background(), conn, migrations.Options{Names: migrations.DefaultNames(), NotifyTrigger: true}); err != nil {
		t.Fatal(err)
	}
	requireCheck(t, diagnose(t, f.url, poll, on), "notify_trigger", admin.OK, "integration_outbox_relay_notify")

	// The stream path needs no wake-up.
	if c, ok := diagnose(t, f.url)["notify_trigger"]; ok {
		t.Errorf("notify_trigger checked while the relay streams: %+v", c)
	}
}

func TestDiagnose_Schema(t *testing.T) {
	ctx := context.Background()
	t.Run("not migrated", func(t *testing.T) {
		checks := diagnose(t, pgtest.NewDatabase(t))
		requireCheck(t, checks, "schema", admin.Fail, "integration_outbox does not exist", "outbox-relay migrate")
		requireCheck(t, checks, "publication outbox_relay", admin.Skip)
	})
	t.Run("old version", func(t *testing.T) {
		f := MustFixture(t)
		MustExec(t, f.pool, "UPDATE integration_outbox_relay_version SET version = 5")
		checks := diagnose(t, f.url)
		requireCheck(t, checks, "schema", admin.Fail, fmt.Sprintf("schema version 5; this build needs %d", migrations.Latest()), "outbox-relay migrate")
	})
	t.Run("newer version", func(t *testing.T) {
		f := MustFixture(t)
		MustExec(t, f.pool, "UPDATE integration_outbox_relay_version SET version = 99")
		requireCheck(t, diagnose(t, f.url), "schema", admin.Warn, "newer than this build")
	})
	t.Run("configured names", func(t *testing.T) {
		names := hostileNames()
		f := MustFixtureNames(t, names)
		checks := diagnose(t, f.url, func(c *admin.DiagnoseConfig) {
			c.Tables, c.Publication = f.tables, names.Publication
		})
		noFailures(t, checks)
		requireCheck(t, checks, "schema", admin.OK, fmt.Sprintf("at version %d", migrations.Latest()))
		requireCheck(t, checks, "publication "+names.Publication, admin.OK)
	})
	_ = ctx
}

func TestDiagnose_Publication(t *testing.T) {
	f := MustFixture(t)
	MustExec(t, f.pool, "DROP PUBLICATION outbox_relay")
	requireCheck(t, diagnose(t, f.url), "publication outbox_relay", admin.Fail,
		`CREATE PUBLICATION "outbox_relay" FOR TABLE "public"."integration_outbox" WITH (publish = 'insert');`)

	MustExec(t, f.pool, "CREATE TABLE other (x int)")
	MustExec(t, f.pool, "CREATE PUBLICATION outbox_relay FOR TABLE other")
	requireCheck(t, diagnose(t, f.url), "publication outbox_relay", admin.Fail,
		`ALTER PUBLICATION "outbox_relay" ADD TABLE "public"."integration_outbox";`)

	MustExec(t, f.pool, "ALTER PUBLICATION outbox_relay SET TABLE integration_outbox")
	requireCheck(t, diagnose(t, f.url), "publication outbox_relay", admin.Warn, "updates/deletes", `SET (publish = 'insert')`)

	MustExec(t, f.pool, "ALTER PUBLICATION outbox_relay SET (publish = 'update')")
	requireCheck(t, diagnose(t, f.url), "publication outbox_relay", admin.Fail, "does not publish inserts")
}

func TestDiagnose_Slot(t *testing.T) {
	f := MustFixture(t)
	MustExec(t, f.pool, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	checks := diagnose(t, f.url)
	requireCheck(t, checks, "slot outbox_relay", admin.OK, "not in use")
	requireCheck(t, checks, "retained WAL", admin.OK, "source.slot_max_retained 1.0 GiB")
	// Made by someone else: no hand-over record; the rows pending go to the
	// claim path, and doctor says how many and for how long.
	MustExec(t, f.pool, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'e', 'a', (g % 7)::text, 'k' || g, '{}' FROM generate_series(1, 12345) AS g`)
	requireCheck(t, diagnose(t, f.url), "slot hand-over", admin.Warn, "no record of the relay's hand-over", "safe rule", "12,345 rows now", "about 3s at 5,000 rows/s",
		"A slot without its hand-over record")

	// Over the relay's own limit.
	checks = diagnose(t, f.url, func(c *admin.DiagnoseConfig) { c.SlotMaxRetained = 1 })
	requireCheck(t, checks, "retained WAL", admin.Warn, "more than source.slot_max_retained", "pg_drop_replication_slot('outbox_relay')")

	// Held by a program that is not the relay.
	stream := MustStream(t, f.url, "outbox_relay", "outbox_relay", "pg_recvlogical")
	waitFor(t, func() bool {
		return diagnose(t, f.url)["slot outbox_relay"].Status == admin.Warn
	})
	requireCheck(t, diagnose(t, f.url), "slot outbox_relay", admin.Warn,
		fmt.Sprintf("held by pid %d", stream.PID()), `"pg_recvlogical"`, "since ", fmt.Sprintf("SELECT pg_terminate_backend(%d);", stream.PID()))
	stream.Close(context.Background())

	// A relay streaming is fine.
	stream = MustStream(t, f.url, "outbox_relay", "outbox_relay", "outbox-relay")
	waitFor(t, func() bool { return diagnose(t, f.url)["slot outbox_relay"].Status == admin.OK })
	requireCheck(t, diagnose(t, f.url), "slot outbox_relay", admin.OK, fmt.Sprintf("streaming to pid %d", stream.PID()))
	stream.Close(context.Background())

	// Poll mode leaves a slot to grow.
	waitFor(t, func() bool {
		return diagnose(t, f.url, func(c *admin.DiagnoseConfig) { c.Replication = false })["slot outbox_relay"].Status == admin.Warn
	})
	requireCheck(t, diagnose(t, f.url, func(c *admin.DiagnoseConfig) { c.Replication = false }), "slot outbox_relay", admin.Warn,
		"never consumes it", "pg_drop_replication_slot")
}

func TestDiagnose_NoConnection(t *testing.T) {
	checks := diagnose(t, "postgres://nobody:s3cret@127.0.0.1:1/x?connect_timeout=2")
	requireCheck(t, checks, "connection", admin.Fail, "cannot connect", "pg_hba.conf")
	if len(checks) != 1 {
		t.Fatalf("checks after a failed connection: %v", checks)
	}
	if strings.Contains(fmt.Sprint(checks), "s3cret") {
		t.Fatal("the password is in doctor's output")
	}
	checks = diagnose(t, "postgres://nobody:s3cret@[oops/x")
	if strings.Contains(fmt.Sprint(checks), "s3cret") {
		t.Fatal("the password is in doctor's output")
	}
}

// TestDiagnose_ServerTimeouts: the settings that bound how long a vanished
// or cut-off relay's sessions outlive it, as the relay's role sees them
// (here set per connection in the URL, as ALTER ROLE … SET would).
func TestDiagnose_ServerTimeouts(t *testing.T) {
	f := MustFixture(t)
	// idle_session_timeout came with PostgreSQL 14: before, the check is
	// left out.
	idleSessionMissing := serverVersion(t) < 140000
	for _, tc := range []struct {
		name   string
		params string
		want   map[string]admin.CheckStatus
		says   map[string][]string
	}{
		{"server defaults", "", map[string]admin.CheckStatus{
			"wal_sender_timeout": admin.OK, "tcp keepalives": admin.Warn, "idle_in_transaction_session_timeout": admin.Warn, "idle_session_timeout": admin.OK,
		}, map[string][]string{
			"wal_sender_timeout":                  {"1m0s: the server ends a walsender", "after 1m0s mid-transaction, 6.5 s between transactions"},
			"tcp keepalives":                      {"idle 7200s, interval 75s, count 9", "2h11m15s", `ALTER ROLE "postgres" SET tcp_keepalives_idle = '5';`, "tcp_keepalives_count = '3'", "restart the relay"},
			"idle_in_transaction_session_timeout": {"0 (off): a relay that vanishes mid-transaction", `ALTER ROLE "postgres" SET idle_in_transaction_session_timeout = '1min';`},
			"idle_session_timeout":                {"0 (off)"},
		}},
		{"keepalives of the relay's lock connections", "tcp_keepalives_idle=5&tcp_keepalives_interval=2&tcp_keepalives_count=3", map[string]admin.CheckStatus{
			"tcp keepalives": admin.OK, "idle_in_transaction_session_timeout": admin.OK,
		}, map[string][]string{
			"tcp keepalives":                      {"after about 11s"},
			"idle_in_transaction_session_timeout": {"TCP keepalives end a vanished relay's sessions"},
		}},
		{"idle transactions bounded", "idle_in_transaction_session_timeout=1min", map[string]admin.CheckStatus{
			"tcp keepalives": admin.OK, "idle_in_transaction_session_timeout": admin.OK,
		}, nil},
		{"wal_sender_timeout off", "wal_sender_timeout=0", map[string]admin.CheckStatus{"wal_sender_timeout": admin.Warn},
			map[string][]string{"wal_sender_timeout": {"0 (off)", `ALTER ROLE "postgres" SET wal_sender_timeout = '60s';`}}},
		{"wal_sender_timeout long", "wal_sender_timeout=5min", map[string]admin.CheckStatus{"wal_sender_timeout": admin.Warn},
			map[string][]string{"wal_sender_timeout": {"5m0s: a walsender whose relay vanished holds the slot that long"}}},
		{"wal_sender_timeout short", "wal_sender_timeout=5s", map[string]admin.CheckStatus{"wal_sender_timeout": admin.Warn},
			map[string][]string{"wal_sender_timeout": {"5s: shorter than the relay's own receive limit", "wal_sender_timeout = '30s'"}}},
		{"wal_sender_timeout 30s", "wal_sender_timeout=30s", map[string]admin.CheckStatus{"wal_sender_timeout": admin.OK},
			map[string][]string{"wal_sender_timeout": {"after 30s mid-transaction"}}},
		{"idle_session_timeout short", "idle_session_timeout=3s", map[string]admin.CheckStatus{"idle_session_timeout": admin.Warn},
			map[string][]string{"idle_session_timeout": {"3s: ends the relay's leader and owner lock connections", `SET idle_session_timeout = '0'`}}},
		{"idle_session_timeout long", "idle_session_timeout=10min", map[string]admin.CheckStatus{"idle_session_timeout": admin.OK},
			map[string][]string{"idle_session_timeout": {"10m0s: ends the relay's idle pool and LISTEN connections"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if idleSessionMissing && strings.Contains(tc.params, "idle_session_timeout") {
				t.Skip("PostgreSQL 13 has no idle_session_timeout (it refuses the parameter)")
			}
			u := f.url
			if tc.params != "" {
				u += "&" + tc.params
			}
			checks := diagnose(t, u)
			for name, status := range tc.want {
				if name == "idle_session_timeout" && idleSessionMissing {
					if c, ok := checks[name]; ok {
						t.Errorf("idle_session_timeout checked on PostgreSQL 13, which has no such parameter: %+v", c)
					}
					continue
				}
				requireCheck(t, checks, name, status, tc.says[name]...)
			}
		})
	}
	// Poll mode has no walsender.
	if _, ok := diagnose(t, f.url, func(c *admin.DiagnoseConfig) { c.Replication = false })["wal_sender_timeout"]; ok {
		t.Error("wal_sender_timeout checked in source.mode poll")
	}
}
