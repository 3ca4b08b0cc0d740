package main

import (
	"bytes"
	"context"
	"debug/buildinfo"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
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

// TestMigrateCommand_NearlyMatchingTable: an existing outbox table that
// differs from the seed shape in two ways gets both differences, with the
// statements that fix them, in one run; once fixed, migrate says it adopts
// the table rather than reading as if it created one.
func TestMigrateCommand_NearlyMatchingTable(t *testing.T) {
	url := pgtest.NewDatabase(t)
	conn := newPGConn(t, url)
	if _, err := conn.Exec(context.Background(), `CREATE TABLE integration_outbox (id bigserial PRIMARY KEY, event_type text,
		aggregate_type text, aggregate_id text, event_key text NOT NULL UNIQUE, payload text, status text DEFAULT 'pending',
		attempts int DEFAULT 0, available_at timestamptz DEFAULT now(), locked_at timestamptz, last_error text,
		created_at timestamptz DEFAULT now(), processed_at timestamptz)`); err != nil {
		t.Fatal(err)
	}
	fixes := []string{
		`ALTER TABLE "public"."integration_outbox" ALTER COLUMN "payload" TYPE jsonb USING "payload"::jsonb;`,
		`ALTER TABLE "public"."integration_outbox" ADD COLUMN "locked_by" text;`,
	}
	code, out, errOut := execute(t, "migrate", "--database-url", url)
	t.Logf("migrate:\n%s%s", out, errOut)
	if code != exitFailure {
		t.Fatalf("exit %d, want %d", code, exitFailure)
	}
	requireLines(t, errOut, append(fixes, `column "payload" has type text, want jsonb`, `column "locked_by" is missing`, "adopting the existing table")...)
	if strings.Contains(errOut, "applying migration") {
		t.Error("migrate logs \"applying migration\" for a table it adopts")
	}

	for _, fix := range fixes {
		if _, err := conn.Exec(context.Background(), fix); err != nil {
			t.Fatalf("%s: %v", fix, err)
		}
	}
	code, out, errOut = execute(t, "migrate", "--database-url", url)
	if code != exitOK || !strings.Contains(out, "adopted the existing table integration_outbox") {
		t.Fatalf("after the fixes: exit %d\nstdout: %s\nstderr: %s", code, out, errOut)
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
		// The README's exit codes hold for the command tree too: no
		// command, an unknown one, a group without its subcommand.
		{"no command", nil, exitUsage, "outbox-relay needs a command: "},
		{"unknown command", []string{"stauts"}, exitUsage, `unknown command "stauts" for "outbox-relay"; did you mean "status"?`},
		{"group without a subcommand", []string{"dlq"}, exitUsage, "outbox-relay dlq needs a command: discard, list, retry"},
		{"unknown subcommand", []string{"dlq", "lst"}, exitUsage, `unknown command "lst" for "outbox-relay dlq"`},
		{"extra argument", []string{"status", "now"}, exitUsage, "unknown command"},
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

// TestVersionCommand: "version" and "--version" both print the version and
// exit 0.
func TestVersionCommand(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}} {
		code, out, errOut := execute(t, args...)
		if code != exitOK || !strings.HasPrefix(out, "outbox-relay version ") {
			t.Errorf("%q: exit %d, stdout %q, stderr %q", args, code, out, errOut)
		}
	}
}

// TestDescribeBuild: the version names the build: the release set at
// build time, a module version from go install, or the commit the go
// command stamped, and the Go release; never only "dev" when the build
// information says more.
func TestDescribeBuild(t *testing.T) {
	stamped := &debug.BuildInfo{GoVersion: "go1.26.11", Main: debug.Module{Version: "(devel)"}, Settings: []debug.BuildSetting{
		{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: "7b37bf82503d4e6a0c1f"}, {Key: "vcs.time", Value: "2026-12-04T20:28:16Z"}, {Key: "vcs.modified", Value: "true"},
	}}
	tests := []struct {
		name    string
		version string
		info    *debug.BuildInfo
		want    string
	}{
		{"no build information", "dev", nil, "dev"},
		{"a checkout stamped by the go command", "dev", stamped, "dev (commit 7b37bf82503d, 2026-12-04T20:28:16Z, with uncommitted changes, go1.26.11)"},
		{"go install of a release", "dev", &debug.BuildInfo{GoVersion: "go1.26.11", Main: debug.Module{Version: "v1.4.0"}}, "v1.4.0 (go1.26.11)"},
		{"set at build time", "v1.4.1", &debug.BuildInfo{GoVersion: "go1.26.11", Main: debug.Module{Version: "(devel)"}}, "v1.4.1 (go1.26.11)"},
		{"git describe at build time names the commit once", "7b37bf8-dirty", stamped, "7b37bf8-dirty (2026-12-04T20:28:16Z, with uncommitted changes, go1.26.11)"},
	}
	for _, tt := range tests {
		if got := describeBuild(tt.version, tt.info); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}

// TestVersion_Binary: a built binary names at least its Go release, and the
// commit whenever the go command stamped one.
func TestVersion_Binary(t *testing.T) {
	bin, err := relayBinary()
	if err != nil {
		t.Fatal(err)
	}
	info, err := buildinfo.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	want := describeBuild("dev", info)
	for _, arg := range []string{"version", "--version"} {
		out, err := exec.Command(bin, arg).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", arg, err, out)
		}
		if got := strings.TrimSpace(string(out)); got != "outbox-relay version "+want || !strings.Contains(got, info.GoVersion) {
			t.Errorf("%s: %q, want %q", arg, got, "outbox-relay version "+want)
		}
	}
}

// TestRun_RefusesNoSinks: with no sink configured, run exits 2 before it
// connects anywhere, naming where it looked and the explicit choice
// (--embedded-nats, embedded_nats: true); with that choice it goes on (and
// here fails to connect, exit 1). A container that sets RELAY_CONFIG to a
// file without sinks is told so.
func TestRun_RefusesNoSinks(t *testing.T) {
	unreachable := "postgres://nobody@127.0.0.1:1/x?connect_timeout=2"
	code, _, errOut := execute(t, "run", "--database-url", unreachable)
	if code != exitUsage || !strings.Contains(errOut, "no sinks configured") || !strings.Contains(errOut, "--embedded-nats") || !strings.Contains(errOut, "RELAY_CONFIG") {
		t.Errorf("run without sinks: exit %d, stderr %q", code, errOut)
	}

	cfg := filepath.Join(t.TempDir(), "relay.yaml")
	// run's endpoints on a free port: the default one may be a running relay's.
	doc := fmt.Sprintf("source: {mode: poll}\nhttp: {listen: \"127.0.0.1:0\"}\ndata_dir: %q\n", t.TempDir())
	if err := os.WriteFile(cfg, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("RELAY_CONFIG", cfg)
	var out, stderr bytes.Buffer
	code = Execute(context.Background(), []string{"run", "--database-url", unreachable}, &out, &stderr)
	if code != exitUsage || !strings.Contains(stderr.String(), "RELAY_CONFIG="+cfg) || !strings.Contains(stderr.String(), "no sinks configured") {
		t.Errorf("RELAY_CONFIG=relay.yaml run, no sinks: exit %d, stderr %q", code, stderr.String())
	}

	stderr.Reset()
	code = Execute(context.Background(), []string{"run", "--embedded-nats", "--database-url", unreachable}, &out, &stderr)
	if code != exitFailure || strings.Contains(stderr.String(), "no sinks") || !strings.Contains(stderr.String(), "connect to the database") {
		t.Errorf("run --embedded-nats: exit %d, stderr %q; want it past the sinks check, failing to connect", code, stderr.String())
	}
}

// TestRun_WarnsThatMarkDoneOffIsGone: delivery.mark_done: off still loads,
// and run says at its start that it is no longer honoured: the settlement
// writes every row's status (docs/configuration.md, "Removed keys").
func TestRun_WarnsThatMarkDoneOffIsGone(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "relay.yaml")
	doc := fmt.Sprintf(`database_url: postgres://nobody@127.0.0.1:1/x?connect_timeout=2
http: {listen: "127.0.0.1:0"}
data_dir: %q
delivery: {mark_done: off}
sinks:
  - {name: n8n, type: webhook, url: "http://127.0.0.1:9/webhook/outbox"}
`, t.TempDir())
	if err := os.WriteFile(cfg, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	var out, stderr bytes.Buffer
	code := Execute(context.Background(), []string{"run", "--config", cfg}, &out, &stderr)
	if code != exitFailure || !strings.Contains(stderr.String(), "delivery.mark_done: off is no longer supported") {
		t.Errorf("run with mark_done: off: exit %d, stderr %q; want the warning, then the failure to connect", code, stderr.String())
	}
}

// TestOperatorCommandsNeedNoSinkSecrets: status, dlq, replay, reconcile
// and migrate never send, so a sink secret whose variable is unset on the
// operator's machine does not stop them (here they get as far as the
// unreachable database: exit 1); run and doctor, which use the sinks, still
// exit 2 naming the variable.
func TestOperatorCommandsNeedNoSinkSecrets(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "relay.yaml")
	doc := `database_url: postgres://nobody@127.0.0.1:1/x?connect_timeout=2
sinks:
  - name: n8n
    type: webhook
    url: https://n8n.example.com/webhook/outbox
    auth: {type: header, header: X-Outbox-Token, value: ${N8N_TOKEN}}
`
	if err := os.WriteFile(cfg, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	os.Unsetenv("N8N_TOKEN")
	for _, args := range [][]string{
		{"status"}, {"dlq", "list"}, {"dlq", "retry", "--yes"}, {"replay", "--ids", "1", "--sink", "n8n", "--yes"},
		{"reconcile", "--older-than", "10m"}, {"migrate"},
	} {
		code, _, errOut := execute(t, append(args, "--config", cfg)...)
		if code != exitFailure || strings.Contains(errOut, "N8N_TOKEN") {
			t.Errorf("%q: exit %d, stderr %q; want it to load the configuration and fail on the database", args, code, errOut)
		}
	}
	for _, args := range [][]string{{"run"}, {"doctor"}} {
		code, _, errOut := execute(t, append(args, "--config", cfg)...)
		if code != exitUsage || !strings.Contains(errOut, "sinks[0].auth.value: environment variable N8N_TOKEN is not set") {
			t.Errorf("%q: exit %d, stderr %q; want exit 2 naming N8N_TOKEN", args, code, errOut)
		}
	}
}
