package config_test

import (
	"bytes"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

// Secret values the fuzz target puts only where secrets go. They must never
// be printed: not in an error, not by Redacted.
const (
	canary     = "canary-7f3a9c"
	fileCanary = "canary-from-file-5b1d"
)

// taints are the secret settings FuzzLoad may add, one per bit of its taint
// argument, each carrying canary.
var taints = []string{
	"RELAY_HTTP_METRICS_TOKEN=" + canary,
	"DATABASE_URL=postgres://relay:" + canary + "@db/app",
	"RELAY_SINKS_0_AUTH_SECRET=" + canary,
	"RELAY_SINKS_0_TOKEN=" + canary,
	"RELAY_SINKS_0_AUTH_PASSWORD=" + canary,
	"RELAY_SINKS_0_AUTH_VALUE=" + canary,
	"RELAY_SINKS_0_HEADERS={X-Api-Key: " + canary + "}",
	"RELAY_SINKS_0_URL=https://user:" + canary + "@example.com/hook",
}

// fuzzVars are the only variables ${...} references can see, so that a
// reference cannot copy a canary into a key that is not a secret.
var fuzzVars = map[string]string{"HOME": "/home/relay", "EMPTY": "", "HOOK": "http://127.0.0.1:5678/webhook/outbox"}

// FuzzLoad loads arbitrary bytes as the config file, with one arbitrary
// RELAY_ variable and secrets set from the environment and from a file. Load
// must not panic, and must be deterministic. An error is reported with every
// problem labelled by the file (and line) or the variable it came from. A
// configuration it returns validates, has parsable table names, and prints
// (Redacted) as YAML whose secrets, header values and URL credentials are
// redacted, that holds no secret value, and that loads back to a
// configuration printing the same.
func FuzzLoad(f *testing.F) {
	for _, seed := range []struct {
		yaml, envName, envValue string
		taint                   uint8
	}{
		{"", "SOURCE_MODE", "poll", 0},
		{"# nothing yet\n", "", "", 0xFF},
		{fullFile, "DELIVERY_BACKOFF", "[1s, 5s]", 0b1},
		{"database_url_file: ${SECRET_FILE}\nsinks:\n  - {name: n8n, type: webhook, url: ${HOOK}, auth: {type: jwt, secret_file: ${SECRET_FILE}}}\n", "SINKS_0_TIMEOUT", "3s", 0},
		{"sinks:\n  - name: bus\n    type: nats\n    token_file: ${SECRET_FILE}\n", "SINKS_0_URL", "nats://h:4222", 0b10},
		{"sinks:\n  - name: hook\n    type: webhook\n    url: http://h/x\n    auth: {type: header, header: X-Key}\n", "", "", 0b100100},
		{"sinks:\n  - name: hook\n    type: webhook\n    url: http://h/x\n    auth: {type: basic, username: u}\n", "SINKS_0_HEADERS", "{X-Tenant: acme}", 0b1010000},
		{"sinks:\n  - name: bus\n    type: nats\n", "SINKS_0_STREAM", "{name: EVENTS, subjects: [events.>]}", 0b1000},
		{"data_dir: /srv/$$HOME/$${NOT}/${X:-x}\nlog: {level: debug}\n", "LOG_FORMAT", "json", 0},
		{"sinks:\n  - &hook {name: a, type: webhook, url: http://h/a, timeout: 3s}\n  - <<: *hook\n    name: b\n", "SINKS_1_TIMEOUT", "4s", 0},
		{"a: &a [*a]\n", "", "", 0},
		{"source:\n  mode: pol\n  poll_interval: 5\n", "SINKS_3_URL", "x", 0},
		{"sinks:\n  - name: a\n    type: webhook\n    url: http://h/a\n  - name: a\n    type: webhook\n    url: ftp://h\n    permanent_statuses: [401]\n", "SINKS_0_HEADERS", "{\"bad name\": x}", 0b10000000},
		{"outbox: {table: 'app.\"x\"', ledger_table: app.x_conflicts}\nretention: {done_after: 60d}\n", "RETENTION_LEDGER_AFTER", "1h", 0},
	} {
		f.Add([]byte(seed.yaml), seed.envName, seed.envValue, seed.taint)
	}
	dir := f.TempDir()
	path := filepath.Join(dir, "relay.yaml")
	reloadPath := filepath.Join(dir, "printed.yaml")
	secretFile := filepath.Join(dir, "secret")
	if err := os.WriteFile(secretFile, []byte(fileCanary+"\n"), 0o600); err != nil {
		f.Fatal(err)
	}
	vars := map[string]string{"SECRET_FILE": secretFile}
	for k, v := range fuzzVars {
		vars[k] = v
	}

	f.Fuzz(func(t *testing.T, data []byte, envName, envValue string, taint uint8) {
		input := string(data) + "\x00" + envName + "\x00" + envValue
		if strings.Contains(input, "canary") {
			return // the input itself would print it
		}
		for _, special := range []string{"dev/", "proc/", "sys/", "/fd"} {
			if strings.Contains(input, special) {
				return // *_file and tls keys read files: not /dev/zero or a terminal
			}
		}
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		var environ []string
		if envName != "" { // "RELAY_" alone names no key: every seed would fail
			environ = append(environ, "RELAY_"+envName+"="+envValue)
		}
		lookupVars := vars
		for i, kv := range taints {
			if taint&(1<<i) == 0 {
				continue
			}
			environ = append(environ, kv)
			if name, value, _ := strings.Cut(kv, "="); name == "DATABASE_URL" {
				if bytes.Contains(data, []byte(name)) {
					continue // a ${DATABASE_URL} reference may print it
				}
				lookupVars = map[string]string{name: value}
				for k, v := range vars {
					lookupVars[k] = v
				}
			}
		}
		opts := config.Options{Path: path, Environ: environ, LookupEnv: lookupIn(lookupVars)}

		cfg, err := config.Load(opts)
		cfg2, err2 := config.Load(opts)
		if fmt.Sprint(err) != fmt.Sprint(err2) {
			t.Fatalf("Load is not deterministic:\n%v\nthen\n%v", err, err2)
		}
		if err != nil {
			if cfg != nil {
				t.Fatalf("Load returned a configuration and the error %v", err)
			}
			checkErrorLabels(t, err, path)
			if strings.Contains(err.Error(), canary) || strings.Contains(err.Error(), fileCanary) {
				t.Fatalf("the error prints a secret:\n%v", err)
			}
			return
		}

		if err := cfg.Validate(); err != nil {
			t.Fatalf("Load returned a configuration that does not validate: %v", err)
		}
		cfg.Tables() // panics on a name Validate should have refused
		printed, err := cfg.Redacted()
		if err != nil {
			t.Fatalf("Redacted: %v", err)
		}
		if again, _ := cfg2.Redacted(); !bytes.Equal(printed, again) {
			t.Fatalf("Load is not deterministic: it printed\n%s\nthen\n%s", printed, again)
		}
		if bytes.Contains(printed, []byte(canary)) || bytes.Contains(printed, []byte(fileCanary)) {
			t.Fatalf("Redacted prints a secret:\n%s", printed)
		}
		checkRedacted(t, printed)

		// The printed configuration seeds a file: it loads back, with no
		// environment, to a configuration that prints the same.
		if err := os.WriteFile(reloadPath, printed, 0o600); err != nil {
			t.Fatal(err)
		}
		reloaded, err := config.Load(config.Options{Path: reloadPath, Environ: []string{}})
		if err != nil {
			t.Fatalf("the printed configuration does not load: %v\n%s", err, printed)
		}
		if reprinted, err := reloaded.Redacted(); err != nil || !bytes.Equal(reprinted, printed) {
			t.Fatalf("the printed configuration loads back as something else (%v):\n%s\nthen\n%s", err, printed, reprinted)
		}
	})
}

func lookupIn(vars map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := vars[k]
		return v, ok
	}
}

// checkErrorLabels fails unless every problem in err starts with where its
// value came from: the file (file:line, or the file for a parse error) or a
// RELAY_ variable.
func checkErrorLabels(t *testing.T, err error, path string) {
	t.Helper()
	problems := []error{err}
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		problems = joined.Unwrap()
	}
	for _, p := range problems {
		if msg := p.Error(); !strings.HasPrefix(msg, path+":") && !strings.HasPrefix(msg, "RELAY_") {
			t.Fatalf("problem %q does not say where it came from; all of them:\n%v", msg, err)
		}
	}
}

// checkRedacted fails unless every secret in the printed configuration is
// empty or "[redacted]", every webhook header value is "[redacted]", and no
// sink URL carries credentials other than "xxxxx".
func checkRedacted(t *testing.T, printed []byte) {
	t.Helper()
	var doc struct {
		DatabaseURL string `yaml:"database_url"`
		HTTP        struct {
			MetricsToken   string `yaml:"metrics_token"`
			AdminToken     string `yaml:"admin_token"`
			AdminReadToken string `yaml:"admin_read_token"`
		} `yaml:"http"`
		Sinks []struct {
			URL  string `yaml:"url"`
			Auth struct {
				Secret, Value, Password string
			} `yaml:"auth"`
			Token   string            `yaml:"token"`
			Headers map[string]string `yaml:"headers"`
		} `yaml:"sinks"`
	}
	if err := yaml.Unmarshal(printed, &doc); err != nil {
		t.Fatalf("Redacted printed invalid YAML: %v\n%s", err, printed)
	}
	secret := func(name, v string) {
		if v != "" && v != "[redacted]" {
			t.Fatalf("Redacted prints %s %q:\n%s", name, v, printed)
		}
	}
	// database_url shows where it connects, its passwords as xxxxx (the
	// canary check above catches one that is not).
	if doc.DatabaseURL != "" && doc.DatabaseURL != "[redacted]" && !strings.Contains(doc.DatabaseURL, "=") && !strings.Contains(doc.DatabaseURL, "://") {
		t.Fatalf("Redacted prints database_url %q, which is neither redacted nor a connection string:\n%s", doc.DatabaseURL, printed)
	}
	secret("http.metrics_token", doc.HTTP.MetricsToken)
	secret("http.admin_token", doc.HTTP.AdminToken)
	secret("http.admin_read_token", doc.HTTP.AdminReadToken)
	for i, s := range doc.Sinks {
		secret(fmt.Sprintf("sinks[%d].auth.secret", i), s.Auth.Secret)
		secret(fmt.Sprintf("sinks[%d].auth.value", i), s.Auth.Value)
		secret(fmt.Sprintf("sinks[%d].auth.password", i), s.Auth.Password)
		secret(fmt.Sprintf("sinks[%d].token", i), s.Token)
		for name, v := range s.Headers {
			secret(fmt.Sprintf("sinks[%d].headers.%s", i, name), v)
		}
		for part := range strings.SplitSeq(s.URL, ",") {
			u, err := url.Parse(part)
			if err != nil || u.User == nil {
				continue
			}
			if p, ok := u.User.Password(); ok && p != "xxxxx" || !ok && u.User.Username() != "xxxxx" {
				t.Fatalf("Redacted prints the credentials of %q:\n%s", part, printed)
			}
		}
	}
}
