// Package config loads the relay's configuration: a YAML file, RELAY_*
// environment variables and command-line overrides, on top of defaults.
//
// Precedence, highest first: Options.Overrides (the CLI's flags), RELAY_*
// variables, the file, defaults. A higher layer replaces the value it names,
// whole: RELAY_DELIVERY_BACKOFF replaces the list, RELAY_SOURCE='{mode: poll}'
// replaces the source section. Setting a secret or its *_file key in a higher
// layer also discards the other one from lower layers.
//
// In the file, ${VAR} and ${VAR:-default} are expanded inside values (never
// keys or comments), also inside flow mappings ({secret: ${SECRET}}); the
// default applies when VAR is unset or empty, an unset ${VAR} without a
// default is an error, and $$ is a literal $. A reference must close on its
// line; a lone $ not followed by { or $ is kept as is. An expanded value is
// always one scalar, never YAML structure; unquoted, it is typed like any
// plain scalar, so an empty result leaves the key at its default.
//
// Every key can be set as RELAY_<PATH>: the key path upper-cased, parts joined
// by "_", list elements by their index (RELAY_SOURCE_POLL_INTERVAL=2s,
// RELAY_SINKS_0_URL=..., RELAY_SINKS_0_409_MEANS_DELIVERED=true). The value of
// a single-valued key is taken verbatim, never parsed as YAML, so secrets need
// no quoting. A list of single values is either a YAML flow sequence
// ("[1s, 5s]") or comma-separated ("order.*,invoice.*"); a section, a map or
// a list of sections is YAML ('{X-Api-Key: abc}'). An index one past the end
// of a list appends an element and a larger one is an error; a list no lower
// layer sets starts as its default, so RELAY_DELIVERY_BACKOFF_1=10s changes
// the second default delay. Map entries (sink headers) cannot be addressed
// one by one, because environment names cannot keep their case: set the
// whole map. A RELAY_ variable that names no key is an error, except
// EnvConfigFile; an empty one is ignored, so that RELAY_X=${X} in a compose
// file with X unset changes nothing.
//
// Errors name the key path and where its value came from: "relay.yaml:12:
// source.mode: ...", "RELAY_SOURCE_MODE: source.mode: ...", or
// "command line: database_url: ...". Load reports every error it finds,
// joined with errors.Join.
package config

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/celfilter"
	"go.yaml.in/yaml/v3"
)

// EnvConfigFile is the environment variable the CLI reads the config file
// path from. Load does not treat it as a key, so it is not reported as
// unknown.
const EnvConfigFile = "RELAY_CONFIG"

// Config is the relay's configuration. The zero value is not useful: start
// from Default or Load.
type Config struct {
	// DatabaseURL is a libpq connection string or URL. Load falls back to
	// the DATABASE_URL environment variable when no layer sets it (or
	// database_url_file); left empty, pgx applies libpq's PG* variables and
	// defaults.
	DatabaseURL     Secret         `yaml:"database_url"`
	DatabaseURLFile string         `yaml:"database_url_file"`
	Outbox          OutboxConfig   `yaml:"outbox"`
	Source          SourceConfig   `yaml:"source"`
	Delivery        DeliveryConfig `yaml:"delivery"`
	// Sinks are the destinations. The run command refuses to start
	// without one, unless EmbeddedNATS adds one (EffectiveSinks).
	Sinks []SinkConfig `yaml:"sinks"`
	// EmbeddedNATS adds a sink named "nats" that delivers to an embedded
	// NATS server with JetStream (single instance, storage under DataDir):
	// a try-out the configuration asks for, never a default, so that a
	// missing configuration cannot send production events into a
	// throwaway stream (docs/configuration.md, "Where settings come
	// from").
	EmbeddedNATS    bool       `yaml:"embedded_nats"`
	HTTP            HTTPConfig `yaml:"http"`
	DataDir         string     `yaml:"data_dir"`
	ShutdownTimeout Duration   `yaml:"shutdown_timeout"`
	// CPUScheduling is a removed setting, still accepted so that a
	// configuration written for an earlier version loads; run warns when it
	// is set (docs/configuration.md, "Removed keys"). The relay leaves the
	// kernel's scheduling policy alone.
	CPUScheduling string          `yaml:"cpu_scheduling"`
	Log           LogConfig       `yaml:"log"`
	Migrate       MigrateConfig   `yaml:"migrate"`
	Retention     RetentionConfig `yaml:"retention"`
	Verify        VerifyConfig    `yaml:"verify"`
	Notify        NotifyConfig    `yaml:"notify"`

	// origins maps a key path ("sinks[0].url") to where its value came
	// from, so Validate can name the file line or variable.
	origins map[string]string
	// sinkSecretsOptional is Options.SinkSecretsOptional: Validate does
	// not require sink secrets.
	sinkSecretsOptional bool
}

// OutboxConfig names the database objects the relay and its migrations use.
// Each name may be schema-qualified ("app.outbox").
type OutboxConfig struct {
	Table           string `yaml:"table"`
	LedgerTable     string `yaml:"ledger_table"`
	CheckpointTable string `yaml:"checkpoint_table"`
	// ConflictsTable empty means "<table>_conflicts" in the outbox table's
	// schema; Load fills it in.
	ConflictsTable  string `yaml:"conflicts_table"`
	PublishFunction string `yaml:"publish_function"`
}

// SourceMode selects how the relay learns about new outbox rows.
type SourceMode string

// Source modes.
const (
	SourceAuto        SourceMode = "auto"
	SourceReplication SourceMode = "replication"
	SourcePoll        SourceMode = "poll"
)

func (SourceMode) choices() []string { return strs(SourceAuto, SourceReplication, SourcePoll) }

// SourceConfig configures the replication and poll sources.
type SourceConfig struct {
	Mode              SourceMode `yaml:"mode"`
	Slot              string     `yaml:"slot"`
	Publication       string     `yaml:"publication"`
	PollInterval      Duration   `yaml:"poll_interval"`
	BatchSize         int        `yaml:"batch_size"`
	SweepAfter        Duration   `yaml:"sweep_after"`
	LockTimeout       Duration   `yaml:"lock_timeout"`
	SlotMaxUnconsumed Duration   `yaml:"slot_max_unconsumed"`
	SlotMaxRetained   ByteSize   `yaml:"slot_max_retained"`
	NotifyTrigger     bool       `yaml:"notify_trigger"`
	// ReplicationRetry is how often auto mode, while polling because
	// replication is impossible, tries to return to replication.
	ReplicationRetry Duration `yaml:"replication_retry"`
	// StandbyURL names a physical standby (PostgreSQL 16+) of the primary
	// to decode on, libpq multi-host rules as database_url; empty decodes
	// on the primary (docs/standby.md).
	StandbyURL     Secret `yaml:"standby_url"`
	StandbyURLFile string `yaml:"standby_url_file"`
	// StandbyMaxLag is the bound past which the standby, unreachable or
	// lagging its primary, is unavailable: auto mode delivers on the
	// primary until it is back.
	StandbyMaxLag Duration `yaml:"standby_max_lag"`
}

// Ordering says which events must be delivered in order.
type Ordering string

// Orderings.
const (
	OrderingAggregate Ordering = "aggregate"
	OrderingNone      Ordering = "none"
)

func (Ordering) choices() []string { return strs(OrderingAggregate, OrderingNone) }

// MarkDone is delivery.mark_done, a removed setting: the settlement writes
// every row's status, done in the transaction of its delivered ledger rows.
// Both values still load so that a configuration written for an earlier
// version does; run warns about off, which it can no longer honour
// (docs/configuration.md, "Removed keys").
type MarkDone string

// MarkDone values.
const (
	MarkDoneAsync MarkDone = "async"
	MarkDoneOff   MarkDone = "off"
)

func (MarkDone) choices() []string { return strs(MarkDoneAsync, MarkDoneOff) }

// DeliveryConfig configures retries and ordering.
type DeliveryConfig struct {
	Ordering       Ordering   `yaml:"ordering"`
	InlineAttempts int        `yaml:"inline_attempts"`
	MaxAttempts    int        `yaml:"max_attempts"`
	Backoff        []Duration `yaml:"backoff"`
	MarkDone       MarkDone   `yaml:"mark_done"`
	LaneBlockMax   Duration   `yaml:"lane_block_max"`
	// MaxInFlightBytes bounds the bytes of the events the relay holds
	// between reading them and recording their outcome, on every path
	// (docs/performance.md, "Memory").
	MaxInFlightBytes ByteSize `yaml:"max_inflight_bytes"`
}

// SinkType selects a sink implementation.
type SinkType string

// Sink types.
const (
	SinkWebhook SinkType = "webhook"
	SinkNATS    SinkType = "nats"
)

func (SinkType) choices() []string { return strs(SinkWebhook, SinkNATS) }

// SinkConfig is one sink. Only the part matching Type may be set: Validate
// refuses a NATS setting on a webhook sink and the reverse.
type SinkConfig struct {
	// Name identifies the sink in logs and metrics and is the ledger's
	// action, so renaming a sink re-delivers everything.
	Name string   `yaml:"name"`
	Type SinkType `yaml:"type"`
	// URL is the webhook's endpoint, or the NATS server URLs
	// (comma-separated); empty for NATS runs an embedded server.
	URL string `yaml:"url"`
	// Events lists path.Match globs over the event type.
	Events []string `yaml:"events"`
	// Filter is a CEL expression over the event, true for the events the
	// sink takes among those Events match (docs/sinks.md, "Filters");
	// empty takes them all.
	Filter string `yaml:"filter"`
	// Format is what a request or message carries: the envelope (or, for
	// a webhook, the nudge of body: nudge), or a CloudEvent in the binary
	// content mode (docs/ecosystem.md).
	Format      Format            `yaml:"format"`
	CloudEvents CloudEventsConfig `yaml:"cloudevents"`
	// TLS configures the connection to a webhook (https://) or a NATS
	// server; the zero value uses the system roots and no client
	// certificate.
	TLS TLSConfig `yaml:"tls"`
	// RateLimit bounds the events per second sent to the sink
	// (docs/sinks.md, "Rate limits"); the zero value sets no limit.
	RateLimit RateLimitConfig `yaml:"rate_limit"`
	Webhook   WebhookConfig   `yaml:",inline"`
	NATS      NATSConfig      `yaml:",inline"`
}

// RateLimitConfig is a sink's rate limit: a token bucket refilled at
// PerSecond events a second that holds at most Burst.
type RateLimitConfig struct {
	PerSecond float64 `yaml:"per_second"`
	Burst     int     `yaml:"burst"`
}

// On reports whether a limit is set.
func (r RateLimitConfig) On() bool { return r.PerSecond != 0 || r.Burst != 0 }

// Format selects how a sink renders an event.
type Format string

// Formats.
const (
	FormatEnvelope    Format = "envelope"
	FormatCloudEvents Format = "cloudevents"
)

func (Format) choices() []string { return strs(FormatEnvelope, FormatCloudEvents) }

// CloudEventsConfig holds the CloudEvents attributes a sink with format
// cloudevents takes from its configuration.
type CloudEventsConfig struct {
	// Source is ce-source, a URI-reference. Empty means
	// "/<database>/<schema>/<table>" of the outbox (the run command fills
	// it in: CloudEventsSource).
	Source string `yaml:"source"`
}

// TLSConfig is a sink's TLS client configuration. Every file is PEM.
type TLSConfig struct {
	// CAFile is a bundle of CA certificates that replaces the system roots.
	CAFile string `yaml:"ca_file"`
	// CertFile and KeyFile are a client certificate (mTLS); both or neither.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// InsecureSkipVerify accepts any server certificate. For tests only.
	InsecureSkipVerify bool `yaml:"insecure_skip_verify"`
}

// IsZero reports whether no TLS setting is made.
func (t TLSConfig) IsZero() bool { return t == TLSConfig{} }

// ClientConfig builds the *tls.Config t describes, reading its files; nil
// when t is zero (the system's defaults apply). Errors name the key
// (relative to the tls section) and the file, never the file's contents.
func (t TLSConfig) ClientConfig() (*tls.Config, error) {
	c, key, err := t.build()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", key, err)
	}
	return c, nil
}

func (t TLSConfig) build() (c *tls.Config, key string, err error) {
	if t.IsZero() {
		return nil, "", nil
	}
	// InsecureSkipVerify is opt-in and documented as test-only.
	c = &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: t.InsecureSkipVerify}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, "ca_file", err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, "ca_file", fmt.Errorf("%s holds no PEM certificate", t.CAFile)
		}
		c.RootCAs = pool
	}
	switch {
	case t.CertFile != "" && t.KeyFile != "":
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			// LoadX509KeyPair's errors describe the PEM blocks, never
			// the key material.
			return nil, "cert_file", fmt.Errorf("load the key pair %s, %s: %w", t.CertFile, t.KeyFile, err)
		}
		c.Certificates = []tls.Certificate{cert}
	case t.CertFile != "":
		return nil, "key_file", errors.New("is required with cert_file")
	case t.KeyFile != "":
		return nil, "cert_file", errors.New("is required with key_file")
	}
	return c, "", nil
}

// BodyFormat selects what a webhook request carries.
type BodyFormat string

// Body formats.
const (
	BodyEnvelope BodyFormat = "envelope"
	BodyNudge    BodyFormat = "nudge"
)

func (BodyFormat) choices() []string { return strs(BodyEnvelope, BodyNudge) }

// OnUnknown says what to do when a request was written but its outcome is
// unknown (timeout or reset after the write).
type OnUnknown string

// OnUnknown policies.
const (
	OnUnknownRetry OnUnknown = "retry"
	OnUnknownHold  OnUnknown = "hold"
)

func (OnUnknown) choices() []string { return strs(OnUnknownRetry, OnUnknownHold) }

// WebhookConfig holds the settings of a webhook sink.
type WebhookConfig struct {
	Timeout           Duration          `yaml:"timeout"`
	Concurrency       int               `yaml:"concurrency"`
	Auth              AuthConfig        `yaml:"auth"`
	Headers           map[string]string `yaml:"headers"`
	Body              BodyFormat        `yaml:"body"`
	OnUnknown         OnUnknown         `yaml:"on_unknown"`
	MaxBody           ByteSize          `yaml:"max_body"`
	PermanentStatuses []int             `yaml:"permanent_statuses"`
	// Treat409AsDelivered counts a 409 as delivered instead of as an
	// Idempotency-Key server still processing the original request.
	Treat409AsDelivered bool `yaml:"409_means_delivered"`
	// Batch puts several events into one request; off (max_events 0) by
	// default. docs/sinks.md "Batched delivery".
	Batch BatchConfig `yaml:"batch"`
	// ReceiverQuery is verify --deep's check of the receiver: SQL run on
	// the relay's database, $1 the text[] of event keys delivered to the
	// sink, returning first those the receiver applied
	// (docs/operations.md, "verify").
	ReceiverQuery string `yaml:"receiver_query"`
}

// BatchConfig sets how a webhook sink batches events.
type BatchConfig struct {
	// MaxEvents is the most events in one request; 0 sends one event per
	// request, without the batch format.
	MaxEvents int `yaml:"max_events"`
	// MaxWait is how long the first event of a batch waits for more.
	MaxWait Duration `yaml:"max_wait"`
	// Ordered declares that the receiver applies a batch in order and, for
	// each aggregate, applies none after the first event it does not
	// apply: a batch may then carry several events of one aggregate
	// (docs/sinks.md "Ordered batches").
	Ordered bool `yaml:"ordered"`
}

// AuthType selects how a webhook request authenticates.
type AuthType string

// Auth types.
const (
	AuthNone             AuthType = "none"
	AuthJWT              AuthType = "jwt"
	AuthHeader           AuthType = "header"
	AuthBasic            AuthType = "basic"
	AuthStandardWebhooks AuthType = "standard-webhooks"
)

func (AuthType) choices() []string {
	return strs(AuthNone, AuthJWT, AuthHeader, AuthBasic, AuthStandardWebhooks)
}

// AuthConfig holds a webhook's credentials. Each secret may instead be read
// from the file its *_file key names; after Load the secret holds the file's
// contents (one trailing newline removed) and the *_file key its path.
type AuthConfig struct {
	Type AuthType `yaml:"type,omitempty"`
	// Secret signs requests (jwt: HS256 key; standard-webhooks: a
	// "whsec_"-prefixed secret is base64-decoded to the key).
	Secret     Secret `yaml:"secret,omitempty"`
	SecretFile string `yaml:"secret_file,omitempty"`
	// Header and Value form the header sent for type header.
	Header    string `yaml:"header,omitempty"`
	Value     Secret `yaml:"value,omitempty"`
	ValueFile string `yaml:"value_file,omitempty"`
	// Username and Password are sent for type basic.
	Username     string `yaml:"username,omitempty"`
	Password     Secret `yaml:"password,omitempty"`
	PasswordFile string `yaml:"password_file,omitempty"`
}

// NATSConfig holds the settings of a NATS JetStream sink.
type NATSConfig struct {
	// Subject is a text/template executed per event.
	Subject    string       `yaml:"subject"`
	Stream     StreamConfig `yaml:"stream"`
	MaxPending int          `yaml:"max_pending"`
	CredsFile  string       `yaml:"creds_file"`
	// NkeyFile is a user NKey seed file (an NKey without a JWT).
	NkeyFile  string `yaml:"nkey_file"`
	Token     Secret `yaml:"token"`
	TokenFile string `yaml:"token_file"`
	// MsgIDPrefix scopes the message ids to this deployment
	// (docs/sinks.md, "Message ids"); empty derives it from the database:
	// its cluster's system identifier, its name and the outbox table.
	MsgIDPrefix string `yaml:"msg_id_prefix"`
}

// StreamConfig describes the JetStream stream that must capture the sink's
// subjects.
type StreamConfig struct {
	Name     string   `yaml:"name"`
	Subjects []string `yaml:"subjects"`
	// DuplicateWindow is the window a created stream gets; an existing
	// stream with a smaller one is used with a warning.
	DuplicateWindow Duration `yaml:"duplicate_window"`
	// Create creates the stream when it does not exist.
	Create bool `yaml:"create"`
	// MaxMsgSize zero leaves the server's default.
	MaxMsgSize ByteSize `yaml:"max_msg_size"`
}

// HTTPConfig configures the metrics and health endpoint.
type HTTPConfig struct {
	Listen string `yaml:"listen"`
	// MetricsToken, when set, is the bearer token /metrics requires
	// (Authorization: Bearer <token>); /healthz and /readyz stay open.
	MetricsToken     Secret `yaml:"metrics_token"`
	MetricsTokenFile string `yaml:"metrics_token_file"`
	// Pprof serves the Go runtime profiles under /debug/pprof/ (behind the
	// metrics token, when one is set). Off by default.
	Pprof bool `yaml:"pprof"`
	// StallAfter makes /healthz (and /readyz) answer 503 once the relay
	// has held events it has not settled or acknowledged and made no
	// progress for this long — the stream acknowledged no new position,
	// the claim path settled nothing — so that an orchestrator restarts it
	// (docs/operations-health.md). 0 turns the check off; the
	// outbox_relay_stalled metric then stays 0. Keep it above the sinks'
	// timeouts.
	StallAfter Duration `yaml:"stall_after"`
	// AdminToken turns the admin API and the console on
	// (docs/operations.md, "Console and admin API"): each request needs
	// "Authorization: Bearer" with it, or with AdminReadToken, which only
	// reads. Without it both are off (404).
	AdminToken         Secret `yaml:"admin_token"`
	AdminTokenFile     string `yaml:"admin_token_file"`
	AdminReadToken     Secret `yaml:"admin_read_token"`
	AdminReadTokenFile string `yaml:"admin_read_token_file"`
	// FeedPayloads adds the start of each event's payload to the admin
	// API's live feed and event lookup. Off by default: payloads are the
	// application's data.
	FeedPayloads bool `yaml:"feed_payloads"`
}

// LogConfig configures zerolog. Level is one of trace, debug, info, warn,
// error; Format one of json, console, auto (console on a terminal).
type LogConfig struct {
	Level  string `yaml:"level"`
	Format string `yaml:"format"`
}

// MigrateConfig configures the migrate command.
type MigrateConfig struct {
	// LockTimeout bounds each attempt to take a table lock, so migrate
	// never queues behind long transactions while blocking the writers
	// queued behind it.
	LockTimeout Duration `yaml:"lock_timeout"`
	// Timeout is how long migrate keeps retrying lock timeouts in total.
	Timeout Duration `yaml:"timeout"`
}

// RetentionConfig configures the pruning of old rows that run does on an
// interval. Only done outbox rows and the ledger rows of done or deleted
// outbox rows are ever pruned; pending, processing, held and failed rows and
// their ledger rows are kept however old they are.
type RetentionConfig struct {
	// Enabled turns pruning on. The run role then needs DELETE on the outbox.
	Enabled bool `yaml:"enabled"`
	// DoneAfter is how long a done row is kept after it was processed. It
	// is also how long outbox_publish recognises a re-published key as a
	// duplicate.
	DoneAfter Duration `yaml:"done_after"`
	// LedgerAfter is how long a ledger row is kept after its delivery (or
	// claim). It must be at least DoneAfter: while a row exists, its ledger
	// rows tell replay --sink which sinks already have it.
	LedgerAfter Duration `yaml:"ledger_after"`
	// Interval is the pause between pruning passes.
	Interval Duration `yaml:"interval"`
	// Batch is the number of rows one DELETE removes; each batch is its own
	// short transaction.
	Batch int `yaml:"batch"`
}

// VerifyConfig configures the continuous verify that run does
// (docs/operations.md, "verify").
type VerifyConfig struct {
	// Interval is the pause between passes; 0 turns the continuous verify
	// off.
	Interval Duration `yaml:"interval"`
	// Window is how far back each pass looks: the rows created in the last
	// Window. At least Interval, so that every row is checked.
	Window Duration `yaml:"window"`
}

// NotifyFormat selects the body of a dead-letter notification.
type NotifyFormat string

// Notification formats.
const (
	NotifySlack NotifyFormat = "slack"
	NotifyJSON  NotifyFormat = "json"
)

func (NotifyFormat) choices() []string { return strs(NotifySlack, NotifyJSON) }

// NotifyConfig configures the dead-letter notifications run sends
// (docs/operations.md, "Dead-letter notifications"). They are off while URL
// is empty.
type NotifyConfig struct {
	// URL receives the notifications (a Slack incoming webhook, say); it
	// may hold a token, so it is a secret.
	URL     Secret       `yaml:"url"`
	URLFile string       `yaml:"url_file"`
	Format  NotifyFormat `yaml:"format"`
	// Interval is the time between passes, and the least time between two
	// notifications about one sink.
	Interval Duration `yaml:"interval"`
	// Sinks are the sinks notified about, and "*" for the dead letters that
	// name none; empty: every sink and "*". Printed only when set, so that
	// the printed configuration loads back as it was (an empty list or map
	// would load as one, not as nil).
	Sinks []string `yaml:"sinks,omitempty"`
	// ConsoleURL is the console's address, linked from every notification.
	ConsoleURL string            `yaml:"console_url"`
	Timeout    Duration          `yaml:"timeout"`
	Headers    map[string]string `yaml:"headers,omitempty"`
	Auth       AuthConfig        `yaml:"auth"`
}

// Default returns the configuration used when no file, variable or override
// sets a key. It has no sinks, and an empty Outbox.ConflictsTable, meaning
// "<table>_conflicts".
func Default() Config {
	return Config{
		Outbox: OutboxConfig{
			Table:           "integration_outbox",
			LedgerTable:     "integration_idempotency",
			CheckpointTable: "relay_checkpoint",
			PublishFunction: "outbox_publish",
		},
		Source: SourceConfig{
			Mode:              SourceAuto,
			Slot:              "outbox_relay",
			Publication:       "outbox_relay",
			PollInterval:      Duration(time.Second),
			BatchSize:         500,
			SweepAfter:        Duration(30 * time.Second),
			LockTimeout:       Duration(5 * time.Minute),
			SlotMaxUnconsumed: Duration(10 * time.Minute),
			SlotMaxRetained:   GiB,
			ReplicationRetry:  Duration(time.Minute),
			StandbyMaxLag:     Duration(30 * time.Second),
		},
		Delivery: DeliveryConfig{
			Ordering:       OrderingAggregate,
			InlineAttempts: 3,
			MaxAttempts:    10,
			Backoff: []Duration{
				Duration(time.Second), Duration(5 * time.Second), Duration(30 * time.Second),
				Duration(2 * time.Minute), Duration(5 * time.Minute), Duration(15 * time.Minute),
				Duration(30 * time.Minute), Duration(time.Hour),
			},
			MarkDone:         MarkDoneAsync,
			LaneBlockMax:     Duration(2 * time.Second),
			MaxInFlightBytes: 64 * MiB,
		},
		HTTP:            HTTPConfig{Listen: "127.0.0.1:9187", StallAfter: Duration(5 * time.Minute)},
		DataDir:         "./data",
		ShutdownTimeout: Duration(30 * time.Second),
		Log:             LogConfig{Level: "info", Format: "auto"},
		Migrate: MigrateConfig{
			LockTimeout: Duration(time.Second),
			Timeout:     Duration(10 * time.Minute),
		},
		Retention: RetentionConfig{
			Enabled:     true,
			DoneAfter:   Duration(7 * 24 * time.Hour),
			LedgerAfter: Duration(30 * 24 * time.Hour),
			Interval:    Duration(time.Minute),
			Batch:       1000,
		},
		Verify: VerifyConfig{Window: Duration(15 * time.Minute)},
		Notify: NotifyConfig{
			Format:   NotifySlack,
			Interval: Duration(time.Minute),
			Timeout:  Duration(10 * time.Second),
			Auth:     AuthConfig{Type: AuthNone},
		},
	}
}

// DefaultSink returns a sink of type typ with every setting of that type at
// its default and no name. Load starts each configured sink from it;
// EffectiveSinks uses it for the embedded NATS sink. An unknown type gets
// only the common defaults.
func DefaultSink(typ SinkType) SinkConfig {
	s := SinkConfig{Type: typ, Events: []string{"*"}, Format: FormatEnvelope}
	switch typ {
	case SinkWebhook:
		s.Webhook = WebhookConfig{
			Timeout:           Duration(10 * time.Second),
			Concurrency:       8,
			Auth:              AuthConfig{Type: AuthNone},
			Body:              BodyEnvelope,
			OnUnknown:         OnUnknownRetry,
			MaxBody:           16 * MiB,
			PermanentStatuses: []int{400, 413, 415, 422},
			Batch:             BatchConfig{MaxWait: Duration(10 * time.Millisecond)},
		}
	case SinkNATS:
		s.NATS = NATSConfig{
			Subject: "outbox.{{.AggregateType}}.{{.EventType}}",
			Stream: StreamConfig{
				Name:            "OUTBOX",
				Subjects:        []string{"outbox.>"},
				DuplicateWindow: Duration(10 * time.Minute),
				Create:          true,
			},
			MaxPending: 4096,
		}
	}
	return s
}

// EmbeddedNATSSink is the name of the sink EmbeddedNATS adds.
const EmbeddedNATSSink = "nats"

// EffectiveSinks returns the sinks the relay delivers to: Sinks, followed,
// with EmbeddedNATS, by a NATS sink named EmbeddedNATSSink with every
// setting at its default and no url (the embedded server). Validate refuses
// a configured sink of that name beside EmbeddedNATS.
func (c *Config) EffectiveSinks() []SinkConfig {
	if !c.EmbeddedNATS {
		return c.Sinks
	}
	s := DefaultSink(SinkNATS)
	s.Name = EmbeddedNATSSink
	return append(slices.Clip(c.Sinks), s)
}

// Tables holds the parsed names of the database objects, for the migrations
// and the queries that use them.
type Tables struct {
	Outbox          relay.QualifiedName
	Ledger          relay.QualifiedName
	Checkpoint      relay.QualifiedName
	Conflicts       relay.QualifiedName
	PublishFunction relay.QualifiedName
	Publication     string
}

// Tables returns the parsed object names, deriving the conflicts table when
// it is empty. It must only be called on a Config that passed Validate (Load
// returns no other); it panics on a name Validate refuses.
func (c *Config) Tables() Tables {
	o := c.Outbox
	t := Tables{
		Outbox:          relay.MustParseQualifiedName(o.Table),
		Ledger:          relay.MustParseQualifiedName(o.LedgerTable),
		Checkpoint:      relay.MustParseQualifiedName(o.CheckpointTable),
		PublishFunction: relay.MustParseQualifiedName(o.PublishFunction),
		Publication:     c.Source.Publication,
	}
	if o.ConflictsTable == "" {
		t.Conflicts = relay.MustParseQualifiedName(conflictsTableFor(o.Table))
	} else {
		t.Conflicts = relay.MustParseQualifiedName(o.ConflictsTable)
	}
	return t
}

// conflictsTableFor derives the default conflicts table: same schema as the
// outbox table. It returns "" when table does not parse.
func conflictsTableFor(table string) string {
	n, err := relay.ParseQualifiedName(table)
	if err != nil {
		return ""
	}
	return n.Sibling(n.Name + "_conflicts").String()
}

// Redacted renders c as YAML for printing: secrets as "[redacted]", every
// webhook header value as "[redacted]" (headers often carry API keys), and
// the credentials in sink URLs as "xxxxx". database_url and
// source.standby_url show where they connect (host, port, database, user,
// settings) with only their passwords as "xxxxx" (redactConnString), since
// that is what a person checking the configuration needs to see. A sink
// shows only the settings of its type.
// The output is a configuration file that loads back to c with its secrets
// and header values replaced: a secret read from a file shows only its
// *_file key, and "$" in a value is written "$$".
func (c *Config) Redacted() ([]byte, error) {
	r := *c
	r.Sinks = make([]SinkConfig, len(c.Sinks))
	for i, s := range c.Sinks {
		s.URL = redactURLs(s.URL)
		if s.Webhook.Headers != nil {
			h := make(map[string]string, len(s.Webhook.Headers))
			for k, v := range s.Webhook.Headers {
				h[k] = Secret(v).String()
			}
			s.Webhook.Headers = h
		}
		r.Sinks[i] = s
	}
	for _, ref := range r.secretRefs() {
		if ref.file != "" {
			*ref.secret = "" // setting both is an error
		}
	}
	var root yaml.Node
	if err := root.Encode(&r); err != nil {
		return nil, fmt.Errorf("render config: %w", err)
	}
	showConnString(&root, "database_url", r.DatabaseURL)
	if k := findKey(&root, "source"); k >= 0 {
		showConnString(root.Content[k+1], "standby_url", r.Source.StandbyURL)
	}
	escapeDollars(&root)
	if k := findKey(&root, "sinks"); k >= 0 {
		for i, sink := range root.Content[k+1].Content {
			typ := r.Sinks[i].Type
			if !slices.Contains(typ.choices(), string(typ)) {
				continue // Validate refuses it: print every setting
			}
			for _, f := range fieldsOf(sinkType) {
				if part, j := sinkPart(f), findKey(sink, f.name); part != "" && part != typ && j >= 0 {
					sink.Content = append(sink.Content[:j], sink.Content[j+2:]...)
				}
			}
		}
	}
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(&root); err != nil {
		return nil, fmt.Errorf("render config: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("render config: %w", err)
	}
	return buf.Bytes(), nil
}

// escapeDollars writes "$" as "$$" in the values below n, so that loading
// them does not expand references. Keys are never expanded.
func escapeDollars(n *yaml.Node) {
	switch n.Kind {
	case yaml.ScalarNode:
		n.Value = strings.ReplaceAll(n.Value, "$", "$$")
	case yaml.MappingNode:
		for i := 1; i < len(n.Content); i += 2 {
			escapeDollars(n.Content[i])
		}
	default:
		for _, c := range n.Content {
			escapeDollars(c)
		}
	}
}

// showConnString sets m's key, a connection string rendered as
// "[redacted]", to conn with only its passwords hidden.
func showConnString(m *yaml.Node, key string, conn Secret) {
	k := findKey(m, key)
	if k < 0 || conn == "" {
		return
	}
	v := m.Content[k+1]
	v.Kind, v.Tag, v.Style, v.Value = yaml.ScalarNode, "!!str", 0, redactConnString(conn.Reveal())
}

// connPasswordKeys are the libpq parameters that carry a secret.
var connPasswordKeys = []string{"password", "sslpassword"}

// redactConnString returns a libpq connection string (a postgres:// URL or
// key=value pairs) with every password replaced by "xxxxx", or
// "[redacted]" when it does not parse: nothing that might be a secret is
// shown.
func redactConnString(s string) string {
	if strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://") {
		u, err := url.Parse(s)
		if err != nil {
			return redacted
		}
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		}
		if u.RawQuery != "" {
			params := strings.Split(u.RawQuery, "&")
			for i, p := range params {
				k, _, _ := strings.Cut(p, "=")
				if name, err := url.QueryUnescape(k); err != nil || slices.Contains(connPasswordKeys, name) {
					params[i] = k + "=xxxxx"
				}
			}
			u.RawQuery = strings.Join(params, "&")
		}
		return u.String()
	}
	out, ok := redactKeywordValues(s)
	if !ok {
		return redacted
	}
	return out
}

// redactKeywordValues rewrites libpq's key=value form (values unquoted, or
// single-quoted with backslash escapes) as key=value pairs separated by one
// space, each password's value "xxxxx". It reports false when s does not
// parse.
func redactKeywordValues(s string) (string, bool) {
	space := func(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v' }
	var pairs []string
	for i := 0; ; {
		for i < len(s) && space(s[i]) {
			i++
		}
		if i == len(s) {
			break
		}
		start := i
		for i < len(s) && s[i] != '=' && !space(s[i]) {
			i++
		}
		key := s[start:i]
		for i < len(s) && space(s[i]) {
			i++
		}
		if key == "" || i == len(s) || s[i] != '=' {
			return "", false
		}
		i++
		for i < len(s) && space(s[i]) {
			i++
		}
		start = i
		if i < len(s) && s[i] == '\'' {
			for i++; ; i++ {
				if i >= len(s) {
					return "", false // unterminated quote
				}
				if s[i] == '\\' {
					i++
					continue
				}
				if s[i] == '\'' {
					i++
					break
				}
			}
		} else {
			for i < len(s) && !space(s[i]) {
				if s[i] == '\\' {
					i++
				}
				i++
			}
			i = min(i, len(s))
		}
		value := s[start:i]
		if slices.Contains(connPasswordKeys, key) {
			value = "xxxxx"
		}
		pairs = append(pairs, key+"="+value)
	}
	return strings.Join(pairs, " "), true
}

// redactURLs redacts the credentials of each URL in a comma-separated list.
func redactURLs(s string) string {
	if s == "" {
		return s
	}
	parts := strings.Split(s, ",")
	for i, p := range parts {
		parts[i] = redactURL(strings.TrimSpace(p))
	}
	return strings.Join(parts, ",")
}

func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		// Validate refuses it anyway; print nothing that might be a secret.
		return redacted
	}
	if u.User == nil {
		return raw
	}
	if _, ok := u.User.Password(); ok {
		return u.Redacted()
	}
	// A lone user part is how NATS URLs carry a token (nats://TOKEN@host).
	u.User = url.User("xxxxx")
	return u.String()
}

// CloudEventsSource returns the ce-source of sink s: its cloudevents.source,
// or "/<database>/<schema>/<table>" of the outbox table, each part
// percent-escaped as a URI path segment. outbox must be schema-qualified.
func (s *SinkConfig) CloudEventsSource(database string, outbox relay.QualifiedName) string {
	if s.CloudEvents.Source != "" {
		return s.CloudEvents.Source
	}
	return "/" + url.PathEscape(database) + "/" + url.PathEscape(outbox.Schema) + "/" + url.PathEscape(outbox.Name)
}

// CompiledFilter returns the sink's compiled filter, nil when it has none
// or when it does not compile (Validate reports that).
func (s *SinkConfig) CompiledFilter() relay.Filter {
	if s.Filter == "" {
		return nil
	}
	f, err := celfilter.Compile(s.Filter)
	if err != nil {
		return nil
	}
	return f
}
