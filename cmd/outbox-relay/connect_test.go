package main

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestConnectError_WrongPassword: a wrong password is reported as the
// server's refusal with the fix, by every command that connects — not as
// the refused TLS handshake pgx tried first (sslmode=prefer against a
// server without TLS), and not under the label of the first query.
func TestConnectError_WrongPassword(t *testing.T) {
	c := pgtest.NewCluster(t, pgtest.Options{})
	ctx := context.Background()
	hba := "host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
	if err := os.WriteFile(filepath.Join(c.Dir(), "data", "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		t.Fatal(err)
	}
	conn := newPGConn(t, c.URL("postgres"))
	for _, sql := range []string{`SELECT pg_reload_conf()`, `CREATE ROLE app LOGIN PASSWORD 'right-password'`} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	u, _ := url.Parse(c.URL("postgres"))
	u.User = url.UserPassword("app", "wrong-password")
	u.RawQuery = "" // sslmode=prefer, libpq's default: pgx tries TLS first
	wrong := u.String()
	// run's endpoints on a free port: the default one may be a running relay's.
	cfg := writeOpsConfig(t, "", "", `http: {listen: "127.0.0.1:0"}`, fmt.Sprintf("data_dir: %q", t.TempDir()))

	for _, args := range [][]string{{"status"}, {"dlq", "list"}, {"migrate"}, {"run", "--embedded-nats"}} {
		code, _, errOut := execute(t, append(args, "--config", cfg, "--database-url", wrong)...)
		// The error line (run logs before it).
		_, msg, _ := strings.Cut(errOut, "outbox-relay: ")
		first, _, _ := strings.Cut(msg, "\n")
		want := fmt.Sprintf("connect to the database app@127.0.0.1:%d/postgres: password authentication failed for user \"app\" (SQLSTATE 28P01)", c.Port())
		if code != exitFailure || !strings.Contains(first, want) || !strings.Contains(errOut, "fix: check the password of role app in database_url") {
			t.Errorf("%q: exit %d, stderr:\n%s\nwant its first line to contain %q, then the fix", args, code, errOut, want)
		}
		for _, bad := range []string{"tls error", "wrong-password", "look up outbox table"} {
			if strings.Contains(errOut, bad) {
				t.Errorf("%q: stderr mentions %q:\n%s", args, bad, errOut)
			}
		}
	}
}

// TestOpsCommands_BeforeMigrate: status, dlq, replay and reconcile on a
// database migrate has not prepared say so and what to run, instead of
// PostgreSQL's "relation does not exist".
func TestOpsCommands_BeforeMigrate(t *testing.T) {
	db := pgtest.NewDatabase(t)
	for _, args := range [][]string{{"status"}, {"dlq", "list"}, {"replay", "--ids", "1", "--yes"}, {"reconcile", "--older-than", "10m"}} {
		code, _, errOut := execute(t, append(args, "--database-url", db)...)
		if code != exitFailure || !strings.Contains(errOut, "has no integration_outbox, integration_idempotency, relay_checkpoint: run `outbox-relay migrate` there first") {
			t.Errorf("%q: exit %d, stderr %q", args, code, errOut)
		}
		if strings.Contains(errOut, "SQLSTATE") {
			t.Errorf("%q: a raw server error: %s", args, errOut)
		}
	}
}

// TestConnectError_NoDatabaseURL: with no database URL anywhere, a command
// that cannot connect says that libpq's defaults chose the server, which
// one, and to set database_url — not only "connection refused".
func TestConnectError_NoDatabaseURL(t *testing.T) {
	t.Setenv("PGHOST", "127.0.0.1")
	t.Setenv("PGPORT", "1")
	t.Setenv("PGUSER", "nobody")
	t.Setenv("PGDATABASE", "app")
	t.Setenv("PGCONNECT_TIMEOUT", "2")
	code, _, errOut := execute(t, "status")
	for _, want := range []string{"connect to the database nobody@127.0.0.1:1/app (database_url is not set", "connection refused", "fix: set database_url, --database-url or DATABASE_URL"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
	if code != exitFailure {
		t.Errorf("exit %d, want %d", code, exitFailure)
	}
}

// TestMigrate_LeastPrivilegeRole: migrate as a role without DDL rights on
// a database the owner has migrated says what happened and what to do —
// run it as the owner — and that run can start as this role.
func TestMigrate_LeastPrivilegeRole(t *testing.T) {
	db := pgtest.NewDatabase(t)
	if code, out, errOut := execute(t, "migrate", "--database-url", db); code != exitOK {
		t.Fatalf("migrate as the owner: exit %d\n%s%s", code, out, errOut)
	}
	conn := newPGConn(t, db)
	role := "app_" + strings.ToLower(strings.ReplaceAll(t.Name(), "_", ""))
	if _, err := conn.Exec(context.Background(), fmt.Sprintf(`CREATE ROLE %s LOGIN`, role)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role) })
	code, _, errOut := execute(t, "migrate", "--database-url", withUser(t, db, role))
	for _, want := range []string{"permission denied", "it is the only command that needs DDL rights", "Run it as the owner of integration_outbox",
		"already current for this build, so run can start as this role"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
	if code != exitFailure {
		t.Errorf("exit %d, want %d", code, exitFailure)
	}
}
