package config

import (
	"encoding/base64"
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"net/url"
	"path"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/celfilter"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// Validate checks every value and returns all problems joined with
// errors.Join, or nil. Each error names the key path and, for a Config from
// Load, where the value came from. A secret counts as set when its *_file
// key is, since Load reads the file. Validate does not modify c.
func (c *Config) Validate() error {
	v := &validator{origins: c.origins, sinkSecretsOptional: c.sinkSecretsOptional}
	v.outbox(c.Outbox)
	v.source(c.Source)
	v.delivery(c.Delivery)
	names := map[string]string{}
	for i := range c.Sinks {
		v.sink(fmt.Sprintf("sinks[%d]", i), &c.Sinks[i], names)
	}
	if at, taken := names[EmbeddedNATSSink]; taken && c.EmbeddedNATS {
		v.fail("embedded_nats", "adds a sink named %q, which is already the name of %s: leave %s's url empty for the embedded server instead", EmbeddedNATSSink, at, at)
	}
	v.listen("http.listen", c.HTTP.Listen)
	if strings.ContainsFunc(c.HTTP.MetricsToken.Reveal(), func(r rune) bool { return unicode.IsSpace(r) || !unicode.IsPrint(r) }) {
		v.fail("http.metrics_token", "must be printable, without spaces")
	}
	v.adminTokens(c.HTTP)
	if c.HTTP.StallAfter < 0 {
		v.fail("http.stall_after", "must not be negative (0 turns the stall check off)")
	}
	if c.DataDir == "" {
		v.fail("data_dir", "must not be empty")
	}
	v.positive("shutdown_timeout", c.ShutdownTimeout)
	oneOf(v, "log.level", c.Log.Level, []string{"trace", "debug", "info", "warn", "error"})
	oneOf(v, "log.format", c.Log.Format, []string{"json", "console", "auto"})
	v.positive("migrate.lock_timeout", c.Migrate.LockTimeout)
	v.positive("migrate.timeout", c.Migrate.Timeout)
	v.retention(c.Retention)
	v.verify(c.Verify)
	v.notify(c.Notify, c.EffectiveSinks())
	return errors.Join(v.errs...)
}

// notify checks the dead-letter notifications' settings when they are on
// (a url is set).
func (v *validator) notify(n NotifyConfig, sinks []SinkConfig) {
	if n.URL == "" && n.URLFile == "" {
		return
	}
	if u, err := url.Parse(n.URL.Reveal()); n.URL != "" && (err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "") {
		// Not the URL: an incoming webhook's path is its token.
		v.fail("notify.url", "is not an absolute http:// or https:// URL")
	}
	oneOf(v, "notify.format", n.Format, n.Format.choices())
	v.positive("notify.interval", n.Interval)
	v.positive("notify.timeout", n.Timeout)
	if n.Interval > 0 && n.Timeout >= n.Interval {
		// A claim holds a sink's next notification for one interval: a
		// request still in flight after it could be sent by a second relay.
		v.fail("notify.timeout", "%s is not shorter than notify.interval (%s): a notification must end within its interval", n.Timeout, n.Interval)
	}
	for i, name := range n.Sinks {
		p := fmt.Sprintf("notify.sinks[%d]", i)
		switch {
		case name != "*" && !slices.ContainsFunc(sinks, func(s SinkConfig) bool { return s.Name == name }):
			v.fail(p, "%q is not the name of a configured sink (nor \"*\", the dead letters that name no sink)", name)
		case slices.Contains(n.Sinks[:i], name):
			v.fail(p, "%q is listed twice", name)
		}
	}
	if c := n.ConsoleURL; c != "" {
		if u, err := url.Parse(c); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			v.fail("notify.console_url", "%s is not an absolute http:// or https:// URL", redactURL(c))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(n.Headers)) {
		if !isHeaderName(name) {
			v.fail("notify.headers", "%q is not a valid header name", name)
		}
		if strings.ContainsAny(n.Headers[name], "\r\n\x00") {
			v.fail("notify.headers."+name, "must not contain line breaks or NUL")
		}
	}
	v.auth("notify.auth", n.Auth)
}

// verify checks the continuous verify's settings.
func (v *validator) verify(c VerifyConfig) {
	if c.Interval < 0 {
		v.fail("verify.interval", "must not be negative (0 turns the continuous verify off)")
	}
	v.positive("verify.window", c.Window)
	if c.Interval > 0 && c.Window > 0 && c.Window < c.Interval {
		v.fail("verify.window", "%s is shorter than verify.interval (%s): rows created between two passes would never be checked", c.Window, c.Interval)
	}
}

// maxRetentionBatch keeps one pruning DELETE short: its locks and its WAL
// are bounded by the batch.
const maxRetentionBatch = 100_000

// retention checks the ages even when pruning is off, so that switching it
// on cannot surface an old mistake.
func (v *validator) retention(r RetentionConfig) {
	v.positive("retention.done_after", r.DoneAfter)
	v.positive("retention.ledger_after", r.LedgerAfter)
	if r.DoneAfter > 0 && r.LedgerAfter > 0 && r.LedgerAfter < r.DoneAfter {
		// While a row exists its ledger rows say which sinks have it: replay
		// --sink and the claim path skip those sinks. Without them every
		// sink would get the row again.
		v.fail("retention.ledger_after", "%s is shorter than retention.done_after (%s): ledger rows must outlive their outbox rows, or replay --sink would re-deliver to every sink", r.LedgerAfter, r.DoneAfter)
	}
	v.positive("retention.interval", r.Interval)
	if r.Batch < 1 || r.Batch > maxRetentionBatch {
		v.fail("retention.batch", "must be between 1 and %d, got %d", maxRetentionBatch, r.Batch)
	}
}

type validator struct {
	origins map[string]string
	errs    []error
	// sinkSecretsOptional: a sink's auth does not require its secret
	// (Options.SinkSecretsOptional).
	sinkSecretsOptional bool
}

// fail records an error for the key at path, prefixed with the origin of
// the nearest key on the path that has one: a missing key is reported where
// its section was written.
func (v *validator) fail(path, format string, args ...any) {
	msg := path + ": " + fmt.Sprintf(format, args...)
	for p := path; p != ""; {
		if o, ok := v.origins[p]; ok {
			msg = o + ": " + msg
			break
		}
		i := strings.LastIndexAny(p, ".[")
		if i < 0 {
			break
		}
		p = p[:i]
	}
	v.errs = append(v.errs, errors.New(msg))
}

func (v *validator) positive(path string, d Duration) {
	if d <= 0 {
		v.fail(path, "must be greater than zero, got %s", d)
	}
}

func (v *validator) atLeast(path string, n, lowest int) {
	if n < lowest {
		v.fail(path, "must be at least %d, got %d", lowest, n)
	}
}

func oneOf[T ~string](v *validator, path string, got T, allowed []string) {
	if !slices.Contains(allowed, string(got)) {
		v.fail(path, "%q is not one of %s", got, strings.Join(allowed, ", "))
	}
}

// strs returns an enum's values as strings, for its choices method.
func strs[T ~string](values ...T) []string {
	out := make([]string, len(values))
	for i, v := range values {
		out[i] = string(v)
	}
	return out
}

func (v *validator) outbox(o OutboxConfig) {
	conflicts := o.ConflictsTable
	if conflicts == "" {
		conflicts = conflictsTableFor(o.Table)
	}
	tables := []struct{ key, name string }{
		{"outbox.table", o.Table},
		{"outbox.ledger_table", o.LedgerTable},
		{"outbox.checkpoint_table", o.CheckpointTable},
		{"outbox.conflicts_table", conflicts},
	}
	if conflicts == "" {
		tables = tables[:3] // derived from an invalid table name, reported once
	}
	seen := map[string]string{}
	for _, t := range tables {
		n, err := relay.ParseQualifiedName(t.name)
		if err != nil {
			v.fail(t.key, "%v", err)
			continue
		}
		if other, dup := seen[n.String()]; dup {
			v.fail(t.key, "%q is also %s; each table needs its own name", t.name, other)
			continue
		}
		seen[n.String()] = t.key
	}
	if _, err := relay.ParseQualifiedName(o.PublishFunction); err != nil {
		v.fail("outbox.publish_function", "%v", err)
	}
}

func (v *validator) source(s SourceConfig) {
	oneOf(v, "source.mode", s.Mode, s.Mode.choices())
	if err := relay.ValidateSlotName(s.Slot); err != nil {
		v.fail("source.slot", "%v", err)
	}
	if err := relay.ValidateIdentifier(s.Publication); err != nil {
		v.fail("source.publication", "%v", err)
	}
	v.positive("source.poll_interval", s.PollInterval)
	v.atLeast("source.batch_size", s.BatchSize, 1)
	v.positive("source.sweep_after", s.SweepAfter)
	v.positive("source.lock_timeout", s.LockTimeout)
	v.positive("source.slot_max_unconsumed", s.SlotMaxUnconsumed)
	v.positive("source.replication_retry", s.ReplicationRetry)
	v.positive("source.standby_max_lag", s.StandbyMaxLag)
	if s.SlotMaxRetained <= 0 {
		v.fail("source.slot_max_retained", "must be greater than zero, got %s", s.SlotMaxRetained)
	}
}

func (v *validator) delivery(d DeliveryConfig) {
	oneOf(v, "delivery.ordering", d.Ordering, d.Ordering.choices())
	v.atLeast("delivery.inline_attempts", d.InlineAttempts, 0)
	v.atLeast("delivery.max_attempts", d.MaxAttempts, 1)
	if len(d.Backoff) == 0 {
		v.fail("delivery.backoff", "must list at least one duration")
	}
	for i, b := range d.Backoff {
		v.positive(fmt.Sprintf("delivery.backoff[%d]", i), b)
	}
	oneOf(v, "delivery.mark_done", d.MarkDone, d.MarkDone.choices())
	v.positive("delivery.lane_block_max", d.LaneBlockMax)
	if d.MaxInFlightBytes < minInFlightBytes {
		v.fail("delivery.max_inflight_bytes", "must be at least %s (the bytes of the events in flight; an event larger than it is delivered alone), got %s",
			minInFlightBytes, d.MaxInFlightBytes)
	}
}

// minInFlightBytes is the least delivery.max_inflight_bytes: below it the
// relay would read and send a few small events at a time.
const minInFlightBytes = MiB

// sink checks one sink; names maps the names seen so far to their paths.
func (v *validator) sink(p string, s *SinkConfig, names map[string]string) {
	switch {
	case s.Name == "":
		v.fail(p+".name", "is required")
	case strings.TrimSpace(s.Name) != s.Name || !isPrintable(s.Name):
		v.fail(p+".name", "%q must be printable, without surrounding spaces", s.Name)
	case len(s.Name) > relay.MaxSinkNameBytes:
		v.fail(p+".name", "is %d bytes; the ledger's action holds at most %d", len(s.Name), relay.MaxSinkNameBytes)
	case names[s.Name] != "":
		v.fail(p+".name", "%q is already the name of %s; sink names must be unique", s.Name, names[s.Name])
	default:
		names[s.Name] = p
	}
	if len(s.Events) == 0 {
		v.fail(p+".events", "must list at least one pattern (leave it out for all events)")
	}
	for i, g := range s.Events {
		if _, err := path.Match(g, "x"); err != nil || g == "" {
			v.fail(fmt.Sprintf("%s.events[%d]", p, i), "%q is not a valid pattern (path.Match syntax: *, ?, [a-z])", g)
		}
	}
	if s.Filter != "" {
		if _, err := celfilter.Compile(s.Filter); err != nil {
			v.fail(p+".filter", "%q: %v (docs/sinks.md, \"Filters\")", s.Filter, err)
		}
	}
	v.tls(p, s)
	v.format(p, s)
	if r := s.RateLimit; r.On() {
		if !(r.PerSecond > 0) {
			v.fail(p+".rate_limit.per_second", "must be greater than zero (events per second), got %g", r.PerSecond)
		}
		v.atLeast(p+".rate_limit.burst", r.Burst, 1)
	}
	switch s.Type {
	case SinkWebhook:
		v.webhook(p, s)
		v.otherType(p, reflect.ValueOf(s.NATS), s.Type)
	case SinkNATS:
		v.nats(p, s)
		v.otherType(p, reflect.ValueOf(s.Webhook), s.Type)
	case "":
		v.fail(p+".type", "is required (webhook or nats)")
	default:
		oneOf(v, p+".type", s.Type, s.Type.choices())
	}
}

// format checks a sink's format and its cloudevents section.
func (v *validator) format(p string, s *SinkConfig) {
	oneOf(v, p+".format", s.Format, s.Format.choices())
	src := s.CloudEvents.Source
	switch {
	case src == "":
	case s.Format != FormatCloudEvents:
		v.fail(p+".cloudevents.source", "is only used with format: cloudevents")
	case !isPrintable(src) || strings.TrimSpace(src) != src:
		v.fail(p+".cloudevents.source", "%q must be printable, without surrounding spaces", src)
	default:
		if _, err := url.Parse(src); err != nil {
			v.fail(p+".cloudevents.source", "%q is not a URI-reference (a CloudEvents source is one, e.g. /shop/orders or urn:shop:orders)", src)
		}
	}
	if s.Format == FormatCloudEvents && s.Type == SinkWebhook && s.Webhook.Body == BodyNudge {
		v.fail(p+".body", "nudge cannot be combined with format: cloudevents, whose body is the event's payload")
	}
}

// tls checks a sink's tls section: it must be used, and its files must
// load.
func (v *validator) tls(p string, s *SinkConfig) {
	if s.TLS.IsZero() {
		return
	}
	switch {
	case s.Type == SinkWebhook && !strings.HasPrefix(strings.ToLower(s.URL), "https://"):
		v.fail(p+".tls", "is only used with an https:// url")
		return
	case s.Type == SinkNATS && s.URL == "":
		v.fail(p+".tls", "is not used by the embedded NATS server (url is empty)")
		return
	}
	if _, key, err := s.TLS.build(); err != nil {
		v.fail(p+".tls."+key, "%v", err)
	}
}

// otherType reports each setting of the other sink type that is set: it
// would be ignored, which is almost certainly not what was meant.
func (v *validator) otherType(p string, part reflect.Value, typ SinkType) {
	for _, f := range fieldsOf(part.Type()) {
		if !part.FieldByIndex(f.index).IsZero() {
			v.fail(p+"."+f.name, "is not valid for a %s sink", typ)
		}
	}
}

func (v *validator) webhook(p string, s *SinkConfig) {
	w := s.Webhook
	if s.URL == "" {
		v.fail(p+".url", "is required for a webhook sink")
	} else if strings.Contains(s.URL, "{{") {
		if err := webhook.CheckURL(s.URL); err != nil {
			v.fail(p+".url", "%s: %v (docs/sinks.md, \"Routing by field\")", redactURL(s.URL), err)
		} else if w.Batch.MaxEvents > 0 {
			v.fail(p+".url", "with {{ }} cannot be combined with batch.max_events: a batch is one request, to one URL")
		}
	} else if u, err := url.Parse(s.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		// Not err's text: it would print the URL's password.
		v.fail(p+".url", "%s is not an absolute http:// or https:// URL", redactURL(s.URL))
	}
	v.positive(p+".timeout", w.Timeout)
	v.atLeast(p+".concurrency", w.Concurrency, 1)
	v.auth(p+".auth", w.Auth)
	for _, name := range slices.Sorted(maps.Keys(w.Headers)) {
		value := w.Headers[name]
		if !isHeaderName(name) {
			v.fail(p+".headers", "%q is not a valid header name", name)
		}
		if strings.ContainsAny(value, "\r\n\x00") {
			v.fail(p+".headers."+name, "must not contain line breaks or NUL")
		}
	}
	oneOf(v, p+".body", w.Body, w.Body.choices())
	oneOf(v, p+".on_unknown", w.OnUnknown, w.OnUnknown.choices())
	if w.MaxBody <= 0 {
		v.fail(p+".max_body", "must be greater than zero, got %s", w.MaxBody)
	}
	v.batch(p+".batch", s)
	if q := w.ReceiverQuery; q != "" && !strings.Contains(q, "$1") {
		v.fail(p+".receiver_query", "must use $1, the text[] of event keys to look up (SELECT event_key FROM n8n_processed_events WHERE event_key = ANY($1) AND done_at IS NOT NULL)")
	}
	for i, code := range w.PermanentStatuses {
		switch {
		case code < 400 || code > 599:
			v.fail(fmt.Sprintf("%s.permanent_statuses[%d]", p, i), "%d is not an HTTP error status (400-599)", code)
		case code == 401 || code == 403:
			// Sink-level: a credentials problem must open the circuit, not
			// dead-letter every event.
			v.fail(fmt.Sprintf("%s.permanent_statuses[%d]", p, i), "%d means the sink's credentials are wrong; it opens the sink's circuit and cannot be permanent", code)
		}
	}
}

// maxBatchEvents bounds batch.max_events: a batch is one request, and one
// n8n execution, so a bigger one only lengthens the request past its timeout.
const maxBatchEvents = 1000

// batch checks a webhook sink's batch section (docs/sinks.md "Batched
// delivery").
func (v *validator) batch(p string, s *SinkConfig) {
	b := s.Webhook.Batch
	switch {
	case b.MaxEvents < 0 || b.MaxEvents > maxBatchEvents:
		v.fail(p+".max_events", "must be between 0 (off) and %d, got %d", maxBatchEvents, b.MaxEvents)
	case b.MaxEvents > 0 && s.Format == FormatCloudEvents:
		v.fail(p+".max_events", "batching cannot be combined with format: cloudevents: its binary mode carries one event per request, in headers")
	}
	if b.MaxEvents > 0 {
		v.positive(p+".max_wait", b.MaxWait)
	} else if b.Ordered {
		v.fail(p+".ordered", "needs max_events: it says how the receiver applies a batch, and the sink does not batch")
	}
}

func (v *validator) auth(p string, a AuthConfig) {
	set := map[string]bool{
		"secret": a.Secret != "", "secret_file": a.SecretFile != "",
		"header": a.Header != "",
		"value":  a.Value != "", "value_file": a.ValueFile != "",
		"username": a.Username != "",
		"password": a.Password != "", "password_file": a.PasswordFile != "",
	}
	var used []string
	switch a.Type {
	case AuthNone:
	case AuthJWT, AuthStandardWebhooks:
		used = []string{"secret", "secret_file"}
		if !set["secret"] && !set["secret_file"] && !v.sinkSecretsOptional {
			v.fail(p+".secret", "is required for auth type %s (or secret_file)", a.Type)
		}
		if a.Type == AuthStandardWebhooks {
			// Several secrets, separated by spaces, rotate the key.
			for _, secret := range strings.Fields(a.Secret.Reveal()) {
				if rest, ok := strings.CutPrefix(secret, "whsec_"); ok {
					if _, err := base64.StdEncoding.DecodeString(rest); err != nil {
						v.fail(p+".secret", "a whsec_ secret must be base64 after the prefix")
					}
				}
			}
		}
	case AuthHeader:
		used = []string{"header", "value", "value_file"}
		if !set["header"] {
			v.fail(p+".header", "is required for auth type header: the header's name")
		} else if !isHeaderName(a.Header) {
			v.fail(p+".header", "%q is not a valid header name", a.Header)
		}
		if !set["value"] && !set["value_file"] && !v.sinkSecretsOptional {
			v.fail(p+".value", "is required for auth type header (or value_file)")
		}
	case AuthBasic:
		used = []string{"username", "password", "password_file"}
		if !set["username"] {
			v.fail(p+".username", "is required for auth type basic")
		} else if strings.Contains(a.Username, ":") {
			v.fail(p+".username", "must not contain a colon (RFC 7617)")
		}
		if !set["password"] && !set["password_file"] && !v.sinkSecretsOptional {
			v.fail(p+".password", "is required for auth type basic (or password_file)")
		}
	default:
		oneOf(v, p+".type", a.Type, a.Type.choices())
		return
	}
	for _, f := range fieldsOf(reflect.TypeFor[AuthConfig]()) {
		if set[f.name] && !slices.Contains(used, f.name) {
			v.fail(p+"."+f.name, "is not used by auth type %s", a.Type)
		}
	}
}

func (v *validator) nats(p string, s *SinkConfig) {
	n := s.NATS
	if s.URL != "" {
		for _, part := range strings.Split(s.URL, ",") {
			part = strings.TrimSpace(part)
			u, err := url.Parse(part)
			if err != nil || !slices.Contains([]string{"nats", "tls", "ws", "wss"}, u.Scheme) || u.Host == "" {
				v.fail(p+".url", "%s is not a nats://, tls://, ws:// or wss:// URL (leave url empty for the embedded server)", redactURL(part))
			}
		}
	}
	if n.Subject == "" {
		v.fail(p+".subject", "must not be empty")
	} else if err := natssink.CheckSubject(n.Subject); err != nil {
		v.fail(p+".subject", "invalid template: %v", err)
	}
	sp := p + ".stream"
	if n.Stream.Name == "" {
		v.fail(sp+".name", "must not be empty")
	} else if strings.ContainsFunc(n.Stream.Name, func(r rune) bool {
		return strings.ContainsRune(".*>/\\", r) || unicode.IsSpace(r) || !unicode.IsPrint(r)
	}) {
		v.fail(sp+".name", "%q may not contain spaces, '.', '*', '>', '/' or '\\'", n.Stream.Name)
	}
	if len(n.Stream.Subjects) == 0 {
		v.fail(sp+".subjects", "must list at least one subject")
	}
	for i, subj := range n.Stream.Subjects {
		if subj == "" || strings.ContainsFunc(subj, unicode.IsSpace) {
			v.fail(fmt.Sprintf("%s.subjects[%d]", sp, i), "%q is not a NATS subject", subj)
		}
	}
	v.positive(sp+".duplicate_window", n.Stream.DuplicateWindow)
	if n.Stream.MaxMsgSize < 0 || n.Stream.MaxMsgSize > math.MaxInt32 {
		v.fail(sp+".max_msg_size", "must be between 0 (server default) and 2GiB, got %s", n.Stream.MaxMsgSize)
	}
	v.atLeast(p+".max_pending", n.MaxPending, 1)
	if n.MsgIDPrefix != "" {
		if err := (natssink.Deployment{ID: n.MsgIDPrefix}).Validate(); err != nil {
			v.fail(p+".msg_id_prefix", "%v", err)
		}
	}
}

func (v *validator) listen(p, addr string) {
	_, port, err := net.SplitHostPort(addr)
	if err == nil {
		var n int
		n, err = strconv.Atoi(port)
		if err == nil && (n < 0 || n > 65535) {
			err = errors.New("port out of range")
		}
	}
	if err != nil {
		v.fail(p, "%q is not host:port (127.0.0.1:9187, :9187, [::1]:9187)", addr)
	}
}

func isPrintable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// isHeaderName reports whether s is an HTTP token (RFC 9110 section 5.6.2).
func isHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if !(r < utf8.RuneSelf && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' ||
			strings.ContainsRune("!#$%&'*+-.^_`|~", r))) {
			return false
		}
	}
	return true
}

// minAdminToken is the shortest admin token accepted: the API acts on the
// outbox, so its token must not be guessable (openssl rand -hex 32 makes
// one).
const minAdminToken = 16

// adminTokens checks the admin API's tokens: printable, without spaces,
// long enough, and each distinct from the others (the metrics token is
// often handed to a scraper; the read-only token must not act).
func (v *validator) adminTokens(h HTTPConfig) {
	admin, read, metrics := h.AdminToken.Reveal(), h.AdminReadToken.Reveal(), h.MetricsToken.Reveal()
	for _, t := range []struct{ key, token string }{{"http.admin_token", admin}, {"http.admin_read_token", read}} {
		switch {
		case t.token == "":
		case strings.ContainsFunc(t.token, func(r rune) bool { return unicode.IsSpace(r) || !unicode.IsPrint(r) }):
			v.fail(t.key, "must be printable, without spaces")
		case len(t.token) < minAdminToken:
			v.fail(t.key, "must be at least %d characters (openssl rand -hex 32 makes one)", minAdminToken)
		case t.token == metrics:
			v.fail(t.key, "must differ from http.metrics_token: a scraper holding the metrics token must not reach the admin API")
		}
	}
	switch {
	case read != "" && admin == "":
		v.fail("http.admin_read_token", "needs http.admin_token: without it the admin API and the console are off")
	case read != "" && read == admin:
		v.fail("http.admin_read_token", "must differ from http.admin_token: the read-only token must not act")
	}
}
