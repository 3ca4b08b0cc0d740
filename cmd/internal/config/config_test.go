package config_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/relay"
)

// MustWriteFile writes content to a file called name in a fresh temporary
// directory and returns its path.
func MustWriteFile(tb testing.TB, name, content string) string {
	tb.Helper()
	p := filepath.Join(tb.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		tb.Fatal(err)
	}
	return p
}

// load loads yamlText (no file when empty) with env as the entire
// environment, so tests never see or change the real one.
func load(tb testing.TB, yamlText string, env ...string) (*config.Config, error) {
	tb.Helper()
	opts := config.Options{Environ: append([]string{}, env...)}
	if yamlText != "" {
		opts.Path = MustWriteFile(tb, "relay.yaml", yamlText)
	}
	return config.Load(opts)
}

// MustLoad is load for configurations that must be valid.
func MustLoad(tb testing.TB, yamlText string, env ...string) *config.Config {
	tb.Helper()
	c, err := load(tb, yamlText, env...)
	if err != nil {
		tb.Fatalf("Load: %v", err)
	}
	return c
}

// requireErrorContains fails unless err mentions every string in want.
func requireErrorContains(tb testing.TB, err error, want ...string) {
	tb.Helper()
	if err == nil {
		tb.Fatalf("Load succeeded, want an error mentioning %q", want)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			tb.Errorf("error does not mention %q:\n%v", w, err)
		}
	}
}

// assertEqualConfig compares the exported fields of two configurations.
func assertEqualConfig(tb testing.TB, got, want *config.Config) {
	tb.Helper()
	gv, wv := reflect.ValueOf(got).Elem(), reflect.ValueOf(want).Elem()
	for i := range gv.NumField() {
		f := gv.Type().Field(i)
		if !f.IsExported() {
			continue
		}
		if g, w := gv.Field(i).Interface(), wv.Field(i).Interface(); !reflect.DeepEqual(g, w) {
			tb.Errorf("%s:\n got %+v\nwant %+v", f.Name, g, w)
		}
	}
}

func sec(d time.Duration) config.Duration { return config.Duration(d) }

func TestLoad_DefaultsWithoutFile(t *testing.T) {
	c := MustLoad(t, "")
	want := config.Default()
	want.Outbox.ConflictsTable = "integration_outbox_conflicts"
	assertEqualConfig(t, c, &want)

	d := config.Default()
	if err := d.Validate(); err != nil {
		t.Errorf("Default().Validate: %v", err)
	}
	if got, want := d.Tables(), c.Tables(); got != want {
		t.Errorf("Tables of Default and of Load differ: %+v, %+v", got, want)
	}
	wantTables := config.Tables{
		Outbox:          relay.QualifiedName{Name: "integration_outbox"},
		Ledger:          relay.QualifiedName{Name: "integration_idempotency"},
		Checkpoint:      relay.QualifiedName{Name: "relay_checkpoint"},
		Conflicts:       relay.QualifiedName{Name: "integration_outbox_conflicts"},
		PublishFunction: relay.QualifiedName{Name: "outbox_publish"},
		Publication:     "outbox_relay",
	}
	if got := c.Tables(); got != wantTables {
		t.Errorf("Tables() = %+v, want %+v", got, wantTables)
	}
}

func TestLoad_EmptyFile(t *testing.T) {
	c := MustLoad(t, "# nothing yet\n")
	if c.Source.Mode != config.SourceAuto || len(c.Sinks) != 0 {
		t.Errorf("empty file: got %+v", c)
	}
}

const fullFile = `
database_url: postgres://relay:pw@db:5432/app
outbox:
  table: app.outbox
  ledger_table: app.ledger
  checkpoint_table: app.checkpoint
  conflicts_table: app.conflicts
  publish_function: app.publish
source:
  mode: poll
  slot: my_slot
  publication: my_pub
  poll_interval: 250ms
  batch_size: 100
  sweep_after: 1m
  lock_timeout: 2m
  slot_max_unconsumed: 1h
  slot_max_retained: 512MiB
  notify_trigger: true
  standby_url: postgres://relay:pw@standby:5432/app
  standby_max_lag: 10s
delivery:
  ordering: none
  inline_attempts: 0
  max_attempts: 5
  backoff: [2s, 1m]
  mark_done: off
  lane_block_max: 500ms
  max_inflight_bytes: 16MiB
sinks:
  - name: n8n
    type: webhook
    url: https://n8n.example.com/webhook/outbox
    events: ["order.*", "invoice.paid"]
    timeout: 3s
    concurrency: 2
    auth: {type: jwt, secret: s3cret}
    headers: {X-Tenant: acme}
    body: nudge
    on_unknown: hold
    max_body: 1MB
    permanent_statuses: [400, 422]
    409_means_delivered: true
    batch: {max_events: 100, max_wait: 20ms, ordered: true}
  - name: bus
    type: nats
    url: nats://a:4222,nats://b:4222
    subject: "events.{{.EventType}}"
    stream: {name: EVENTS, subjects: ["events.>"], duplicate_window: 10m, create: false, max_msg_size: 8MiB}
    max_pending: 128
    creds_file: /etc/nats.creds
    token: tok
http:
  listen: ":9999"
data_dir: /var/lib/relay
shutdown_timeout: 1m
log: {level: debug, format: json}
migrate: {lock_timeout: 2s, timeout: 1m}
`

func fullConfig() config.Config {
	c := config.Default()
	c.DatabaseURL = "postgres://relay:pw@db:5432/app"
	c.Outbox = config.OutboxConfig{
		Table: "app.outbox", LedgerTable: "app.ledger", CheckpointTable: "app.checkpoint",
		ConflictsTable: "app.conflicts", PublishFunction: "app.publish",
	}
	c.Source = config.SourceConfig{
		Mode: config.SourcePoll, Slot: "my_slot", Publication: "my_pub",
		PollInterval: sec(250 * time.Millisecond), BatchSize: 100, SweepAfter: sec(time.Minute),
		LockTimeout: sec(2 * time.Minute), SlotMaxUnconsumed: sec(time.Hour),
		SlotMaxRetained: 512 * config.MiB, NotifyTrigger: true, ReplicationRetry: sec(time.Minute),
		StandbyURL: "postgres://relay:pw@standby:5432/app", StandbyMaxLag: sec(10 * time.Second),
	}
	c.Delivery = config.DeliveryConfig{
		Ordering: config.OrderingNone, InlineAttempts: 0, MaxAttempts: 5,
		Backoff:  []config.Duration{sec(2 * time.Second), sec(time.Minute)},
		MarkDone: config.MarkDoneOff, LaneBlockMax: sec(500 * time.Millisecond), MaxInFlightBytes: 16 * config.MiB,
	}
	hook := config.DefaultSink(config.SinkWebhook)
	hook.Name = "n8n"
	hook.URL = "https://n8n.example.com/webhook/outbox"
	hook.Events = []string{"order.*", "invoice.paid"}
	hook.Webhook = config.WebhookConfig{
		Timeout: sec(3 * time.Second), Concurrency: 2,
		Auth:    config.AuthConfig{Type: config.AuthJWT, Secret: "s3cret"},
		Headers: map[string]string{"X-Tenant": "acme"},
		Body:    config.BodyNudge, OnUnknown: config.OnUnknownHold, MaxBody: 1_000_000,
		PermanentStatuses: []int{400, 422}, Treat409AsDelivered: true,
		Batch: config.BatchConfig{MaxEvents: 100, MaxWait: config.Duration(20 * time.Millisecond), Ordered: true},
	}
	bus := config.DefaultSink(config.SinkNATS)
	bus.Name = "bus"
	bus.URL = "nats://a:4222,nats://b:4222"
	bus.NATS = config.NATSConfig{
		Subject: "events.{{.EventType}}",
		Stream: config.StreamConfig{
			Name: "EVENTS", Subjects: []string{"events.>"}, DuplicateWindow: sec(10 * time.Minute),
			Create: false, MaxMsgSize: 8 * config.MiB,
		},
		MaxPending: 128, CredsFile: "/etc/nats.creds", Token: "tok",
	}
	c.Sinks = []config.SinkConfig{hook, bus}
	c.HTTP.Listen = ":9999"
	c.DataDir = "/var/lib/relay"
	c.ShutdownTimeout = sec(time.Minute)
	c.Log = config.LogConfig{Level: "debug", Format: "json"}
	c.Migrate = config.MigrateConfig{LockTimeout: sec(2 * time.Second), Timeout: sec(time.Minute)}
	return c
}

func TestLoad_FullFile(t *testing.T) {
	c := MustLoad(t, fullFile)
	want := fullConfig()
	assertEqualConfig(t, c, &want)

	tables := c.Tables()
	if got, want := tables.Conflicts, (relay.QualifiedName{Schema: "app", Name: "conflicts"}); got != want {
		t.Errorf("Tables().Conflicts = %+v, want %+v", got, want)
	}
	if tables.PublishFunction.String() != "app.publish" || tables.Publication != "my_pub" {
		t.Errorf("Tables() = %+v", tables)
	}
}

// TestLoad_RoundTrip checks that the printed configuration loads back to
// the same configuration, so `config` output can seed a file.
func TestLoad_RoundTrip(t *testing.T) {
	// Secrets and header values print redacted, so they are left out.
	noSecrets := strings.NewReplacer(
		"database_url: postgres://relay:pw@db:5432/app\n", "",
		"auth: {type: jwt, secret: s3cret}", "auth: {type: none}",
		"headers: {X-Tenant: acme}", "headers: {}",
		"    token: tok\n", "",
		"  standby_url: postgres://relay:pw@standby:5432/app\n", "",
	).Replace(fullFile)
	first := MustLoad(t, noSecrets)
	out, err := first.Redacted()
	if err != nil {
		t.Fatal(err)
	}
	second := MustLoad(t, string(out))
	assertEqualConfig(t, second, first)
	if t.Failed() {
		t.Logf("printed:\n%s", out)
	}
}

// TestLoad_RoundTripFilesAndDollars: a secret read from its *_file key was
// printed as "[redacted]" beside that key, and a value holding "$" or "${X}"
// (written "$$" in the file) was printed as it is, so the printed
// configuration failed to load ("set too"; X not set) or loaded as something
// else (found by FuzzLoad).
func TestLoad_RoundTripFilesAndDollars(t *testing.T) {
	secret := MustWriteFile(t, "secret", "s3cret\n")
	first := MustLoad(t, fmt.Sprintf(`
database_url_file: %[1]s
http: {metrics_token_file: %[1]s}
data_dir: /srv/$$HOME/$${NOT}/$$$$x/$
sinks:
  - name: hook
    type: webhook
    url: http://h/x?sig=$$abc
    auth: {type: jwt, secret_file: %[1]s}
    headers: {} # printed so; no headers would load back as nil
  - name: bus
    type: nats
    url: nats://h:4222
    subject: "out$$.{{.EventType}}"
    token_file: %[1]s
`, secret))
	if first.DataDir != "/srv/$HOME/${NOT}/$$x/$" || first.Sinks[0].Webhook.Auth.Secret.Reveal() != "s3cret" {
		t.Fatalf("loaded data_dir %q, secret %q", first.DataDir, first.Sinks[0].Webhook.Auth.Secret.Reveal())
	}
	out, err := first.Redacted()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "s3cret") || strings.Contains(string(out), "[redacted]") {
		t.Errorf("a secret read from a file is printed, redacted or not:\n%s", out)
	}
	second, err := load(t, string(out))
	if err != nil {
		t.Fatalf("the printed configuration does not load: %v\n%s", err, out)
	}
	assertEqualConfig(t, second, first)
	if t.Failed() {
		t.Logf("printed:\n%s", out)
	}
}

// TestLoad_BinaryValues: YAML writes a string that is not UTF-8 as !!binary
// and base64, which is how Redacted prints such a value from a RELAY_
// variable; Load took the base64 text itself as the value (found by
// FuzzLoad).
func TestLoad_BinaryValues(t *testing.T) {
	c := MustLoad(t, "data_dir: !!binary L3Nydi///g==\nsinks:\n  - {name: a, type: webhook, url: http://h/, headers: {X-Raw: !!binary YWJj}}\n")
	if c.DataDir != "/srv/\xff\xfe" || c.Sinks[0].Webhook.Headers["X-Raw"] != "abc" {
		t.Errorf("data_dir %q, header %q", c.DataDir, c.Sinks[0].Webhook.Headers["X-Raw"])
	}
	_, err := load(t, "data_dir: !!binary 'not base64'\n")
	requireErrorContains(t, err, "relay.yaml:1: data_dir: invalid !!binary value")

	fromEnv := MustLoad(t, "", "RELAY_DATA_DIR=/srv/\xff\xfe")
	out, err := fromEnv.Redacted()
	if err != nil {
		t.Fatal(err)
	}
	if again := MustLoad(t, string(out)); again.DataDir != fromEnv.DataDir {
		t.Errorf("printed as\n%s\nloaded back as %q", out, again.DataDir)
	}
}

func TestLoad_Expansion(t *testing.T) {
	tests := []struct {
		name  string
		yaml  string
		env   []string
		check func(*testing.T, *config.Config)
	}{
		{
			name: "set variable",
			yaml: "database_url: ${DB}\n",
			env:  []string{"DB=postgres://h/db"},
			check: func(t *testing.T, c *config.Config) {
				if got := c.DatabaseURL.Reveal(); got != "postgres://h/db" {
					t.Errorf("database_url = %q", got)
				}
			},
		},
		{
			name:  "default when unset",
			yaml:  "data_dir: ${DIR:-/srv/relay}\n",
			check: wantDataDir("/srv/relay"),
		},
		{
			name:  "default when empty",
			yaml:  "data_dir: ${DIR:-/srv/relay}\n",
			env:   []string{"DIR="},
			check: wantDataDir("/srv/relay"),
		},
		{
			name:  "empty variable without default",
			yaml:  "data_dir: x${EMPTY}y\n",
			env:   []string{"EMPTY="},
			check: wantDataDir("xy"),
		},
		{
			name:  "several references in one value",
			yaml:  "data_dir: /${A}/${B:-b}/${A}\n",
			env:   []string{"A=a"},
			check: wantDataDir("/a/b/a"),
		},
		{
			name:  "dollar escape",
			yaml:  "data_dir: /srv/$$HOME/$${NOT}/${X:-x}\n",
			check: wantDataDir("/srv/$HOME/${NOT}/x"),
		},
		{
			name:  "lone dollar kept",
			yaml:  "data_dir: /srv/$x$\n",
			check: wantDataDir("/srv/$x$"),
		},
		{
			name:  "expanded value is not expanded again",
			yaml:  "data_dir: ${V}\n",
			env:   []string{"V=${W}$$"},
			check: wantDataDir("${W}$$"),
		},
		{
			name:  "expanded value is not YAML",
			yaml:  "data_dir: ${V}\n",
			env:   []string{"V=[a, b]"},
			check: wantDataDir("[a, b]"),
		},
		{
			name:  "quoted value",
			yaml:  "data_dir: \"${V}\"\n",
			env:   []string{"V=123"},
			check: wantDataDir("123"),
		},
		{
			name: "typed after expansion",
			yaml: "source:\n  batch_size: ${N}\n  notify_trigger: ${T}\n",
			env:  []string{"N=42", "T=true"},
			check: func(t *testing.T, c *config.Config) {
				if c.Source.BatchSize != 42 || !c.Source.NotifyTrigger {
					t.Errorf("source = %+v", c.Source)
				}
			},
		},
		{
			name: "empty expansion keeps the default",
			yaml: "source:\n  poll_interval: ${P:-}\n",
			check: func(t *testing.T, c *config.Config) {
				if c.Source.PollInterval != sec(time.Second) {
					t.Errorf("poll_interval = %s", c.Source.PollInterval)
				}
			},
		},
		{
			name: "inside a flow mapping",
			yaml: "sinks:\n  - {name: n8n, type: webhook, url: http://h/w, auth: {type: jwt, secret: ${JWT}}}\n",
			env:  []string{"JWT=a,b}c"},
			check: func(t *testing.T, c *config.Config) {
				if got := c.Sinks[0].Webhook.Auth.Secret.Reveal(); got != "a,b}c" {
					t.Errorf("secret = %q", got)
				}
			},
		},
		{
			name:  "comments are not expanded",
			yaml:  "# set ${UNSET} or ${ first\ndata_dir: d # ${UNSET}\n",
			check: wantDataDir("d"),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.check(t, MustLoad(t, tt.yaml, tt.env...))
		})
	}
}

func wantDataDir(want string) func(*testing.T, *config.Config) {
	return func(t *testing.T, c *config.Config) {
		t.Helper()
		if c.DataDir != want {
			t.Errorf("data_dir = %q, want %q", c.DataDir, want)
		}
	}
}

func TestLoad_ExpansionErrors(t *testing.T) {
	tests := []struct {
		name string
		yaml string
		want []string
	}{
		{
			name: "unset variable",
			yaml: "source:\n  mode: poll\nsinks:\n  - name: n8n\n    type: webhook\n    url: http://h/w\n    auth: {type: jwt, secret: ${N8N_JWT_SECRET}}\n",
			want: []string{"relay.yaml:7: sinks[0].auth.secret: environment variable N8N_JWT_SECRET is not set"},
		},
		{
			name: "every unset variable is reported",
			yaml: "database_url: ${DB}\ndata_dir: ${DIR}\n",
			want: []string{
				"relay.yaml:1: database_url: environment variable DB is not set",
				"relay.yaml:2: data_dir: environment variable DIR is not set",
			},
		},
		{
			name: "unterminated reference",
			yaml: "data_dir: \"${DIR\"\n",
			want: []string{`relay.yaml:1: data_dir: "${" without a closing "}"`},
		},
		{
			name: "invalid name",
			yaml: "data_dir: ${1DIR}\n",
			want: []string{"relay.yaml:1: data_dir: invalid variable reference ${1DIR}"},
		},
		{
			name: "keys are not expanded",
			yaml: "${KEY}: 1\n",
			want: []string{"relay.yaml:1: unknown key ${KEY}"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, tt.yaml, "KEY=data_dir")
			requireErrorContains(t, err, tt.want...)
		})
	}
}

const twoSinks = `
source:
  mode: replication
sinks:
  - name: hook
    type: webhook
    url: http://127.0.0.1:5678/webhook/outbox
  - name: bus
    type: nats
`

func TestLoad_EnvOverrides(t *testing.T) {
	tests := []struct {
		name  string
		yaml  string
		env   []string
		check func(*testing.T, *config.Config)
	}{
		{
			name: "scalar",
			env:  []string{"RELAY_SOURCE_MODE=poll"},
			check: func(t *testing.T, c *config.Config) {
				if c.Source.Mode != config.SourcePoll {
					t.Errorf("mode = %q", c.Source.Mode)
				}
			},
		},
		{
			name: "keys with underscores",
			env: []string{
				"RELAY_SOURCE_POLL_INTERVAL=2s",
				"RELAY_SOURCE_SLOT_MAX_RETAINED=2GiB",
				"RELAY_SINKS_1_STREAM_DUPLICATE_WINDOW=5m",
				"RELAY_SINKS_0_409_MEANS_DELIVERED=true",
				"RELAY_SHUTDOWN_TIMEOUT=1m",
				"RELAY_DELIVERY_MAX_INFLIGHT_BYTES=32MiB",
			},
			check: func(t *testing.T, c *config.Config) {
				if c.Source.PollInterval != sec(2*time.Second) || c.Source.SlotMaxRetained != 2*config.GiB {
					t.Errorf("source = %+v", c.Source)
				}
				if s := c.Sinks[1].NATS.Stream; s.DuplicateWindow != sec(5*time.Minute) || s.Name != "OUTBOX" {
					t.Errorf("stream = %+v, want duplicate_window 5m and the default name", s)
				}
				if !c.Sinks[0].Webhook.Treat409AsDelivered {
					t.Error("409_means_delivered not set")
				}
				if c.ShutdownTimeout != sec(time.Minute) {
					t.Errorf("shutdown_timeout = %s", c.ShutdownTimeout)
				}
				if c.Delivery.MaxInFlightBytes != 32*config.MiB {
					t.Errorf("max_inflight_bytes = %s", c.Delivery.MaxInFlightBytes)
				}
			},
		},
		{
			name:  "flow list",
			env:   []string{"RELAY_DELIVERY_BACKOFF=[1s, 5s]"},
			check: wantBackoff(time.Second, 5*time.Second),
		},
		{
			name:  "comma-separated list",
			env:   []string{"RELAY_DELIVERY_BACKOFF=1s, 5s,10s"},
			check: wantBackoff(time.Second, 5*time.Second, 10*time.Second),
		},
		{
			name:  "list element",
			env:   []string{"RELAY_DELIVERY_BACKOFF_1=7s"},
			check: wantBackoff(time.Second, 7*time.Second, 30*time.Second, 2*time.Minute, 5*time.Minute, 15*time.Minute, 30*time.Minute, time.Hour),
		},
		{
			name:  "list then element",
			env:   []string{"RELAY_DELIVERY_BACKOFF_1=7s", "RELAY_DELIVERY_BACKOFF=1s,2s"},
			check: wantBackoff(time.Second, 7*time.Second),
		},
		{
			name: "glob list",
			env:  []string{"RELAY_SINKS_0_EVENTS=order.*,invoice.*"},
			check: func(t *testing.T, c *config.Config) {
				if got := c.Sinks[0].Events; !reflect.DeepEqual(got, []string{"order.*", "invoice.*"}) {
					t.Errorf("events = %q", got)
				}
			},
		},
		{
			name: "map",
			env:  []string{"RELAY_SINKS_0_HEADERS={X-Api-Key: abc, X-Tenant: acme}"},
			check: func(t *testing.T, c *config.Config) {
				want := map[string]string{"X-Api-Key": "abc", "X-Tenant": "acme"}
				if got := c.Sinks[0].Webhook.Headers; !reflect.DeepEqual(got, want) {
					t.Errorf("headers = %v", got)
				}
			},
		},
		{
			name: "section",
			env:  []string{"RELAY_SINKS_0_AUTH={type: header, header: X-Key, value: v}"},
			check: func(t *testing.T, c *config.Config) {
				a := c.Sinks[0].Webhook.Auth
				if a.Type != config.AuthHeader || a.Header != "X-Key" || a.Value.Reveal() != "v" {
					t.Errorf("auth = %+v", a)
				}
			},
		},
		{
			name: "section replaces the file's",
			env:  []string{"RELAY_SOURCE={poll_interval: 3s}"},
			check: func(t *testing.T, c *config.Config) {
				if c.Source.Mode != config.SourceAuto || c.Source.PollInterval != sec(3*time.Second) {
					t.Errorf("source = %+v, want the default mode and poll_interval 3s", c.Source)
				}
			},
		},
		{
			name: "value taken verbatim",
			env:  []string{"RELAY_DATABASE_URL=postgres://u:p#x,y@h/db?a=b", "RELAY_SINKS_0_AUTH_TYPE=basic", "RELAY_SINKS_0_AUTH_USERNAME=*me", "RELAY_SINKS_0_AUTH_PASSWORD='{x}'"},
			check: func(t *testing.T, c *config.Config) {
				if got := c.DatabaseURL.Reveal(); got != "postgres://u:p#x,y@h/db?a=b" {
					t.Errorf("database_url = %q", got)
				}
				if a := c.Sinks[0].Webhook.Auth; a.Username != "*me" || a.Password.Reveal() != "'{x}'" {
					t.Errorf("auth = %q, %q", a.Username, a.Password.Reveal())
				}
			},
		},
		{
			name: "append a sink",
			env: []string{
				"RELAY_SINKS_2_NAME=extra",
				"RELAY_SINKS_2_TYPE=webhook",
				"RELAY_SINKS_2_URL=https://example.com/hook",
			},
			check: func(t *testing.T, c *config.Config) {
				if len(c.Sinks) != 3 {
					t.Fatalf("%d sinks, want 3", len(c.Sinks))
				}
				want := config.DefaultSink(config.SinkWebhook)
				want.Name, want.URL = "extra", "https://example.com/hook"
				if !reflect.DeepEqual(c.Sinks[2], want) {
					t.Errorf("sinks[2] = %+v\nwant %+v", c.Sinks[2], want)
				}
			},
		},
		{
			name: "append two sinks in index order",
			env: []string{
				"RELAY_SINKS_3_NAME=fourth", "RELAY_SINKS_3_TYPE=nats",
				"RELAY_SINKS_2_NAME=third", "RELAY_SINKS_2_TYPE=nats",
			},
			check: func(t *testing.T, c *config.Config) {
				if len(c.Sinks) != 4 || c.Sinks[2].Name != "third" || c.Sinks[3].Name != "fourth" {
					t.Errorf("sinks = %+v", c.Sinks)
				}
			},
		},
		{
			name: "sinks without a file",
			yaml: "-",
			env: []string{
				"RELAY_SINKS_0_NAME=bus",
				"RELAY_SINKS_0_TYPE=nats",
				"RELAY_SINKS_0_STREAM_NAME=EVENTS",
			},
			check: func(t *testing.T, c *config.Config) {
				if len(c.Sinks) != 1 || c.Sinks[0].NATS.Stream.Name != "EVENTS" || c.Sinks[0].NATS.MaxPending != 4096 {
					t.Errorf("sinks = %+v", c.Sinks)
				}
			},
		},
		{
			name: "empty variable ignored",
			env:  []string{"RELAY_SOURCE_MODE="},
			check: func(t *testing.T, c *config.Config) {
				if c.Source.Mode != config.SourceReplication {
					t.Errorf("mode = %q, want the file's", c.Source.Mode)
				}
			},
		},
		{
			name:  "config path variable and others ignored",
			env:   []string{config.EnvConfigFile + "=/etc/relay.yaml", "HOME=/root", "relay_source_mode=poll"},
			check: func(t *testing.T, c *config.Config) {},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			yaml := tt.yaml
			switch yaml {
			case "":
				yaml = twoSinks
			case "-":
				yaml = ""
			}
			tt.check(t, MustLoad(t, yaml, tt.env...))
		})
	}
}

func wantBackoff(want ...time.Duration) func(*testing.T, *config.Config) {
	return func(t *testing.T, c *config.Config) {
		t.Helper()
		var got []time.Duration
		for _, d := range c.Delivery.Backoff {
			got = append(got, time.Duration(d))
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("backoff = %v, want %v", got, want)
		}
	}
}

func TestLoad_EnvOverrideErrors(t *testing.T) {
	tests := []struct {
		name string
		env  []string
		want []string
	}{
		{
			name: "non-contiguous index",
			env:  []string{"RELAY_SINKS_3_NAME=x"},
			want: []string{"RELAY_SINKS_3_NAME: sinks[3]: index 3 skips sinks[2]"},
		},
		{
			name: "unknown variable",
			env:  []string{"RELAY_SOURCE_POL_INTERVAL=1s", "RELAY_SINKS_0_HEADERS_X_KEY=1", "RELAY_SINKS_00_NAME=x", "RELAY_SINKS_99999999999999999999_NAME=x"},
			want: []string{
				"RELAY_SINKS_99999999999999999999_NAME: names no configuration key",
				"RELAY_SOURCE_POL_INTERVAL: names no configuration key",
				"RELAY_SINKS_0_HEADERS_X_KEY: names no configuration key",
				"RELAY_SINKS_00_NAME: names no configuration key",
			},
		},
		{
			name: "invalid value",
			env:  []string{"RELAY_SOURCE_MODE=bogus", "RELAY_SOURCE_BATCH_SIZE=many"},
			want: []string{
				`RELAY_SOURCE_MODE: source.mode: "bogus" is not one of auto, replication, poll`,
				`RELAY_SOURCE_BATCH_SIZE: source.batch_size: expected an integer, got "many"`,
			},
		},
		{
			name: "invalid YAML",
			env:  []string{"RELAY_SINKS_0_HEADERS={a"},
			want: []string{"RELAY_SINKS_0_HEADERS: sinks[0].headers: invalid YAML value"},
		},
		{
			name: "unknown key in a YAML value",
			env:  []string{"RELAY_SOURCE={pol_interval: 1s}"},
			want: []string{"RELAY_SOURCE: unknown key source.pol_interval (did you mean source.poll_interval?)"},
		},
		{
			name: "appended sink incomplete",
			env:  []string{"RELAY_SINKS_2_NAME=extra"},
			want: []string{"RELAY_SINKS_2_NAME: sinks[2].type: is required"},
		},
		{
			name: "secret and its file in the same layer",
			env:  []string{"RELAY_SINKS_0_AUTH_PASSWORD=x", "RELAY_SINKS_0_AUTH_PASSWORD_FILE=/p", "RELAY_SINKS_0_AUTH_TYPE=basic", "RELAY_SINKS_0_AUTH_USERNAME=u"},
			want: []string{"RELAY_SINKS_0_AUTH_PASSWORD_FILE: sinks[0].auth.password_file: sinks[0].auth.password is set too"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, twoSinks, tt.env...)
			requireErrorContains(t, err, tt.want...)
		})
	}
}

func TestLoad_Precedence(t *testing.T) {
	secretFile := MustWriteFile(t, "db", "postgres://from-file-secret\n")
	tests := []struct {
		name      string
		yaml      string
		env       []string
		overrides map[string]string
		wantPoll  time.Duration
		wantDB    string
	}{
		{name: "defaults", wantPoll: time.Second, wantDB: ""},
		{
			name:     "DATABASE_URL fallback",
			env:      []string{"DATABASE_URL=postgres://fallback"},
			wantPoll: time.Second, wantDB: "postgres://fallback",
		},
		{
			name:     "file",
			yaml:     "database_url: postgres://file\nsource: {poll_interval: 2s}\n",
			env:      []string{"DATABASE_URL=postgres://fallback"},
			wantPoll: 2 * time.Second, wantDB: "postgres://file",
		},
		{
			name:     "file by expansion",
			yaml:     "database_url: ${DATABASE_URL}\n",
			env:      []string{"DATABASE_URL=postgres://fallback"},
			wantPoll: time.Second, wantDB: "postgres://fallback",
		},
		{
			name:     "environment over file",
			yaml:     "database_url: postgres://file\nsource: {poll_interval: 2s}\n",
			env:      []string{"RELAY_DATABASE_URL=postgres://env", "RELAY_SOURCE_POLL_INTERVAL=3s"},
			wantPoll: 3 * time.Second, wantDB: "postgres://env",
		},
		{
			name:      "override over environment",
			yaml:      "database_url: postgres://file\nsource: {poll_interval: 2s}\n",
			env:       []string{"RELAY_DATABASE_URL=postgres://env", "RELAY_SOURCE_POLL_INTERVAL=3s"},
			overrides: map[string]string{"database_url": "postgres://flag", "source.poll_interval": "4s"},
			wantPoll:  4 * time.Second, wantDB: "postgres://flag",
		},
		{
			name:     "environment value over file's secret file",
			yaml:     "database_url_file: " + secretFile + "\n",
			env:      []string{"RELAY_DATABASE_URL=postgres://env"},
			wantPoll: time.Second, wantDB: "postgres://env",
		},
		{
			name:      "override over file's secret file",
			yaml:      "database_url_file: " + secretFile + "\n",
			overrides: map[string]string{"database_url": "postgres://flag"},
			wantPoll:  time.Second, wantDB: "postgres://flag",
		},
		{
			name:     "secret file over DATABASE_URL",
			yaml:     "database_url_file: " + secretFile + "\n",
			env:      []string{"DATABASE_URL=postgres://fallback"},
			wantPoll: time.Second, wantDB: "postgres://from-file-secret",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := config.Options{Environ: append([]string{}, tt.env...), Overrides: tt.overrides}
			if tt.yaml != "" {
				opts.Path = MustWriteFile(t, "relay.yaml", tt.yaml)
			}
			c, err := config.Load(opts)
			if err != nil {
				t.Fatal(err)
			}
			if got := time.Duration(c.Source.PollInterval); got != tt.wantPoll {
				t.Errorf("poll_interval = %s, want %s", got, tt.wantPoll)
			}
			if got := c.DatabaseURL.Reveal(); got != tt.wantDB {
				t.Errorf("database_url = %q, want %q", got, tt.wantDB)
			}
		})
	}
}

func TestLoad_Overrides(t *testing.T) {
	c, err := config.Load(config.Options{
		Path:    MustWriteFile(t, "relay.yaml", twoSinks),
		Environ: []string{},
		Overrides: map[string]string{
			"sinks[0].url":        "https://flag.example.com/",
			"sinks.1.max_pending": "9",
			"delivery.backoff":    "[3s]",
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if c.Sinks[0].URL != "https://flag.example.com/" || c.Sinks[1].NATS.MaxPending != 9 || len(c.Delivery.Backoff) != 1 {
		t.Errorf("overrides not applied: %+v", c)
	}

	_, err = config.Load(config.Options{
		Environ:   []string{},
		Overrides: map[string]string{"sourc.mode": "poll", "source.mode": "x"},
	})
	requireErrorContains(t, err,
		"command line: unknown key sourc.mode",
		`command line: source.mode: "x" is not one of`)
}

func TestLoad_InvalidValues(t *testing.T) {
	const hook = "sinks:\n  - name: hook\n    type: webhook\n    url: http://h/w\n"
	const bus = "sinks:\n  - name: bus\n    type: nats\n"
	tests := []struct {
		name string
		yaml string
		env  []string
		want []string
	}{
		{"bad enum", "source:\n  mode: pol\n", nil,
			[]string{`relay.yaml:2: source.mode: "pol" is not one of auto, replication, poll`}},
		{"bad enum in list element", hook + "    body: json\n    on_unknown: drop\n", nil, []string{
			`relay.yaml:5: sinks[0].body: "json" is not one of envelope, nudge`,
			`relay.yaml:6: sinks[0].on_unknown: "drop" is not one of retry, hold`,
		}},
		{"bad log settings", "log: {level: verbose, format: text}\n", nil, []string{
			`relay.yaml:1: log.level: "verbose" is not one of trace, debug, info, warn, error`,
			`relay.yaml:1: log.format: "text" is not one of json, console, auto`,
		}},
		{"bad delivery enums", "delivery:\n  ordering: total\n  mark_done: sync\n", nil, []string{
			`relay.yaml:2: delivery.ordering: "total" is not one of aggregate, none`,
			`relay.yaml:3: delivery.mark_done: "sync" is not one of async, off`,
		}},
		{"bad duration", "source:\n  poll_interval: 5\n  sweep_after: soon\n", nil, []string{
			`relay.yaml:2: source.poll_interval: invalid duration "5"`,
			`relay.yaml:3: source.sweep_after: invalid duration "soon"`,
		}},
		{"zero duration", "source:\n  poll_interval: 0s\nmigrate:\n  lock_timeout: 0s\n  timeout: -1s\nshutdown_timeout: 0s\n", nil, []string{
			"relay.yaml:2: source.poll_interval: must be greater than zero, got 0s",
			"relay.yaml:4: migrate.lock_timeout: must be greater than zero",
			"relay.yaml:5: migrate.timeout: must be greater than zero, got -1s",
			"relay.yaml:6: shutdown_timeout: must be greater than zero",
		}},
		{"out of range integers", "source:\n  batch_size: 0\ndelivery:\n  inline_attempts: -1\n  max_attempts: 0\n", nil, []string{
			"relay.yaml:2: source.batch_size: must be at least 1, got 0",
			"relay.yaml:4: delivery.inline_attempts: must be at least 0, got -1",
			"relay.yaml:5: delivery.max_attempts: must be at least 1, got 0",
		}},
		{"wrong type", "source:\n  batch_size: many\n  notify_trigger: maybe\n  mode: [poll]\nsinks: {name: x}\n", nil, []string{
			`relay.yaml:2: source.batch_size: expected an integer, got "many"`,
			`relay.yaml:3: source.notify_trigger: expected true or false, got "maybe"`,
			"relay.yaml:4: source.mode: expected a single value, got a list",
			"relay.yaml:5: sinks: expected a list, got a mapping",
		}},
		{"backoff", "delivery:\n  backoff: []\n", nil, []string{"relay.yaml:2: delivery.backoff: must list at least one duration"}},
		{"backoff element", "delivery:\n  backoff:\n    - 1s\n    - 0s\n", nil, []string{"relay.yaml:4: delivery.backoff[1]: must be greater than zero"}},
		{"bad size", "source:\n  slot_max_retained: 1XB\n", nil, []string{`relay.yaml:2: source.slot_max_retained: invalid size "1XB": unknown unit "XB"`}},
		{"zero size", "source:\n  slot_max_retained: 0\n", nil, []string{"relay.yaml:2: source.slot_max_retained: must be greater than zero"}},
		{"negative size", hook + "    max_body: -1MiB\n", nil, []string{`relay.yaml:5: sinks[0].max_body: invalid size "-1MiB"`}},
		{"in-flight bytes below the least", "delivery:\n  max_inflight_bytes: 64KiB\n", nil, []string{
			"relay.yaml:2: delivery.max_inflight_bytes: must be at least 1MiB (the bytes of the events in flight; an event larger than it is delivered alone), got 64KiB",
		}},
		{"in-flight bytes from the environment", "", []string{"RELAY_DELIVERY_MAX_INFLIGHT_BYTES=0"}, []string{
			"RELAY_DELIVERY_MAX_INFLIGHT_BYTES: delivery.max_inflight_bytes: must be at least 1MiB",
		}},
		{"batch out of range", hook + "    batch: {max_events: 1001, max_wait: 0s}\n", nil, []string{
			"relay.yaml:5: sinks[0].batch.max_events: must be between 0 (off) and 1000, got 1001",
			"relay.yaml:5: sinks[0].batch.max_wait: must be greater than zero, got 0s",
		}},
		{"ordered without batching", hook + "    batch: {ordered: true}\n", nil, []string{
			"relay.yaml:5: sinks[0].batch.ordered: needs max_events",
		}},
		{"batch with cloudevents", hook + "    format: cloudevents\n    batch:\n      max_events: 50\n", nil, []string{
			"relay.yaml:7: sinks[0].batch.max_events: batching cannot be combined with format: cloudevents",
		}},
		{"batch on a nats sink", bus + "    batch: {max_events: 10}\n", nil, []string{
			"relay.yaml:4: sinks[0].batch: is not valid for a nats sink",
		}},
		{"bad identifiers", "outbox:\n  table: a.b.c\n  ledger_table: \"\"\n  publish_function: \"x\\ty\"\nsource:\n  publication: \"\"\n", nil, []string{
			`relay.yaml:2: outbox.table: "a.b.c": at most one dot`,
			"relay.yaml:3: outbox.ledger_table: empty identifier",
			"relay.yaml:4: outbox.publish_function:",
			"relay.yaml:6: source.publication: empty identifier",
		}},
		{"same table twice", "outbox:\n  table: app.t\n  ledger_table: app.t\n", nil, []string{
			`relay.yaml:3: outbox.ledger_table: "app.t" is also outbox.table`,
		}},
		{"derived conflicts table too long", "outbox:\n  table: " + strings.Repeat("t", 60) + "\n", nil, []string{
			"outbox.conflicts_table: \"" + strings.Repeat("t", 60) + "_conflicts\" is longer than 63 bytes",
		}},
		{"bad slot name", "source:\n  slot: Outbox-Relay\n", nil, []string{`relay.yaml:2: source.slot: slot name "Outbox-Relay" may contain only`}},
		{"bad listen", "http:\n  listen: localhost\n", nil, []string{`relay.yaml:2: http.listen: "localhost" is not host:port`}},
		{"bad port", "http:\n  listen: \":99999\"\n", nil, []string{`relay.yaml:2: http.listen: ":99999" is not host:port`}},
		{"sink name longer than the ledger's action holds", "sinks:\n  - {name: " + strings.Repeat("n", relay.MaxSinkNameBytes+1) + ", type: nats}\n", nil, []string{
			fmt.Sprintf(`relay.yaml:2: sinks[0].name: is %d bytes; the ledger's action holds at most %d`, relay.MaxSinkNameBytes+1, relay.MaxSinkNameBytes),
		}},
		{"admin tokens", "http:\n  admin_token: short\n  admin_read_token: \"has a space in it\"\n", nil, []string{
			"relay.yaml:2: http.admin_token: must be at least 16 characters",
			"relay.yaml:3: http.admin_read_token: must be printable, without spaces",
		}},
		{"admin tokens shared", "http:\n  metrics_token: 0123456789abcdef\n  admin_token: 0123456789abcdef\n  admin_read_token: 0123456789abcdef\n", nil, []string{
			"relay.yaml:3: http.admin_token: must differ from http.metrics_token",
			"relay.yaml:4: http.admin_read_token: must differ from http.metrics_token",
			"relay.yaml:4: http.admin_read_token: must differ from http.admin_token",
		}},
		{"read token alone", "http:\n  admin_read_token: 0123456789abcdef\n", nil, []string{
			"relay.yaml:2: http.admin_read_token: needs http.admin_token",
		}},
		{"duplicate sink names", "sinks:\n  - {name: a, type: nats}\n  - {name: a, type: nats}\n", nil, []string{
			`relay.yaml:3: sinks[1].name: "a" is already the name of sinks[0]`,
		}},
		{"missing sink name, type and url", "sinks:\n  - type: webhook\n  - name: b\n", nil, []string{
			"relay.yaml:2: sinks[0].name: is required",
			"relay.yaml:2: sinks[0].url: is required for a webhook sink",
			"relay.yaml:3: sinks[1].type: is required",
		}},
		{"bad sink type", "sinks:\n  - name: a\n    type: kafka\n", nil, []string{`relay.yaml:3: sinks[0].type: "kafka" is not one of webhook, nats`}},
		{"bad webhook url", "sinks:\n  - name: a\n    type: webhook\n    url: ftp://u:hunter2@h/x\n", nil, []string{
			"relay.yaml:4: sinks[0].url: ftp://u:xxxxx@h/x is not an absolute http:// or https:// URL",
		}},
		{"relative webhook url", "sinks:\n  - name: a\n    type: webhook\n    url: /hook\n", nil, []string{"relay.yaml:4: sinks[0].url:"}},
		{"bad nats url", bus + "    url: nats://a:4222, http://b\n", nil, []string{"relay.yaml:4: sinks[0].url: http://b is not a nats://"}},
		{"field of the other sink type", hook + "    subject: x\n    stream: {name: S}\n" + "  - name: bus\n    type: nats\n    timeout: 1s\n    headers: {}\n", nil, []string{
			"relay.yaml:5: sinks[0].subject: is not valid for a webhook sink",
			"relay.yaml:6: sinks[0].stream: is not valid for a webhook sink",
			"relay.yaml:9: sinks[1].timeout: is not valid for a nats sink",
			"relay.yaml:10: sinks[1].headers: is not valid for a nats sink",
		}},
		{"field of the other sink type from the environment", twoSinks, []string{"RELAY_SINKS_0_MAX_PENDING=3"}, []string{
			"RELAY_SINKS_0_MAX_PENDING: sinks[0].max_pending: is not valid for a webhook sink",
		}},
		{"bad template", bus + "    subject: \"outbox.{{.EventType\"\n", nil, []string{"relay.yaml:4: sinks[0].subject: invalid template"}},
		{"empty subject", bus + "    subject: \"\"\n", nil, []string{"relay.yaml:4: sinks[0].subject: must not be empty"}},
		{"bad stream", bus + "    stream: {name: a.b, subjects: [], duplicate_window: 0s}\n    max_pending: 0\n", nil, []string{
			`relay.yaml:4: sinks[0].stream.name: "a.b" may not contain`,
			"relay.yaml:4: sinks[0].stream.subjects: must list at least one subject",
			"relay.yaml:4: sinks[0].stream.duplicate_window: must be greater than zero",
			"relay.yaml:5: sinks[0].max_pending: must be at least 1",
		}},
		{"bad msg_id_prefix", bus + "    msg_id_prefix: \"shop:eu\"\n", nil, []string{
			`relay.yaml:4: sinks[0].msg_id_prefix: the deployment id "shop:eu" may hold only ASCII letters, digits, '-' and '_'`,
		}},
		{"bad glob", hook + "    events: [\"order.*\", \"[a-\", \"\"]\n", nil, []string{
			`relay.yaml:5: sinks[0].events[1]: "[a-" is not a valid pattern`,
			`relay.yaml:5: sinks[0].events[2]: "" is not a valid pattern`,
		}},
		{"no events", hook + "    events: []\n", nil, []string{"relay.yaml:5: sinks[0].events: must list at least one pattern"}},
		{"rate limit", hook + "    rate_limit: {per_second: 0, burst: 5}\n" + bus[len("sinks:\n"):] + "    rate_limit:\n      per_second: -3\n      burst: 5\n", nil, []string{
			"relay.yaml:5: sinks[0].rate_limit.per_second: must be greater than zero (events per second), got 0",
			"relay.yaml:9: sinks[1].rate_limit.per_second: must be greater than zero (events per second), got -3",
		}},
		{"rate limit without a burst", hook + "    rate_limit: {per_second: 200}\n", nil, []string{
			"relay.yaml:5: sinks[0].rate_limit.burst: must be at least 1, got 0",
		}},
		{"rate limit not a number", hook + "    rate_limit: {per_second: fast, burst: 10}\n", nil, []string{
			`relay.yaml:5: sinks[0].rate_limit.per_second: expected a number, got "fast"`,
		}},
		{"webhook limits", hook + "    timeout: 0s\n    concurrency: 0\n    permanent_statuses: [422, 200, 401]\n", nil, []string{
			"relay.yaml:5: sinks[0].timeout: must be greater than zero",
			"relay.yaml:6: sinks[0].concurrency: must be at least 1",
			"relay.yaml:7: sinks[0].permanent_statuses[1]: 200 is not an HTTP error status",
			"relay.yaml:7: sinks[0].permanent_statuses[2]: 401 means the sink's credentials are wrong",
		}},
		{"bad headers", hook + "    headers: {\"Bad Header\": x, X-Ok: \"a\\nb\"}\n", nil, []string{
			`relay.yaml:5: sinks[0].headers: "Bad Header" is not a valid header name`,
			"relay.yaml:5: sinks[0].headers.X-Ok: must not contain line breaks",
		}},
		{"missing auth secret", hook + "    auth: {type: jwt}\n", nil, []string{
			"relay.yaml:5: sinks[0].auth.secret: is required for auth type jwt",
		}},
		{"missing standard-webhooks secret", hook + "    auth:\n      type: standard-webhooks\n", nil, []string{
			"relay.yaml:6: sinks[0].auth.secret: is required for auth type standard-webhooks",
		}},
		{"bad whsec secret", hook + "    auth: {type: standard-webhooks, secret: whsec_!!!}\n", nil, []string{
			"relay.yaml:5: sinks[0].auth.secret: a whsec_ secret must be base64",
		}},
		{"missing header auth fields", hook + "    auth: {type: header}\n", nil, []string{
			"relay.yaml:5: sinks[0].auth.header: is required for auth type header",
			"relay.yaml:5: sinks[0].auth.value: is required for auth type header",
		}},
		{"missing basic auth fields", hook + "    auth: {type: basic, username: \"a:b\"}\n", nil, []string{
			"relay.yaml:5: sinks[0].auth.username: must not contain a colon",
			"relay.yaml:5: sinks[0].auth.password: is required for auth type basic",
		}},
		{"auth field of another auth type", hook + "    auth: {type: jwt, secret: s, username: u}\n", nil, []string{
			"relay.yaml:5: sinks[0].auth.username: is not used by auth type jwt",
		}},
		{"bad auth type", hook + "    auth: {type: oauth}\n", nil, []string{
			`relay.yaml:5: sinks[0].auth.type: "oauth" is not one of none, jwt, header, basic, standard-webhooks`,
		}},
		{"secret and secret_file", hook + "    auth:\n      type: jwt\n      secret: s\n      secret_file: /run/secrets/jwt\n", nil, []string{
			"relay.yaml:8: sinks[0].auth.secret_file: sinks[0].auth.secret is set too; set only one of them",
		}},
		{"bad format", hook + "    format: xml\n", nil, []string{`relay.yaml:5: sinks[0].format: "xml" is not one of envelope, cloudevents`}},
		{"cloudevents source without the format", bus + "    cloudevents: {source: /shop}\n", nil, []string{
			"relay.yaml:4: sinks[0].cloudevents.source: is only used with format: cloudevents",
		}},
		{"bad cloudevents source", bus + "    format: cloudevents\n    cloudevents: {source: \"%zz\"}\n", nil, []string{
			`relay.yaml:5: sinks[0].cloudevents.source: "%zz" is not a URI-reference`,
		}},
		{"cloudevents and nudge", hook + "    format: cloudevents\n    body: nudge\n", nil, []string{
			"relay.yaml:6: sinks[0].body: nudge cannot be combined with format: cloudevents",
		}},
		{"duplicate key", "source:\n  mode: poll\n  mode: auto\n", nil, []string{"relay.yaml:3: source.mode: set twice (first at line 2)"}},
		{"top level not a mapping", "- a\n", nil, []string{"relay.yaml:1: the top level must be a mapping"}},
		{"syntax error", "source: [\n", nil, []string{"relay.yaml: yaml:"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, tt.yaml, tt.env...)
			requireErrorContains(t, err, tt.want...)
		})
	}
}

func TestLoad_UnknownKeys(t *testing.T) {
	tests := []struct {
		name string
		yaml string
		want string
	}{
		{"top level", "data_dir: d\nsink:\n  - name: a\n", "relay.yaml:2: unknown key sink (did you mean sinks?)"},
		{"nested", "source:\n  mode: poll\n  pol_interval: 1s\n", "relay.yaml:3: unknown key source.pol_interval (did you mean source.poll_interval?)"},
		{"case", "source:\n  Mode: poll\n", "relay.yaml:2: unknown key source.Mode (did you mean source.mode?)"},
		{"in a sink", "sinks:\n  - name: a\n    type: webhook\n    url: http://h/\n    tiemout: 1s\n", "relay.yaml:5: unknown key sinks[0].tiemout (did you mean sinks[0].timeout?)"},
		{"deep in a sink", "sinks:\n  - name: a\n    type: nats\n    stream:\n      duplicate_windows: 1m\n", "relay.yaml:5: unknown key sinks[0].stream.duplicate_windows (did you mean sinks[0].stream.duplicate_window?)"},
		{"no close match", "source:\n  colour: blue\n", "relay.yaml:2: unknown key source.colour"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, tt.yaml)
			requireErrorContains(t, err, tt.want)
			if strings.HasSuffix(tt.want, "colour") && strings.Contains(err.Error(), "did you mean") {
				t.Errorf("suggested a key for a distant name: %v", err)
			}
		})
	}
}

func TestLoad_CollectsAllErrors(t *testing.T) {
	_, err := load(t, "source:\n  mode: pol\n  pol_interval: 1s\nlog:\n  level: loud\n", "RELAY_NOPE=1")
	requireErrorContains(t, err,
		"relay.yaml:2: source.mode:",
		"relay.yaml:3: unknown key source.pol_interval",
		"relay.yaml:5: log.level:",
		"RELAY_NOPE: names no configuration key",
	)
	if n := len(err.(interface{ Unwrap() []error }).Unwrap()); n != 4 {
		t.Errorf("%d errors, want 4:\n%v", n, err)
	}
}

func TestLoad_SecretFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	yaml := fmt.Sprintf(`
database_url_file: %s
sinks:
  - name: jwt
    type: webhook
    url: http://h/jwt
    auth: {type: jwt, secret_file: %s}
  - name: header
    type: webhook
    url: http://h/header
    auth: {type: header, header: X-Key, value_file: %s}
  - name: basic
    type: webhook
    url: http://h/basic
    auth: {type: basic, username: u, password_file: %s}
  - name: bus
    type: nats
    url: nats://h:4222
    token_file: %s
`,
		write("db", "postgres://u:p@h/db\n"),
		write("jwt", "jwt-secret\r\n"),
		write("value", "value\n\n"),
		write("password", "pass word"),
		write("token", "tok\n"),
	)
	c := MustLoad(t, yaml)
	for name, tt := range map[string]struct {
		got  config.Secret
		want string
	}{
		"database_url": {c.DatabaseURL, "postgres://u:p@h/db"},
		"secret":       {c.Sinks[0].Webhook.Auth.Secret, "jwt-secret"},
		"value":        {c.Sinks[1].Webhook.Auth.Value, "value\n"},
		"password":     {c.Sinks[2].Webhook.Auth.Password, "pass word"},
		"token":        {c.Sinks[3].NATS.Token, "tok"},
	} {
		if tt.got.Reveal() != tt.want {
			t.Errorf("%s = %q, want %q", name, tt.got.Reveal(), tt.want)
		}
	}
	if c.Sinks[0].Webhook.Auth.SecretFile == "" {
		t.Error("secret_file was cleared")
	}

	missing := filepath.Join(dir, "missing")
	_, err := load(t, "sinks:\n  - name: a\n    type: webhook\n    url: http://h/\n    auth: {type: jwt, secret_file: "+missing+"}\n")
	requireErrorContains(t, err, "relay.yaml:5: sinks[0].auth.secret_file: read secret: open "+missing)

	_, err = load(t, "database_url: postgres://x\ndatabase_url_file: "+missing+"\n")
	requireErrorContains(t, err, "relay.yaml:2: database_url_file: database_url is set too")
}

func TestSecret_Redaction(t *testing.T) {
	s := config.Secret("hunter2")
	for _, format := range []string{"%v", "%s", "%q", "%+v", "%#v"} {
		if got := fmt.Sprintf(format, s); strings.Contains(got, "hunter2") || !strings.Contains(got, "[redacted]") {
			t.Errorf("Sprintf(%q) = %s", format, got)
		}
	}
	if got := config.Secret("").String(); got != "" {
		t.Errorf("empty Secret prints %q", got)
	}
	if b, _ := json.Marshal(struct{ S config.Secret }{s}); string(b) != `{"S":"[redacted]"}` {
		t.Errorf("json = %s", b)
	}
	if s.Reveal() != "hunter2" {
		t.Error("Reveal lost the value")
	}

	c := MustLoad(t, strings.Replace(fullFile, "http:\n", `  - name: basic
    type: webhook
    url: https://user:urlpass@example.com/hook
    auth: {type: basic, username: u, password: basicpass}
    headers: {X-Api-Key: headerkey}
  - name: tokenbus
    type: nats
    url: nats://natstoken@h:4222
http:
`, 1))
	secrets := []string{"pw@db", "s3cret", "tok\n", "urlpass", "basicpass", "headerkey", "natstoken"}
	if got := fmt.Sprintf("%v %+v", c.DatabaseURL, c.Sinks[0].Webhook.Auth); strings.Contains(got, "s3cret") || strings.Contains(got, "pw@db") {
		t.Errorf("fmt printed a secret: %s", got)
	}
	out, err := c.Redacted()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range secrets {
		if strings.Contains(string(out), s) {
			t.Errorf("Redacted() contains %q:\n%s", s, out)
		}
	}
	for _, want := range []string{
		"database_url: postgres://relay:xxxxx@db:5432/app\n",
		"standby_url: postgres://relay:xxxxx@standby:5432/app\n",
		"secret: '[redacted]'",
		"X-Api-Key: '[redacted]'",
		"url: https://user:xxxxx@example.com/hook",
		"url: nats://xxxxx@h:4222",
		"url: nats://a:4222,nats://b:4222",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("Redacted() lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "subject: \"\"") || strings.Contains(string(out), "max_pending: 0") {
		t.Errorf("Redacted() prints NATS settings for a webhook sink:\n%s", out)
	}
}

func TestLoad_SinkDefaultsPerElement(t *testing.T) {
	c := MustLoad(t, `
sinks:
  - name: a
    type: webhook
    url: http://h/a
  - name: b
    type: webhook
    url: http://h/b
    timeout: 1s
  - name: bus
    type: nats
    stream:
      name: EVENTS
`)
	a := config.DefaultSink(config.SinkWebhook)
	a.Name, a.URL = "a", "http://h/a"
	if !reflect.DeepEqual(c.Sinks[0], a) {
		t.Errorf("sinks[0] = %+v\nwant %+v", c.Sinks[0], a)
	}
	if b := c.Sinks[1].Webhook; b.Timeout != sec(time.Second) || b.Concurrency != 8 || b.MaxBody != 16*config.MiB {
		t.Errorf("sinks[1] = %+v", b)
	}
	bus := config.DefaultSink(config.SinkNATS)
	bus.Name = "bus"
	bus.NATS.Stream.Name = "EVENTS"
	if !reflect.DeepEqual(c.Sinks[2], bus) {
		t.Errorf("sinks[2] = %+v\nwant %+v", c.Sinks[2], bus)
	}
}

func TestLoad_AnchorsAndMerge(t *testing.T) {
	c := MustLoad(t, `
sinks:
  - &hook
    name: a
    type: webhook
    url: http://h/a
    timeout: 3s
  - <<: *hook
    name: b
    url: http://h/b
`, "RELAY_SINKS_1_TIMEOUT=4s")
	if got := c.Sinks[0]; got.Name != "a" || got.Webhook.Timeout != sec(3*time.Second) {
		t.Errorf("sinks[0] = %+v", got)
	}
	if got := c.Sinks[1]; got.Name != "b" || got.URL != "http://h/b" || got.Type != config.SinkWebhook || got.Webhook.Timeout != sec(4*time.Second) {
		t.Errorf("sinks[1] = %+v", got)
	}
}

func TestTables_SchemaQualified(t *testing.T) {
	c := MustLoad(t, "outbox:\n  table: app.outbox\n  ledger_table: ledger\n")
	tables := c.Tables()
	if want := (relay.QualifiedName{Schema: "app", Name: "outbox_conflicts"}); tables.Conflicts != want {
		t.Errorf("Conflicts = %+v, want %+v", tables.Conflicts, want)
	}
	if c.Outbox.ConflictsTable != "app.outbox_conflicts" {
		t.Errorf("conflicts_table = %q, want it filled in", c.Outbox.ConflictsTable)
	}
	if want := (relay.QualifiedName{Name: "ledger"}); tables.Ledger != want {
		t.Errorf("Ledger = %+v", tables.Ledger)
	}
}

func TestDuration(t *testing.T) {
	tests := []struct {
		in      string
		want    time.Duration
		wantErr bool
		text    string
	}{
		{in: "1s", want: time.Second, text: "1s"},
		{in: "5m", want: 5 * time.Minute, text: "5m"},
		{in: "1h", want: time.Hour, text: "1h"},
		{in: "1h30m", want: 90 * time.Minute, text: "1h30m"},
		{in: "250ms", want: 250 * time.Millisecond, text: "250ms"},
		{in: "0", want: 0, text: "0s"},
		{in: "30", wantErr: true},
		{in: "soon", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			var d config.Duration
			err := d.UnmarshalText([]byte(tt.in))
			if (err != nil) != tt.wantErr {
				t.Fatalf("UnmarshalText(%q) error = %v, want error %t", tt.in, err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if time.Duration(d) != tt.want || d.String() != tt.text {
				t.Errorf("UnmarshalText(%q) = %s (%v), want %s (%v)", tt.in, d, time.Duration(d), tt.text, tt.want)
			}
		})
	}
}

func TestByteSize(t *testing.T) {
	tests := []struct {
		in      string
		want    config.ByteSize
		wantErr bool
		text    string
	}{
		{in: "16MiB", want: 16 << 20, text: "16MiB"},
		{in: "1GiB", want: 1 << 30, text: "1GiB"},
		{in: "512KiB", want: 512 << 10, text: "512KiB"},
		{in: "1MB", want: 1_000_000, text: "1MB"},
		{in: "16 mib", want: 16 << 20, text: "16MiB"},
		{in: "1500", want: 1500, text: "1500B"},
		{in: "1024", want: 1024, text: "1KiB"},
		{in: "0", want: 0, text: "0"},
		{in: "1.5GiB", wantErr: true},
		{in: "-1", wantErr: true},
		{in: "MiB", wantErr: true},
		{in: "1XB", wantErr: true},
		{in: "9999999TiB", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			var b config.ByteSize
			err := b.UnmarshalText([]byte(tt.in))
			if (err != nil) != tt.wantErr {
				t.Fatalf("UnmarshalText(%q) error = %v, want error %t", tt.in, err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if b != tt.want || b.String() != tt.text {
				t.Errorf("UnmarshalText(%q) = %d (%s), want %d (%s)", tt.in, b, b, tt.want, tt.text)
			}
		})
	}
}

func TestSinkConfig_CloudEventsSource(t *testing.T) {
	outbox := relay.QualifiedName{Schema: "public", Name: "integration_outbox"}
	s := config.DefaultSink(config.SinkNATS)
	if got := s.CloudEventsSource("shop", outbox); got != "/shop/public/integration_outbox" {
		t.Errorf("default source %q", got)
	}
	if got := s.CloudEventsSource("my shop", relay.QualifiedName{Schema: "a/b", Name: "out box"}); got != "/my%20shop/a%2Fb/out%20box" {
		t.Errorf("default source of awkward names %q", got)
	}
	s.CloudEvents.Source = "urn:shop:orders"
	if got := s.CloudEventsSource("shop", outbox); got != "urn:shop:orders" {
		t.Errorf("configured source %q", got)
	}
}

// TestLoad_RemovedMarkDoneStillLoads: delivery.mark_done loads with either
// value it had; run warns about off, which it no longer honours
// (docs/configuration.md, "Removed keys"), and another value is still an
// error naming the key.
func TestLoad_RemovedMarkDoneStillLoads(t *testing.T) {
	for _, v := range []config.MarkDone{config.MarkDoneAsync, config.MarkDoneOff} {
		cfg, err := load(t, "delivery:\n  mark_done: "+string(v)+"\n")
		if err != nil {
			t.Fatalf("mark_done: %s: %v", v, err)
		}
		if cfg.Delivery.MarkDone != v {
			t.Errorf("MarkDone = %q, want %q (run reads it to warn)", cfg.Delivery.MarkDone, v)
		}
	}
}

// TestLoad_RemovedCPUSchedulingStillLoads: a configuration written for a
// version that had cpu_scheduling loads, whatever its value; run warns
// that the key is no longer used (docs/configuration.md, "Removed keys").
func TestLoad_RemovedCPUSchedulingStillLoads(t *testing.T) {
	for _, v := range []string{"batch", "normal"} {
		cfg, err := load(t, "cpu_scheduling: "+v+"\n")
		if err != nil {
			t.Fatalf("cpu_scheduling: %s: %v", v, err)
		}
		if cfg.CPUScheduling != v {
			t.Errorf("CPUScheduling = %q, want %q (run reads it to warn)", cfg.CPUScheduling, v)
		}
	}
}
