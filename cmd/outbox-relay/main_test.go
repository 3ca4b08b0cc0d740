package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// execute runs the command line in-process with a clean RELAY_* environment.
func execute(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "RELAY_") || k == "DATABASE_URL" {
			t.Setenv(k, "")
			os.Unsetenv(k)
		}
	}
	var out, errOut bytes.Buffer
	code = Execute(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestMigrateCommand(t *testing.T) {
	url := pgtest.NewDatabase(t)

	code, out, errOut := execute(t, "migrate", "--database-url", url)
	if code != exitOK || !strings.Contains(out, fmt.Sprintf("from version 0 to %d", migrations.Latest())) || !strings.Contains(out, "created publication outbox_relay") {
		t.Fatalf("first migrate: exit %d\nstdout: %s\nstderr: %s", code, out, errOut)
	}
	code, out, errOut = execute(t, "migrate", "--database-url", url)
	if code != exitOK || !strings.Contains(out, fmt.Sprintf("up to date (version %d)", migrations.Latest())) {
		t.Fatalf("second migrate: exit %d\nstdout: %s\nstderr: %s", code, out, errOut)
	}
}

func TestMigrateCommand_ConfigNames(t *testing.T) {
	url := pgtest.NewDatabase(t)
	cfg := filepath.Join(t.TempDir(), "relay.yaml")
	os.WriteFile(cfg, []byte(`
database_url: ${TEST_DB_URL}
outbox:
  table: public.app_outbox
  ledger_table: app_ledger
source:
  publication: app_pub
`), 0o600)
	t.Setenv("TEST_DB_URL", url)

	code, out, errOut := execute(t, "migrate", "--config", cfg)
	if code != exitOK || !strings.Contains(out, "migrated public.app_outbox") || !strings.Contains(out, "created publication app_pub") {
		t.Fatalf("exit %d\nstdout: %s\nstderr: %s", code, out, errOut)
	}
}

func TestExitCodes(t *testing.T) {
	badConfig := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(badConfig, []byte("source:\n  mode: sometimes\n"), 0o600)

	tests := []struct {
		name    string
		args    []string
		code    int
		message string
	}{
		{"unknown flag", []string{"migrate", "--no-such-flag"}, exitUsage, "unknown flag"},
		{"invalid config value names the key", []string{"migrate", "--config", badConfig}, exitUsage, "source.mode"},
		{"missing config file", []string{"migrate", "--config", "/nonexistent/relay.yaml"}, exitUsage, "/nonexistent/relay.yaml"},
		{"unreachable database", []string{"migrate", "--database-url", "postgres://nobody@127.0.0.1:1/x?connect_timeout=2"}, exitFailure, "connect to the database"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, _, errOut := execute(t, tt.args...)
			if code != tt.code || !strings.Contains(errOut, tt.message) {
				t.Fatalf("exit %d, want %d; stderr %q should contain %q", code, tt.code, errOut, tt.message)
			}
		})
	}
}
