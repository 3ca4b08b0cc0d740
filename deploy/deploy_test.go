// Package deploy_test checks the deployment files under deploy/ and the
// top-level docker-compose.yml without a Docker engine or a cluster: every
// file parses, has the fields its consumer needs, references only files that
// exist and only the relay's configuration keys and metric names.
package deploy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/deploy"
)

// repoRoot is the repository root relative to this package's directory,
// where `go test` runs.
const repoRoot = ".."

// The relay's metric list and the PromQL reader live in package deploy,
// which the scrape test in cmd/outbox-relay shares.
var (
	knownSeries   = deploy.KnownSeries
	baseMetric    = deploy.BaseMetric
	promQLMetrics = deploy.MetricNames
)

// checkExpr reports an error for each metric expr names that the relay does
// not export, and returns the base metric names it uses.
func checkExpr(t *testing.T, where, expr string) []string {
	t.Helper()
	names, err := promQLMetrics(expr)
	if err != nil {
		t.Errorf("%s: %v", where, err)
		return nil
	}
	var bases []string
	for _, n := range names {
		if !knownSeries(n) {
			t.Errorf("%s: %q names %s, which is not one of the relay's metrics", where, expr, n)
			continue
		}
		bases = append(bases, baseMetric(n))
	}
	return bases
}

func TestPromQLMetrics(t *testing.T) {
	tests := []struct {
		expr    string
		want    []string
		wantErr string
	}{
		{expr: `max(outbox_relay_leader) == 0`, want: []string{"outbox_relay_leader"}},
		{expr: `histogram_quantile(0.99, sum by (sink, le) (rate(outbox_relay_delivery_latency_seconds_bucket{job=~"$job", sink=~"$sink"}[$__rate_interval])))`,
			want: []string{"outbox_relay_delivery_latency_seconds_bucket"}},
		{expr: `sum(increase(outbox_relay_failed_total[10m])) > 0 or max(outbox_relay_rows{status="failed"}) > 0`,
			want: []string{"outbox_relay_failed_total", "outbox_relay_rows"}},
		{expr: `max(outbox_relay_slot_retained_wal_bytes) > 512 * 1024 * 1024`, want: []string{"outbox_relay_slot_retained_wal_bytes"}},
		{expr: `a / on(instance) group_left(mode) b`, want: []string{"a", "b"}},
		{expr: `rat(outbox_relay_up[5m])`, wantErr: "unknown function"},
		{expr: `1 > 0`, wantErr: "no metric"},
	}
	for _, tt := range tests {
		got, err := promQLMetrics(tt.expr)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("promQLMetrics(%q) = %v, %v; want error %q", tt.expr, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("promQLMetrics(%q) = %v, %v; want %v", tt.expr, got, err, tt.want)
		}
	}
	if knownSeries("outbox_relay_delivery_latency_seconds") || !knownSeries("outbox_relay_delivery_latency_seconds_count") ||
		knownSeries("outbox_relay_up_bucket") || knownSeries("outbox_relay_delivered") {
		t.Error("knownSeries accepts a histogram's base name or a counter without _total")
	}
}

// --- helpers ----------------------------------------------------------------

func repoPath(rel string) string { return filepath.Join(repoRoot, filepath.FromSlash(rel)) }

func mustRead(t *testing.T, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(repoPath(rel))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// mustYAMLDocs decodes every document of a (multi-document) YAML file.
func mustYAMLDocs(t *testing.T, rel string) []map[string]any {
	t.Helper()
	dec := yaml.NewDecoder(bytes.NewReader(mustRead(t, rel)))
	var docs []map[string]any
	for {
		var doc map[string]any
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", rel, err)
		}
		if doc != nil {
			docs = append(docs, doc)
		}
	}
	if len(docs) == 0 {
		t.Fatalf("%s: no YAML document", rel)
	}
	return docs
}

// dig walks keys through nested maps and lists (an int key indexes a list)
// and returns nil when a step is missing.
func dig(v any, keys ...any) any {
	for _, k := range keys {
		switch k := k.(type) {
		case string:
			m, ok := v.(map[string]any)
			if !ok {
				return nil
			}
			v = m[k]
		case int:
			l, ok := v.([]any)
			if !ok || k >= len(l) {
				return nil
			}
			v = l[k]
		}
	}
	return v
}

func str(v any) string {
	if v == nil {
		return ""
	}
	return fmt.Sprint(v)
}

func list(v any) []any {
	l, _ := v.([]any)
	return l
}

func mapOf(v any) map[string]any {
	m, _ := v.(map[string]any)
	return m
}

func exists(rel string) bool {
	_, err := os.Stat(repoPath(rel))
	return err == nil
}

// durationOf parses a Go/Prometheus duration such as "45s" or "10m".
func durationOf(t *testing.T, where string, v any) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(str(v))
	if err != nil {
		t.Errorf("%s: %v", where, err)
	}
	return d
}

// --- relay.yaml keys ----------------------------------------------------------

// configKeys is the set of key paths ("sinks[].auth.value") a relay.yaml may
// use; a path ending in ".*" allows any key below it (a free-form map).
type configKeys map[string]bool

func (k configKeys) allows(p string) bool {
	if k[p] {
		return true
	}
	for q := p; ; {
		i := strings.LastIndexAny(q, ".")
		if i < 0 {
			return false
		}
		q = q[:i]
		if k[q+".*"] {
			return true
		}
	}
}

var commentedKey = regexp.MustCompile(`^(\s*)#\s?([a-z0-9_]+):(\s|$)`)

// exampleConfigKeys collects the keys of deploy/relay.example.yaml: those
// set, and those shown commented out ("  # value_file: …"), placed by the
// column of their "#" under the nearest mapping above whose keys start in
// that column.
func exampleConfigKeys(t *testing.T) configKeys {
	t.Helper()
	src := mustRead(t, "deploy/relay.example.yaml")
	var root yaml.Node
	if err := yaml.Unmarshal(src, &root); err != nil {
		t.Fatalf("deploy/relay.example.yaml: %v", err)
	}
	keys := configKeys{}
	type mapping struct {
		path      string
		column    int
		firstLine int
	}
	var mappings []mapping
	var walk func(n *yaml.Node, p string)
	walk = func(n *yaml.Node, p string) {
		switch n.Kind {
		case yaml.DocumentNode:
			for _, c := range n.Content {
				walk(c, p)
			}
		case yaml.MappingNode:
			if len(n.Content) == 0 {
				keys[p+".*"] = true
				return
			}
			mappings = append(mappings, mapping{p, n.Content[0].Column, n.Content[0].Line})
			for i := 0; i+1 < len(n.Content); i += 2 {
				kp := joinKey(p, n.Content[i].Value)
				keys[kp] = true
				walk(n.Content[i+1], kp)
			}
		case yaml.SequenceNode:
			for _, c := range n.Content {
				walk(c, p+"[]")
			}
		}
	}
	walk(&root, "")

	sc := bufio.NewScanner(bytes.NewReader(src))
	for line := 1; sc.Scan(); line++ {
		m := commentedKey.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		column := len(m[1]) + 1
		best := -1
		for i, mp := range mappings {
			if mp.column == column && mp.firstLine < line && (best < 0 || mp.firstLine > mappings[best].firstLine) {
				best = i
			}
		}
		if best >= 0 {
			keys[joinKey(mappings[best].path, m[2])] = true
		}
	}
	return keys
}

func joinKey(parent, key string) string {
	if parent == "" {
		return key
	}
	return parent + "." + key
}

// checkRelayConfig parses a relay.yaml and reports every key that
// deploy/relay.example.yaml does not have. It returns the decoded file.
func checkRelayConfig(t *testing.T, where string, src []byte, allowed configKeys) map[string]any {
	t.Helper()
	var root yaml.Node
	if err := yaml.Unmarshal(src, &root); err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	var walk func(n *yaml.Node, p string)
	walk = func(n *yaml.Node, p string) {
		switch n.Kind {
		case yaml.DocumentNode:
			for _, c := range n.Content {
				walk(c, p)
			}
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				kp := joinKey(p, n.Content[i].Value)
				if !allowed.allows(kp) {
					t.Errorf("%s:%d: key %s is not in deploy/relay.example.yaml", where, n.Content[i].Line, kp)
					continue
				}
				walk(n.Content[i+1], kp)
			}
		case yaml.SequenceNode:
			for _, c := range n.Content {
				walk(c, p+"[]")
			}
		}
	}
	walk(&root, "")
	var cfg map[string]any
	if err := yaml.Unmarshal(src, &cfg); err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	if cfg == nil {
		t.Fatalf("%s: empty configuration", where)
	}
	return cfg
}

func TestExampleConfigKeys(t *testing.T) {
	keys := exampleConfigKeys(t)
	for _, want := range []string{
		"database_url", "database_url_file", "outbox.conflicts_table", "source.mode", "sinks[].auth.value",
		"sinks[].auth.value_file", "sinks[].creds_file", "sinks[].stream.duplicate_window", "http.listen",
		"shutdown_timeout", "migrate.timeout",
	} {
		if !keys.allows(want) {
			t.Errorf("key %s not found in deploy/relay.example.yaml", want)
		}
	}
	if !keys.allows("sinks[].headers.X-Api-Key") {
		t.Error("sinks[].headers should accept any header name")
	}
	for _, bad := range []string{"sinks[].auth.valu", "source.poll", "database", "http.listen.port"} {
		if keys.allows(bad) {
			t.Errorf("key %s should not be allowed", bad)
		}
	}
}

// TestRelayConfigs checks every relay configuration shipped under deploy/:
// YAML that uses only documented keys, listening on all interfaces (they
// run in containers) and shutting down before their supervisors kill them.
func TestRelayConfigs(t *testing.T) {
	allowed := exampleConfigKeys(t)
	checkRelayConfig(t, "deploy/relay.example.yaml", mustRead(t, "deploy/relay.example.yaml"), allowed)

	var files []string
	err := filepath.WalkDir(repoPath("deploy"), func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && d.Name() == "relay.yaml" {
			rel, err := filepath.Rel(repoRoot, p)
			if err != nil {
				return err
			}
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(files, "deploy/compose/relay.yaml") {
		t.Errorf("deploy/compose/relay.yaml not found (found %v)", files)
	}
	for _, f := range files {
		cfg := checkRelayConfig(t, f, mustRead(t, f), allowed)
		if got := str(dig(cfg, "http", "listen")); got != "0.0.0.0:9187" {
			t.Errorf("%s: http.listen = %q, want 0.0.0.0:9187 (reachable from outside the container)", f, got)
		}
	}
}

// --- docker-compose.yml -----------------------------------------------------

func composeFile(t *testing.T) map[string]any {
	t.Helper()
	docs := mustYAMLDocs(t, "docker-compose.yml")
	if len(docs) != 1 {
		t.Fatalf("docker-compose.yml: %d documents, want 1", len(docs))
	}
	return docs[0]
}

func TestCompose(t *testing.T) {
	c := composeFile(t)
	services := mapOf(c["services"])
	declaredVolumes := mapOf(c["volumes"])
	for _, name := range []string{"postgres", "nats", "n8n", "n8n-import", "n8n-tables", "relay-migrate", "relay"} {
		if mapOf(services[name]) == nil {
			t.Fatalf("docker-compose.yml: service %s missing", name)
		}
	}

	// Healthchecks where something waits on them.
	for _, name := range []string{"postgres", "nats", "n8n", "relay"} {
		hc := mapOf(dig(services, name, "healthcheck"))
		if len(list(hc["test"])) < 2 || hc["disable"] == true {
			t.Errorf("service %s: no healthcheck test", name)
		}
	}

	// Every service: its image or build, bind-mounted files and named volumes.
	for name, s := range services {
		svc := mapOf(s)
		if svc["image"] == nil && svc["build"] == nil {
			t.Errorf("service %s: neither image nor build", name)
		}
		if b := svc["build"]; b != nil {
			ctx, dockerfile := str(dig(b, "context")), str(dig(b, "dockerfile"))
			if s, ok := b.(string); ok {
				ctx, dockerfile = s, "Dockerfile"
			}
			if dockerfile == "" {
				dockerfile = "Dockerfile"
			}
			if !exists(ctx) || !exists(path.Join(ctx, dockerfile)) {
				t.Errorf("service %s: build context %q or Dockerfile %q does not exist", name, ctx, dockerfile)
			}
		}
		for _, v := range list(svc["volumes"]) {
			src, target, bind := composeVolume(v)
			switch {
			case target == "":
				t.Errorf("service %s: volume %v has no target", name, v)
			case bind:
				if !exists(src) {
					t.Errorf("service %s: bind-mounted %s does not exist (mounted at %s)", name, src, target)
				}
			default:
				if _, ok := declaredVolumes[src]; !ok {
					t.Errorf("service %s: named volume %s is not declared under volumes:", name, src)
				}
			}
		}
		for _, f := range list(svc["env_file"]) {
			if !exists(str(f)) {
				t.Errorf("service %s: env_file %v does not exist", name, f)
			}
		}
	}

	// PostgreSQL with logical WAL and a bound on slot WAL.
	pgCmd := fmt.Sprint(dig(services, "postgres", "command"))
	if !strings.HasPrefix(str(dig(services, "postgres", "image")), "postgres:16") ||
		!strings.Contains(pgCmd, "wal_level=logical") || !strings.Contains(pgCmd, "max_slot_wal_keep_size=") {
		t.Errorf("postgres: image %v command %q, want postgres:16 with wal_level=logical and max_slot_wal_keep_size",
			dig(services, "postgres", "image"), pgCmd)
	}
	if got := str(dig(services, "n8n", "image")); got != "n8nio/n8n:2.8.4" {
		t.Errorf("n8n image = %q, want n8nio/n8n:2.8.4", got)
	}
	if got := str(dig(services, "nats", "image")); !strings.HasPrefix(got, "nats:2.10") {
		t.Errorf("nats image = %q, want nats:2.10", got)
	}

	// Start order.
	wantDeps := map[string]map[string]string{
		"n8n": {
			"n8n-import": "service_completed_successfully",
			"n8n-tables": "service_completed_successfully",
		},
		"relay-migrate": {"postgres": "service_healthy"},
		"relay": {
			"postgres":      "service_healthy",
			"nats":          "service_healthy",
			"relay-migrate": "service_completed_successfully",
		},
	}
	for svc, deps := range wantDeps {
		for dep, cond := range deps {
			if got := str(dig(services, svc, "depends_on", dep, "condition")); got != cond {
				t.Errorf("service %s: depends_on %s condition %q, want %q", svc, dep, got, cond)
			}
		}
	}

	// The relay services: the image's binary with the mounted configuration.
	for _, name := range []string{"relay-migrate", "relay"} {
		cmd := list(dig(services, name, "command"))
		want := map[string]string{"relay-migrate": "migrate", "relay": "run"}[name]
		if len(cmd) == 0 || str(cmd[0]) != want {
			t.Errorf("service %s: command %v, want %s first", name, cmd, want)
			continue
		}
		i := slices.IndexFunc(cmd, func(v any) bool { return str(v) == "--config" })
		if i < 0 || i+1 >= len(cmd) {
			t.Errorf("service %s: command %v has no --config", name, cmd)
			continue
		}
		if src := mountSource(services, name, str(cmd[i+1])); src != "./deploy/compose/relay.yaml" {
			t.Errorf("service %s: --config %v is mounted from %q, want ./deploy/compose/relay.yaml", name, cmd[i+1], src)
		}
		if dig(services, name, "environment", "DATABASE_URL") == nil || dig(services, name, "environment", "N8N_TOKEN") == nil {
			t.Errorf("service %s: DATABASE_URL and N8N_TOKEN (relay.yaml expands them) not in its environment", name)
		}
	}

	// The relay's stop grace period covers its shutdown_timeout.
	cfg := checkRelayConfig(t, "deploy/compose/relay.yaml", mustRead(t, "deploy/compose/relay.yaml"), exampleConfigKeys(t))
	shutdown := durationOf(t, "deploy/compose/relay.yaml shutdown_timeout", cfg["shutdown_timeout"])
	if grace := durationOf(t, "relay stop_grace_period", dig(services, "relay", "stop_grace_period")); grace <= shutdown {
		t.Errorf("relay: stop_grace_period %v must exceed shutdown_timeout %v", grace, shutdown)
	}
	if got := str(dig(cfg, "sinks", 1, "url")); got != "nats://nats:4222" {
		t.Errorf("deploy/compose/relay.yaml: NATS sink url %q, want nats://nats:4222", got)
	}
	if got := str(dig(cfg, "sinks", 0, "url")); got != "http://n8n:5678/webhook/outbox" {
		t.Errorf("deploy/compose/relay.yaml: webhook sink url %q, want http://n8n:5678/webhook/outbox", got)
	}

	// The import script reads only what is mounted into its service.
	script := string(mustRead(t, "deploy/compose/n8n-import.sh"))
	for _, p := range regexp.MustCompile(`/import/[\w.-]+`).FindAllString(script, -1) {
		if mountSource(services, "n8n-import", p) == "" {
			t.Errorf("deploy/compose/n8n-import.sh uses %s, which service n8n-import does not mount", p)
		}
	}
	entry := list(dig(services, "n8n-import", "entrypoint"))
	if len(entry) < 2 || mountSource(services, "n8n-import", str(entry[len(entry)-1])) != "./deploy/compose/n8n-import.sh" {
		t.Errorf("n8n-import: entrypoint %v does not run the mounted deploy/compose/n8n-import.sh", entry)
	}
}

// composeVolume splits a service volume, short ("./src:/dst:ro") or long
// syntax, into its source and target; bind says whether the source is a
// host path.
func composeVolume(v any) (src, target string, bind bool) {
	if m := mapOf(v); m != nil {
		src, target = str(m["source"]), str(m["target"])
		return src, target, str(m["type"]) == "bind"
	}
	parts := strings.Split(str(v), ":")
	if len(parts) < 2 {
		return "", "", false
	}
	src, target = parts[0], parts[1]
	return src, target, strings.HasPrefix(src, ".") || strings.HasPrefix(src, "/") || strings.HasPrefix(src, "~")
}

// mountSource returns the host path bind-mounted at containerPath (or at a
// directory above it) in service name, or "".
func mountSource(services map[string]any, name, containerPath string) string {
	for _, v := range list(dig(services, name, "volumes")) {
		src, target, bind := composeVolume(v)
		if !bind {
			continue
		}
		if containerPath == target {
			return src
		}
		if rest, ok := strings.CutPrefix(containerPath, strings.TrimSuffix(target, "/")+"/"); ok {
			return path.Join(src, rest)
		}
	}
	return ""
}

// TestComposeConfig validates docker-compose.yml with docker-compose itself
// (no Docker engine needed).
func TestComposeConfig(t *testing.T) {
	bin, err := exec.LookPath("docker-compose")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("docker-compose is not on PATH (CI=true): apt-get install docker-compose")
		}
		t.Skip("docker-compose is not on PATH (required when CI=true): apt-get install docker-compose")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-f", repoPath("docker-compose.yml"), "config", "-q")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("docker-compose config -q: %v\n%s", err, out)
	}
	// The Compose v2 CLI plugin, when this machine has it.
	if docker, err := exec.LookPath("docker"); err == nil && exec.CommandContext(ctx, docker, "compose", "version").Run() == nil {
		out, err := exec.CommandContext(ctx, docker, "compose", "-f", repoPath("docker-compose.yml"), "config", "-q").CombinedOutput()
		if err != nil {
			t.Fatalf("docker compose config -q: %v\n%s", err, out)
		}
	}
}

// TestNATSConfig parses the compose stack's NATS configuration with the
// server's own parser.
func TestNATSConfig(t *testing.T) {
	opts, err := server.ProcessConfigFile(repoPath("deploy/compose/nats.conf"))
	if err != nil {
		t.Fatal(err)
	}
	if !opts.JetStream || opts.StoreDir != "/data" || !opts.SyncAlways || opts.HTTPPort != 8222 || opts.Port != 4222 {
		t.Errorf("deploy/compose/nats.conf: jetstream %v store_dir %q sync always %v http_port %d port %d; want JetStream in /data, sync_interval: always, monitoring on 8222, clients on 4222",
			opts.JetStream, opts.StoreDir, opts.SyncAlways, opts.HTTPPort, opts.Port)
	}
	services := mapOf(composeFile(t)["services"])
	if mountSource(services, "nats", "/data") != "" || !slices.ContainsFunc(list(dig(services, "nats", "volumes")), func(v any) bool {
		_, target, _ := composeVolume(v)
		return target == "/data"
	}) {
		t.Error("nats: /data is not on a named volume")
	}
}

// --- Dockerfile -------------------------------------------------------------

func TestDockerfile(t *testing.T) {
	src := string(mustRead(t, "deploy/Dockerfile"))
	var stages []string
	instructions := map[string][]string{} // of the final stage
	sc := bufio.NewScanner(strings.NewReader(strings.ReplaceAll(src, "\\\n", " ")))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		word, rest, _ := strings.Cut(line, " ")
		word = strings.ToUpper(word)
		if word == "FROM" {
			stages = append(stages, rest)
			instructions = map[string][]string{}
		}
		instructions[word] = append(instructions[word], strings.TrimSpace(rest))
	}
	// The builder is the toolchain go.mod pins, so the image's binaries
	// carry its fixes.
	toolchain := regexp.MustCompile(`(?m)^toolchain go(\S+)$`).FindStringSubmatch(string(mustRead(t, "go.mod")))
	if toolchain == nil {
		t.Fatal("go.mod: no toolchain line (the patched Go that builds the relay)")
	}
	if len(stages) < 2 || !strings.Contains(stages[0], "golang:${GO_VERSION}") || !strings.Contains(src, "ARG GO_VERSION="+toolchain[1]+"\n") {
		t.Errorf("want a golang:${GO_VERSION} builder stage first with ARG GO_VERSION=%s (go.mod's toolchain), got stages %v", toolchain[1], stages)
	}
	final := stages[len(stages)-1]
	if !strings.Contains(final, "distroless/static") && !strings.HasPrefix(final, "scratch") {
		t.Errorf("final stage %q: want distroless static or scratch", final)
	}
	for _, want := range []string{"CGO_ENABLED=0", "-trimpath", `-s -w -X main.version=`, "./cmd/outbox-relay", "./deploy/healthcheck"} {
		if !strings.Contains(src, want) {
			t.Errorf("deploy/Dockerfile: %q missing", want)
		}
	}
	for _, pkg := range []string{"cmd/outbox-relay", "deploy/healthcheck", "go.mod", "go.sum"} {
		if !exists(pkg) {
			t.Errorf("deploy/Dockerfile builds from %s, which does not exist", pkg)
		}
	}
	user := instructions["USER"]
	if len(user) == 0 || user[len(user)-1] == "root" || strings.HasPrefix(user[len(user)-1], "0") {
		t.Errorf("final stage USER %v: want a non-root user", user)
	}
	checks := map[string]string{
		"EXPOSE":      "9187",
		"HEALTHCHECK": `CMD ["/healthcheck"]`,
		"ENTRYPOINT":  `["/outbox-relay"]`,
		"CMD":         `["run", "--config", "/etc/outbox-relay/relay.yaml"]`,
	}
	for word, want := range checks {
		got := instructions[word]
		if len(got) == 0 || !strings.Contains(got[len(got)-1], want) {
			t.Errorf("final stage %s = %v, want %s", word, got, want)
		}
	}

	// The build context's ignore file must not drop what the build needs.
	for _, pattern := range strings.Split(string(mustRead(t, "deploy/Dockerfile.dockerignore")), "\n") {
		pattern = strings.TrimSpace(pattern)
		if pattern == "" || strings.HasPrefix(pattern, "#") || strings.HasPrefix(pattern, "!") {
			continue
		}
		for _, needed := range []string{"go.mod", "go.sum", "cmd", "cmd/outbox-relay", "cmd/internal", "relay", "sink", "ledger", "migrations", "migrations/sql", "deploy", "deploy/healthcheck"} {
			if ok, _ := filepath.Match(pattern, needed); ok {
				t.Errorf("deploy/Dockerfile.dockerignore: %q excludes %s, which the build needs", pattern, needed)
			}
		}
	}
}

// --- Kubernetes ---------------------------------------------------------------

type k8sObject struct {
	file string
	doc  map[string]any
}

func (o k8sObject) kind() string { return str(o.doc["kind"]) }
func (o k8sObject) name() string { return str(dig(o.doc, "metadata", "name")) }

func k8sObjects(t *testing.T) []k8sObject {
	t.Helper()
	files, err := filepath.Glob(repoPath("deploy/k8s/*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("deploy/k8s: no manifests (%v)", err)
	}
	var objs []k8sObject
	for _, f := range files {
		rel := "deploy/k8s/" + filepath.Base(f)
		for _, doc := range mustYAMLDocs(t, rel) {
			if str(doc["apiVersion"]) == "" || str(doc["kind"]) == "" {
				t.Errorf("%s: a document without apiVersion or kind", rel)
			}
			objs = append(objs, k8sObject{rel, doc})
		}
	}
	return objs
}

func findObject(t *testing.T, objs []k8sObject, kind, name string) k8sObject {
	t.Helper()
	for _, o := range objs {
		if o.kind() == kind && (name == "" || o.name() == name) {
			return o
		}
	}
	t.Fatalf("deploy/k8s: no %s %s", kind, name)
	return k8sObject{}
}

// podSpecOf returns the pod spec of a Deployment or Job.
func podSpecOf(o k8sObject) map[string]any { return mapOf(dig(o.doc, "spec", "template", "spec")) }

func TestKubernetes(t *testing.T) {
	objs := k8sObjects(t)
	kinds := map[string]int{}
	for _, o := range objs {
		kinds[o.kind()]++
	}
	for _, k := range []string{"Deployment", "ConfigMap", "Secret", "Service", "PodDisruptionBudget", "Job"} {
		if kinds[k] == 0 {
			t.Errorf("deploy/k8s: no %s", k)
		}
	}

	// The kustomization lists every manifest.
	kust := findObject(t, objs, "Kustomization", "")
	var listed []string
	for _, r := range list(dig(kust.doc, "resources")) {
		listed = append(listed, "deploy/k8s/"+str(r))
	}
	for _, o := range objs {
		if o.kind() != "Kustomization" && !slices.Contains(listed, o.file) {
			t.Errorf("%s is not in kustomization.yaml resources", o.file)
		}
	}
	for _, f := range listed {
		if !exists(f) {
			t.Errorf("kustomization.yaml lists %s, which does not exist", f)
		}
	}

	deploy := findObject(t, objs, "Deployment", "outbox-relay")
	if r, ok := dig(deploy.doc, "spec", "replicas").(int); !ok || r != 2 {
		t.Errorf("Deployment replicas = %v, want 2", dig(deploy.doc, "spec", "replicas"))
	}
	podLabels := mapOf(dig(deploy.doc, "spec", "template", "metadata", "labels"))
	if !labelsMatch(mapOf(dig(deploy.doc, "spec", "selector", "matchLabels")), podLabels) {
		t.Error("Deployment selector does not match its pod labels")
	}
	spec := podSpecOf(deploy)
	relay := mapOf(dig(spec, "containers", 0))
	for probe, want := range map[string]string{"livenessProbe": "/healthz", "readinessProbe": "/readyz"} {
		if got := str(dig(relay, probe, "httpGet", "path")); got != want {
			t.Errorf("Deployment %s path = %q, want %s", probe, got, want)
		}
		if port := str(dig(relay, probe, "httpGet", "port")); port != "metrics" && port != "9187" {
			t.Errorf("Deployment %s port = %q, want the metrics port", probe, port)
		}
	}
	if str(dig(relay, "ports", 0, "containerPort")) != "9187" || str(dig(relay, "ports", 0, "name")) != "metrics" {
		t.Errorf("Deployment container ports %v, want metrics 9187", relay["ports"])
	}
	if dig(relay, "resources", "requests") == nil || dig(relay, "resources", "limits", "memory") == nil {
		t.Error("Deployment container: resources requests and a memory limit required")
	}

	cm := findObject(t, objs, "ConfigMap", "outbox-relay")
	cfgSrc := str(dig(cm.doc, "data", "relay.yaml"))
	cfg := checkRelayConfig(t, cm.file+" relay.yaml", []byte(cfgSrc), exampleConfigKeys(t))
	if got := str(dig(cfg, "http", "listen")); got != "0.0.0.0:9187" {
		t.Errorf("ConfigMap relay.yaml: http.listen %q, want 0.0.0.0:9187", got)
	}
	for _, s := range list(cfg["sinks"]) {
		if str(dig(s, "type")) == "nats" && str(dig(s, "url")) == "" {
			t.Errorf("ConfigMap relay.yaml: NATS sink %v uses the embedded server; two replicas need an external NATS", dig(s, "name"))
		}
	}
	shutdown := durationOf(t, "ConfigMap relay.yaml shutdown_timeout", cfg["shutdown_timeout"])
	if grace, _ := spec["terminationGracePeriodSeconds"].(int); time.Duration(grace)*time.Second <= shutdown {
		t.Errorf("Deployment terminationGracePeriodSeconds %v must exceed shutdown_timeout %v", spec["terminationGracePeriodSeconds"], shutdown)
	}

	secret := findObject(t, objs, "Secret", "outbox-relay")
	job := findObject(t, objs, "Job", "outbox-relay-migrate")
	for _, o := range []k8sObject{deploy, job} {
		checkPod(t, o, objs, cfg, secret)
	}
	jobArgs := list(dig(podSpecOf(job), "containers", 0, "args"))
	if len(jobArgs) == 0 || str(jobArgs[0]) != "migrate" {
		t.Errorf("Job args %v, want migrate first", jobArgs)
	}
	if len(list(relay["args"])) == 0 || str(list(relay["args"])[0]) != "run" {
		t.Errorf("Deployment args %v, want run first", relay["args"])
	}

	svc := findObject(t, objs, "Service", "outbox-relay-metrics")
	if !labelsMatch(mapOf(dig(svc.doc, "spec", "selector")), podLabels) {
		t.Error("Service selector does not match the Deployment's pods")
	}
	if str(dig(svc.doc, "spec", "ports", 0, "port")) != "9187" || str(dig(svc.doc, "spec", "ports", 0, "targetPort")) != "metrics" {
		t.Errorf("Service ports %v, want 9187 → metrics", dig(svc.doc, "spec", "ports"))
	}
	ann := mapOf(dig(svc.doc, "metadata", "annotations"))
	if str(ann["prometheus.io/scrape"]) != "true" || str(ann["prometheus.io/port"]) != "9187" {
		t.Errorf("Service annotations %v, want prometheus.io/scrape and port", ann)
	}

	pdb := findObject(t, objs, "PodDisruptionBudget", "outbox-relay")
	if str(dig(pdb.doc, "spec", "minAvailable")) != "1" || !labelsMatch(mapOf(dig(pdb.doc, "spec", "selector", "matchLabels")), podLabels) {
		t.Errorf("PodDisruptionBudget spec %v, want minAvailable 1 selecting the relay pods", pdb.doc["spec"])
	}
}

// checkPod checks a Deployment's or Job's pod: non-root, read-only, no
// capabilities; the --config file comes from the ConfigMap; each *_file in
// the configuration (or RELAY_*_FILE in the environment) is a key of the
// mounted Secret.
func checkPod(t *testing.T, o k8sObject, objs []k8sObject, cfg map[string]any, secret k8sObject) {
	t.Helper()
	where := o.kind() + " " + o.name()
	spec := podSpecOf(o)
	if dig(spec, "securityContext", "runAsNonRoot") != true {
		t.Errorf("%s: pod securityContext.runAsNonRoot must be true", where)
	}
	containers := list(spec["containers"])
	if len(containers) != 1 {
		t.Fatalf("%s: %d containers, want 1", where, len(containers))
	}
	c := mapOf(containers[0])
	sc := mapOf(c["securityContext"])
	if sc["readOnlyRootFilesystem"] != true || sc["allowPrivilegeEscalation"] != false || sc["runAsNonRoot"] != true ||
		!slices.ContainsFunc(list(dig(sc, "capabilities", "drop")), func(v any) bool { return str(v) == "ALL" }) {
		t.Errorf("%s: container securityContext %v, want runAsNonRoot, readOnlyRootFilesystem, no privilege escalation, drop ALL", where, sc)
	}

	volumes := map[string]map[string]any{}
	for _, v := range list(spec["volumes"]) {
		volumes[str(dig(v, "name"))] = mapOf(v)
	}
	type mount struct{ path, volume string }
	var mounts []mount
	for _, m := range list(c["volumeMounts"]) {
		name := str(dig(m, "name"))
		if volumes[name] == nil {
			t.Errorf("%s: volumeMount %s has no volume", where, name)
		}
		mounts = append(mounts, mount{str(dig(m, "mountPath")), name})
	}
	// fileIn returns the volume and the file inside it that path names.
	fileIn := func(p string) (map[string]any, string) {
		for _, m := range mounts {
			if rest, ok := strings.CutPrefix(p, strings.TrimSuffix(m.path, "/")+"/"); ok {
				return volumes[m.volume], rest
			}
		}
		return nil, ""
	}

	args := list(c["args"])
	i := slices.IndexFunc(args, func(v any) bool { return str(v) == "--config" })
	if i < 0 || i+1 >= len(args) {
		t.Errorf("%s: args %v have no --config", where, args)
	} else if vol, file := fileIn(str(args[i+1])); vol == nil || str(dig(vol, "configMap", "name")) != "outbox-relay" || file != "relay.yaml" {
		t.Errorf("%s: --config %v is not relay.yaml of ConfigMap outbox-relay", where, args[i+1])
	}
	for _, v := range volumes {
		if name := str(dig(v, "configMap", "name")); name != "" {
			findObject(t, objs, "ConfigMap", name)
		}
	}

	// Secret files the relay reads.
	files := map[string]string{} // key → path
	var walk func(v any, p string)
	walk = func(v any, p string) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				walk(x, joinKey(p, k))
			}
		case []any:
			for _, x := range v {
				walk(x, p+"[]")
			}
		default:
			if strings.HasSuffix(p, "_file") {
				files[p] = str(v)
			}
		}
	}
	walk(cfg, "")
	for _, e := range list(c["env"]) {
		name := str(dig(e, "name"))
		if key, ok := strings.CutPrefix(name, "RELAY_"); ok && strings.HasSuffix(key, "_FILE") {
			files[strings.ToLower(key)] = str(dig(e, "value"))
		}
	}
	secretKeys := map[string]bool{}
	for k := range mapOf(dig(secret.doc, "stringData")) {
		secretKeys[k] = true
	}
	for k := range mapOf(dig(secret.doc, "data")) {
		secretKeys[k] = true
	}
	for key, p := range files {
		vol, file := fileIn(p)
		if vol == nil || str(dig(vol, "secret", "secretName")) != secret.name() {
			t.Errorf("%s: %s %s is not in a mounted Secret %s", where, key, p, secret.name())
			continue
		}
		found := false
		for _, item := range list(dig(vol, "secret", "items")) {
			if str(dig(item, "path")) == file {
				found = true
				if k := str(dig(item, "key")); !secretKeys[k] {
					t.Errorf("%s: %s reads Secret key %s, which the Secret does not have", where, key, k)
				}
			}
		}
		if !found && (len(list(dig(vol, "secret", "items"))) > 0 || !secretKeys[file]) {
			t.Errorf("%s: %s %s is not a file of the mounted Secret", where, key, p)
		}
	}
}

func labelsMatch(selector, labels map[string]any) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if str(labels[k]) != str(v) {
			return false
		}
	}
	return true
}

// --- systemd ----------------------------------------------------------------

func TestSystemdUnit(t *testing.T) {
	const rel = "deploy/systemd/outbox-relay.service"
	settings := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(mustRead(t, rel)))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";") || strings.HasPrefix(line, "[") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Errorf("%s: %q is not key=value", rel, line)
			continue
		}
		settings[k] = append(settings[k], v)
	}
	last := func(k string) string {
		if v := settings[k]; len(v) > 0 {
			return v[len(v)-1]
		}
		return ""
	}
	for k, want := range map[string]string{
		"ProtectSystem":   "strict",
		"NoNewPrivileges": "yes",
		"Restart":         "always",
		"KillSignal":      "SIGTERM",
	} {
		if got := last(k); got != want {
			t.Errorf("%s: %s=%q, want %q", rel, k, got, want)
		}
	}
	if last("DynamicUser") != "yes" && last("User") == "" {
		t.Errorf("%s: neither DynamicUser=yes nor User=", rel)
	}
	if last("EnvironmentFile") == "" {
		t.Errorf("%s: no EnvironmentFile for the secrets", rel)
	}
	if !strings.Contains(last("ExecStart"), " run --config ") {
		t.Errorf("%s: ExecStart=%q, want outbox-relay run --config …", rel, last("ExecStart"))
	}
	cfg := checkRelayConfig(t, "deploy/relay.example.yaml", mustRead(t, "deploy/relay.example.yaml"), exampleConfigKeys(t))
	shutdown := durationOf(t, "deploy/relay.example.yaml shutdown_timeout", cfg["shutdown_timeout"])
	if stop := durationOf(t, rel+" TimeoutStopSec", last("TimeoutStopSec")); stop <= shutdown {
		t.Errorf("%s: TimeoutStopSec=%v must exceed shutdown_timeout %v", rel, stop, shutdown)
	}

	// systemd's own check, when this machine has it; the binary need not be
	// installed for that.
	if analyze, err := exec.LookPath("systemd-analyze"); err == nil {
		unit := strings.ReplaceAll(string(mustRead(t, rel)), "ExecStart=/usr/local/bin/outbox-relay ", "ExecStart=/bin/true ")
		tmp := filepath.Join(t.TempDir(), "outbox-relay.service")
		if err := os.WriteFile(tmp, []byte(unit), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(analyze, "verify", "--man=no", tmp).CombinedOutput()
		if err != nil || len(bytes.TrimSpace(out)) > 0 {
			t.Errorf("systemd-analyze verify %s: %v\n%s", rel, err, out)
		}
	}
}

// --- Prometheus alerts and Grafana dashboard ----------------------------------

func TestAlertRules(t *testing.T) {
	const rel = "deploy/prometheus/alerts.yml"
	docs := mustYAMLDocs(t, rel)
	rules := map[string]map[string]any{}
	for _, g := range list(docs[0]["groups"]) {
		if str(dig(g, "name")) == "" {
			t.Errorf("%s: a group without a name", rel)
		}
		for _, r := range list(dig(g, "rules")) {
			rule := mapOf(r)
			name, expr := str(rule["alert"]), str(rule["expr"])
			if name == "" || strings.TrimSpace(expr) == "" {
				t.Errorf("%s: rule %v has an empty alert name or expr", rel, rule)
				continue
			}
			if _, dup := rules[name]; dup {
				t.Errorf("%s: alert %s defined twice", rel, name)
			}
			rules[name] = rule
			checkExpr(t, rel+" "+name, expr)
			if str(dig(rule, "labels", "severity")) == "" || str(dig(rule, "annotations", "summary")) == "" {
				t.Errorf("%s: %s needs labels.severity and annotations.summary", rel, name)
			}
			if rule["for"] != nil {
				durationOf(t, rel+" "+name+" for", rule["for"])
			}
		}
	}
	want := []struct {
		alert      string
		contains   []string
		forAtLeast time.Duration
	}{
		{"OutboxRelayOldestPendingTooOld", []string{"outbox_relay_oldest_pending_age_seconds", "> 300"}, 0},
		{"OutboxRelayRetainedWALCritical", []string{"outbox_relay_slot_retained_wal_bytes", "1024 * 1024 * 1024"}, 0},
		{"OutboxRelayRetainedWALHigh", []string{"outbox_relay_slot_retained_wal_bytes"}, 0},
		{"OutboxRelayDeadLetters", []string{"increase(outbox_relay_failed_total[10m])", "> 0"}, 0},
		{"OutboxRelayFailedRows", []string{`outbox_relay_rows{status="failed"}`, "> 0"}, 0},
		{"OutboxRelayPollMode", []string{`outbox_relay_mode{mode="poll"}`, "== 1"}, 10 * time.Minute},
		{"OutboxRelayNoLeader", []string{"max(outbox_relay_leader) == 0"}, 2 * time.Minute},
		{"OutboxRelayStuckRows", []string{"outbox_relay_stuck_rows", "> 0"}, 5 * time.Minute},
		{"OutboxRelayDown", []string{"absent(outbox_relay_up)"}, time.Minute},
		{"OutboxRelayStalled", []string{"outbox_relay_stalled", "== 1"}, time.Minute},
		{"OutboxRelayStalledRepeatedly", []string{"changes(outbox_relay_stalled[1h])"}, 0},
		{"OutboxRelayVerifyGaps", []string{"outbox_relay_verify_gaps", "missing|unrouted|orphaned", "> 0"}, 0},
		{"OutboxRelayVerifyStale", []string{"outbox_relay_verify_last_run_timestamp_seconds", "> 3600"}, 5 * time.Minute},
	}
	for _, w := range want {
		rule := rules[w.alert]
		if rule == nil {
			t.Errorf("%s: alert %s missing", rel, w.alert)
			continue
		}
		for _, c := range w.contains {
			if !strings.Contains(str(rule["expr"]), c) {
				t.Errorf("%s: %s expr %q does not contain %q", rel, w.alert, rule["expr"], c)
			}
		}
		if w.forAtLeast > 0 {
			if d := durationOf(t, w.alert+" for", rule["for"]); d < w.forAtLeast {
				t.Errorf("%s: %s for %v, want at least %v", rel, w.alert, d, w.forAtLeast)
			}
		}
	}
}

// TestAlertRulesPromtool checks alerts.yml with Prometheus's own promtool
// (`check rules`) and runs its unit tests, deploy/prometheus/alerts_test.yml
// (`test rules`): one test group per alert, named after it, that shows it
// firing on the series that should fire it and silent otherwise.
func TestAlertRulesPromtool(t *testing.T) {
	bin, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("promtool is not on PATH (CI=true): apt-get install prometheus (.ci/run does)")
		}
		t.Skip("promtool is not on PATH (required when CI=true): apt-get install prometheus")
	}
	const rules, tests = "deploy/prometheus/alerts.yml", "deploy/prometheus/alerts_test.yml"

	// Every alert has its group, and each group both sees its alert fire
	// and sees it silent.
	var alerts []string
	for _, g := range list(mustYAMLDocs(t, rules)[0]["groups"]) {
		for _, r := range list(dig(g, "rules")) {
			if a := str(dig(r, "alert")); a != "" {
				alerts = append(alerts, a)
			}
		}
	}
	doc := mustYAMLDocs(t, tests)[0]
	if files := list(doc["rule_files"]); len(files) != 1 || str(files[0]) != path.Base(rules) {
		t.Errorf("%s: rule_files %v, want [%s]", tests, files, path.Base(rules))
	}
	groups := map[string]bool{}
	for _, g := range list(doc["tests"]) {
		name := str(dig(g, "name"))
		groups[name] = true
		fires, silent := false, false
		for _, c := range list(dig(g, "alert_rule_test")) {
			if str(dig(c, "alertname")) != name {
				continue
			}
			if len(list(dig(c, "exp_alerts"))) > 0 {
				fires = true
			} else {
				silent = true
			}
		}
		if !slices.Contains(alerts, name) {
			t.Errorf("%s: test group %q is named after no alert of %s", tests, name, rules)
		} else if !fires || !silent {
			t.Errorf("%s: group %s must expect %s both firing and silent (fires: %v, silent: %v)", tests, name, name, fires, silent)
		}
	}
	for _, a := range alerts {
		if !groups[a] {
			t.Errorf("%s: no test group for alert %s", tests, a)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, args := range [][]string{{"check", "rules", path.Base(rules)}, {"test", "rules", path.Base(tests)}} {
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Dir = repoPath("deploy/prometheus")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s (in deploy/prometheus): %v\n%s", strings.Join(args, " "), err, out)
		} else {
			t.Logf("promtool %s: %s", strings.Join(args, " "), bytes.Join(bytes.Fields(out), []byte(" ")))
		}
	}
}

func TestGrafanaDashboard(t *testing.T) {
	const rel = "deploy/grafana/outbox-relay.json"
	var dash map[string]any
	if err := json.Unmarshal(mustRead(t, rel), &dash); err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
	if str(dash["title"]) == "" || str(dash["uid"]) == "" {
		t.Errorf("%s: title and uid required", rel)
	}

	// The datasource is a variable, so the dashboard imports anywhere.
	vars := map[string]map[string]any{}
	for _, v := range list(dig(dash, "templating", "list")) {
		vars[str(dig(v, "name"))] = mapOf(v)
	}
	if ds := vars["datasource"]; str(ds["type"]) != "datasource" || str(ds["query"]) != "prometheus" {
		t.Errorf("%s: templating variable datasource %v, want type datasource, query prometheus", rel, ds)
	}
	for name, v := range vars {
		if str(v["type"]) != "query" {
			continue
		}
		q := str(dig(v, "query", "query"))
		if q == "" {
			q = str(v["query"])
		}
		m := regexp.MustCompile(`^label_values\((\w+)`).FindStringSubmatch(q)
		if m == nil || !knownSeries(m[1]) {
			t.Errorf("%s: variable %s query %q: want label_values over one of the relay's metrics", rel, name, q)
		}
	}

	used := map[string]bool{}
	exprs := ""
	ids := map[float64]bool{}
	var walk func(panels []any)
	walk = func(panels []any) {
		for _, p := range panels {
			panel := mapOf(p)
			title := str(panel["title"])
			if id, _ := panel["id"].(float64); ids[id] {
				t.Errorf("%s: panel id %v used twice", rel, panel["id"])
			} else {
				ids[id] = true
			}
			x, _ := dig(panel, "gridPos", "x").(float64)
			w, _ := dig(panel, "gridPos", "w").(float64)
			h, _ := dig(panel, "gridPos", "h").(float64)
			if w <= 0 || h <= 0 || x+w > 24 {
				t.Errorf("%s: panel %q gridPos %v", rel, title, panel["gridPos"])
			}
			if str(panel["type"]) == "row" {
				walk(list(panel["panels"]))
				continue
			}
			if str(dig(panel, "datasource", "uid")) != "${datasource}" {
				t.Errorf("%s: panel %q datasource %v, want uid ${datasource}", rel, title, panel["datasource"])
			}
			targets := list(panel["targets"])
			if len(targets) == 0 {
				t.Errorf("%s: panel %q has no targets", rel, title)
			}
			for _, tg := range targets {
				expr := str(dig(tg, "expr"))
				if u := str(dig(tg, "datasource", "uid")); u != "" && u != "${datasource}" {
					t.Errorf("%s: panel %q target datasource %q", rel, title, u)
				}
				for _, m := range checkExpr(t, fmt.Sprintf("%s panel %q", rel, title), expr) {
					used[m] = true
				}
				exprs += expr + "\n"
			}
		}
	}
	walk(list(dash["panels"]))

	for _, m := range []string{
		"outbox_relay_delivered_total", "outbox_relay_delivery_latency_seconds", "outbox_relay_pending_rows",
		"outbox_relay_oldest_pending_age_seconds", "outbox_relay_slot_retained_wal_bytes", "outbox_relay_mode",
		"outbox_relay_leader", "outbox_relay_failed_total", "outbox_relay_held_total", "outbox_relay_handed_off_total",
	} {
		if !used[m] {
			t.Errorf("%s: no panel shows %s", rel, m)
		}
	}
	for _, q := range []string{"histogram_quantile(0.5,", "histogram_quantile(0.99,", "sum by (sink, path) (rate(outbox_relay_delivered_total"} {
		if !strings.Contains(exprs, q) {
			t.Errorf("%s: no panel queries %s…", rel, q)
		}
	}
}

// TestQueries: deploy.Queries, which the scrape test in cmd/outbox-relay
// reads, returns every alert's expr, every dashboard target's and each
// label_values variable's metric, and they name only the relay's metrics.
func TestQueries(t *testing.T) {
	qs, err := deploy.Queries()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for _, q := range qs {
		got[q.Expr] = true
		checkExpr(t, q.Where, q.Expr)
	}
	var want []string
	for _, g := range list(mustYAMLDocs(t, "deploy/prometheus/alerts.yml")[0]["groups"]) {
		for _, r := range list(dig(g, "rules")) {
			want = append(want, str(dig(r, "expr")))
		}
	}
	var dash any
	if err := json.Unmarshal(mustRead(t, "deploy/grafana/outbox-relay.json"), &dash); err != nil {
		t.Fatal(err)
	}
	var walk func(panels []any)
	walk = func(panels []any) {
		for _, p := range panels {
			for _, tg := range list(dig(p, "targets")) {
				want = append(want, str(dig(tg, "expr")))
			}
			walk(list(dig(p, "panels")))
		}
	}
	walk(list(dig(dash, "panels")))
	want = append(want, "outbox_relay_up", "outbox_relay_delivered_total") // the job and sink variables
	for _, w := range want {
		if !got[w] {
			t.Errorf("deploy.Queries() lacks %q", w)
		}
	}
	if len(qs) != len(want) {
		t.Errorf("deploy.Queries() returned %d queries, want %d", len(qs), len(want))
	}
}

// composeDefaults resolves ${VAR:-default} in a compose value to its
// default, as docker compose does with VAR unset.
func composeDefaults(v string) string {
	return regexp.MustCompile(`\$\{\w+:-([^}]*)\}`).ReplaceAllString(v, "$1")
}

// TestN8NCredentials runs deploy/compose/n8n-credentials.js on the workflow
// with the n8n-import service's environment: it must create every credential
// the workflow's nodes refer to, and the header credential must expect what
// the relay's webhook sink sends.
func TestN8NCredentials(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("node is not on PATH (CI=true); the n8n tests need Node.js 20")
		}
		t.Skip("node is not on PATH (required when CI=true)")
	}
	services := mapOf(composeFile(t)["services"])
	environ := []string{"PATH=" + os.Getenv("PATH")}
	for k, v := range mapOf(dig(services, "n8n-import", "environment")) {
		environ = append(environ, k+"="+composeDefaults(str(v)))
	}
	if a, b := str(dig(services, "n8n-import", "environment", "N8N_TOKEN")), str(dig(services, "relay", "environment", "N8N_TOKEN")); a == "" || a != b {
		t.Errorf("N8N_TOKEN: n8n-import has %q, relay %q; they must be the same", a, b)
	}

	run := func(workflow string) ([]map[string]any, string, error) {
		out := filepath.Join(t.TempDir(), "credentials.json")
		cmd := exec.Command(node, repoPath("deploy/compose/n8n-credentials.js"), workflow, out)
		cmd.Env = environ
		msg, err := cmd.CombinedOutput()
		if err != nil {
			return nil, string(msg), err
		}
		var creds []map[string]any
		if err := json.Unmarshal(mustReadAbs(t, out), &creds); err != nil {
			t.Fatal(err)
		}
		return creds, string(msg), nil
	}

	workflow := repoPath("deploy/n8n/outbox-workflow.json")
	creds, msg, err := run(workflow)
	if err != nil {
		t.Fatalf("n8n-credentials.js: %v\n%s", err, msg)
	}
	var wf map[string]any
	if err := json.Unmarshal(mustRead(t, "deploy/n8n/outbox-workflow.json"), &wf); err != nil {
		t.Fatal(err)
	}
	byID := map[string]map[string]any{}
	for _, c := range creds {
		byID[str(c["id"])] = c
	}
	for _, n := range list(wf["nodes"]) {
		for typ, ref := range mapOf(dig(n, "credentials")) {
			c := byID[str(dig(ref, "id"))]
			if c == nil || str(c["type"]) != typ || len(mapOf(c["data"])) == 0 {
				t.Errorf("node %v needs %s credential %v; generated %v", dig(n, "name"), typ, ref, c)
			}
		}
	}
	cfg := checkRelayConfig(t, "deploy/compose/relay.yaml", mustRead(t, "deploy/compose/relay.yaml"), exampleConfigKeys(t))
	token := composeDefaults(str(dig(services, "relay", "environment", "N8N_TOKEN")))
	for _, c := range creds {
		if str(c["type"]) != "httpHeaderAuth" {
			continue
		}
		if str(dig(c, "data", "name")) != str(dig(cfg, "sinks", 0, "auth", "header")) || str(dig(c, "data", "value")) != token {
			t.Errorf("header credential %v does not match the relay's auth header %v with N8N_TOKEN", c["data"], dig(cfg, "sinks", 0, "auth", "header"))
		}
	}

	// A credential type the script cannot fill is an error naming it.
	odd := filepath.Join(t.TempDir(), "wf.json")
	if err := os.WriteFile(odd, []byte(`{"id":"x","nodes":[{"name":"Slack","credentials":{"slackApi":{"id":"s1","name":"s"}}}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, msg, err := run(odd); err == nil || !strings.Contains(msg, "slackApi") {
		t.Errorf("unknown credential type: err %v, output %q; want a failure naming slackApi", err, msg)
	}
}

func mustReadAbs(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
