package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestConfigCommand prints the effective configuration (file, RELAY_*
// variables, flags, defaults) with every secret redacted.
func TestConfigCommand(t *testing.T) {
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "nats.token")
	if err := os.WriteFile(tokenFile, []byte("nats-SECRET-789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "relay.yaml")
	doc := `database_url: postgres://relay:pg-SECRET-123@db.example:5432/app?sslmode=verify-full&sslrootcert=/etc/relay/ca.crt
sinks:
  - name: hook
    type: webhook
    url: https://user:url-SECRET-0@n8n.example/webhook/x?token=abc
    auth: {type: jwt, secret: jwt-SECRET-456}
    headers: {X-Api-Key: hdr-SECRET-1}
  - name: nats
    type: nats
    url: nats://tok-SECRET-2@nats.example:4222
    token_file: ` + tokenFile + `
http: {metrics_token: metrics-SECRET-3, admin_token: admin-SECRET-4-0123456789, admin_read_token: read-SECRET-5-0123456789}
`
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("RELAY_SOURCE_MODE", "poll")
	var stdout, stderr bytes.Buffer
	if code := Execute(context.Background(), []string{"config", "--config", path}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	out := stdout.String()
	for _, secret := range []string{"pg-SECRET-123", "jwt-SECRET-456", "nats-SECRET-789", "url-SECRET-0", "hdr-SECRET-1", "tok-SECRET-2", "metrics-SECRET-3", "admin-SECRET-4", "read-SECRET-5"} {
		if strings.Contains(out+stderr.String(), secret) {
			t.Errorf("config prints %q:\n%s", secret, out)
		}
	}
	var got struct {
		DatabaseURL string `yaml:"database_url"`
		Source      struct {
			Mode string `yaml:"mode"`
		} `yaml:"source"`
		Sinks []map[string]any `yaml:"sinks"`
		HTTP  map[string]any   `yaml:"http"`
	}
	if err := yaml.Unmarshal(stdout.Bytes(), &got); err != nil {
		t.Fatalf("output is not YAML: %v\n%s", err, out)
	}
	// The database's host, port, name and user show; only the password is hidden.
	if got.DatabaseURL != "postgres://relay:xxxxx@db.example:5432/app?sslmode=verify-full&sslrootcert=/etc/relay/ca.crt" ||
		got.Source.Mode != "poll" || len(got.Sinks) != 2 || got.HTTP["metrics_token"] != "[redacted]" ||
		got.HTTP["admin_token"] != "[redacted]" || got.HTTP["admin_read_token"] != "[redacted]" {
		t.Errorf("unexpected effective config:\n%s", out)
	}
	if got.Sinks[1]["token"] != "" || got.Sinks[1]["token_file"] != tokenFile { // only the file, so the output loads
		t.Errorf("nats token: %v, token_file %v", got.Sinks[1]["token"], got.Sinks[1]["token_file"])
	}
	if auth, _ := got.Sinks[0]["auth"].(map[string]any); auth["secret"] != "[redacted]" {
		t.Errorf("webhook auth: %v", got.Sinks[0]["auth"])
	}

	// The --database-url flag wins, and its password is hidden too, in
	// every form libpq takes one; a bad config exits 2.
	for flag, want := range map[string]string{
		"host=h password=flag-SECRET":                                                                              "database_url: host=h password=xxxxx\n",
		"host=h dbname=app user=relay password='flag-SECRET x'":                                                    "database_url: host=h dbname=app user=relay password=xxxxx\n",
		"postgres://relay@h:5433/app?password=flag-SECRET&sslmode=require":                                         "database_url: postgres://relay@h:5433/app?password=xxxxx&sslmode=require\n",
		"postgres://relay:flag-SECRET@h1:5432,h2:5432/app?sslpassword=flag-SECRET&target_session_attrs=read-write": "database_url: postgres://relay:xxxxx@h1:5432,h2:5432/app?sslpassword=xxxxx&target_session_attrs=read-write\n",
		"host=h password='flag-SECRET":                                                                             "database_url: '[redacted]'\n",
	} {
		stdout.Reset()
		code := Execute(context.Background(), []string{"config", "--config", path, "--database-url", flag}, &stdout, &stderr)
		if code != 0 || strings.Contains(stdout.String(), "flag-SECRET") || !strings.Contains(stdout.String(), want) {
			t.Errorf("--database-url %q: exit %d, want %q in the output:\n%s", flag, code, want, stdout.String())
		}
	}
	t.Setenv("RELAY_SOURCE_MODE", "sometimes")
	if code := Execute(context.Background(), []string{"config", "--config", path}, &stdout, &stderr); code != exitUsage {
		t.Errorf("invalid config: exit %d, want %d", code, exitUsage)
	}
}

// TestConfigFileFromEnvironment: RELAY_CONFIG names the file when --config
// does not (docs/configuration.md): a bad file fails with exit 2 naming the
// variable and the key, a good one is read, and --config wins over it.
func TestConfigFileFromEnvironment(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	good := filepath.Join(dir, "relay.yaml")
	other := filepath.Join(dir, "other.yaml")
	for path, doc := range map[string]string{
		bad:   "source:\n  mode: sometimes\n",
		good:  "source:\n  mode: poll\nsinks:\n  - {name: n8n, type: webhook, url: 'http://127.0.0.1:5678/webhook/outbox'}\n",
		other: "source:\n  mode: replication\n",
	} {
		if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	run := func(env string, args ...string) (int, string, string) {
		t.Helper()
		t.Setenv("RELAY_CONFIG", env)
		var stdout, stderr bytes.Buffer
		code := Execute(context.Background(), args, &stdout, &stderr)
		return code, stdout.String(), stderr.String()
	}

	code, _, errOut := run(bad, "config")
	if code != exitUsage || !strings.Contains(errOut, "RELAY_CONFIG="+bad) || !strings.Contains(errOut, "source.mode") {
		t.Errorf("RELAY_CONFIG=bad.yaml config: exit %d, stderr %q; want exit 2 naming RELAY_CONFIG and source.mode", code, errOut)
	}
	code, out, errOut := run(good, "config")
	if code != exitOK || !strings.Contains(out, "mode: poll") || !strings.Contains(out, "name: n8n") {
		t.Errorf("RELAY_CONFIG=relay.yaml config: exit %d, stderr %q, stdout:\n%s", code, errOut, out)
	}
	code, out, errOut = run(bad, "config", "--config", other)
	if code != exitOK || !strings.Contains(out, "mode: replication") {
		t.Errorf("--config beside RELAY_CONFIG: exit %d, stderr %q, stdout:\n%s", code, errOut, out)
	}
	code, _, errOut = run(filepath.Join(dir, "missing.yaml"), "config")
	if code != exitUsage || !strings.Contains(errOut, "RELAY_CONFIG=") || !strings.Contains(errOut, "missing.yaml") {
		t.Errorf("RELAY_CONFIG naming no file: exit %d, stderr %q", code, errOut)
	}
}

// TestLogFlags: --log-format and --log-level set log.format and log.level
// above the environment and the file; an invalid value exits 2 naming the
// key.
func TestLogFlags(t *testing.T) {
	path := filepath.Join(t.TempDir(), "relay.yaml")
	if err := os.WriteFile(path, []byte("log: {level: debug, format: json}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	execute(t) // clears the RELAY_* environment
	printed := func(args ...string) (log struct{ Level, Format string }) {
		t.Helper()
		var stdout, stderr bytes.Buffer
		if code := Execute(context.Background(), append([]string{"config", "--config", path}, args...), &stdout, &stderr); code != exitOK {
			t.Fatalf("config %q: exit %d: %s", args, code, stderr.String())
		}
		var doc struct {
			Log struct{ Level, Format string } `yaml:"log"`
		}
		if err := yaml.Unmarshal(stdout.Bytes(), &doc); err != nil {
			t.Fatal(err)
		}
		return doc.Log
	}
	if got := printed(); got.Level != "debug" || got.Format != "json" {
		t.Errorf("from the file: %+v", got)
	}
	t.Setenv("RELAY_LOG_LEVEL", "warn")
	t.Setenv("RELAY_LOG_FORMAT", "console")
	if got := printed(); got.Level != "warn" || got.Format != "console" {
		t.Errorf("the environment over the file: %+v", got)
	}
	if got := printed("--log-level", "error", "--log-format", "json"); got.Level != "error" || got.Format != "json" {
		t.Errorf("the flags over the environment: %+v", got)
	}

	var stdout, stderr bytes.Buffer
	if code := Execute(context.Background(), []string{"config", "--config", path, "--log-format", "xml"}, &stdout, &stderr); code != exitUsage ||
		!strings.Contains(stderr.String(), "log.format") {
		t.Errorf("--log-format xml: exit %d, stderr %q; want %d naming log.format", code, stderr.String(), exitUsage)
	}
}
