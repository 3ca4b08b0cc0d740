package webhook

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Defaults applied by New to zero Config fields.
const (
	DefaultTimeout     = 10 * time.Second
	DefaultConcurrency = 8
	// DefaultMaxBody is n8n's default payload cap (N8N_PAYLOAD_SIZE_MAX).
	DefaultMaxBody int64 = 16 << 20
)

// DefaultPermanentStatuses returns the statuses that dead-letter an event
// when Config.PermanentStatuses is nil.
func DefaultPermanentStatuses() []int {
	return []int{http.StatusBadRequest, http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType, http.StatusUnprocessableEntity}
}

// Formats: what a request carries.
const (
	// FormatEnvelope (or empty) posts Delivery.Body, the envelope or nudge.
	FormatEnvelope = "envelope"
	// FormatCloudEvents posts a CloudEvent in the binary content mode: the
	// event's payload as the body, its attributes as ce- headers
	// (relay.CloudEventsHeaders).
	FormatCloudEvents = "cloudevents"
)

// Auth types.
const (
	AuthNone             = "none"
	AuthJWT              = "jwt"
	AuthHeader           = "header"
	AuthBasic            = "basic"
	AuthStandardWebhooks = "standard-webhooks"
)

// Auth says how requests authenticate.
type Auth struct {
	// Type is AuthNone (or empty), AuthJWT, AuthHeader, AuthBasic or
	// AuthStandardWebhooks.
	Type string
	// Secret is the HS256 key (jwt) or the signing secret
	// (standard-webhooks; a "whsec_" secret is base64-decoded).
	Secret string
	// Header and Value form the header sent for type header.
	Header, Value string
	// Username and Password are sent for type basic.
	Username, Password string
}

// Config configures a Sink. Zero fields take the documented defaults.
type Config struct {
	// Name is the sink's name, the ledger's action. Required.
	Name string
	// URL is the absolute http:// or https:// endpoint. Required.
	URL string
	// Timeout bounds one request, from dialling to reading the response
	// body (default 10s).
	Timeout time.Duration
	// Concurrency is the most requests in flight at once, and the size of
	// the keep-alive pool (default 8).
	Concurrency int
	// Headers are sent on every request. They may not replace the headers
	// the sink sets itself (Content-Type, the id, timestamp, signature and
	// attempt headers, or the auth header).
	Headers map[string]string
	Auth    Auth
	// Format is FormatEnvelope (or empty) or FormatCloudEvents, which
	// cannot be combined with Nudge.
	Format string
	// CloudEventsSource is ce-source, required with FormatCloudEvents.
	CloudEventsSource string
	// MaxBody is the largest body sent; a larger one is a PermanentError
	// without a request (default 16 MiB).
	MaxBody int64
	// PermanentStatuses are the 4xx/5xx statuses that dead-letter an event
	// (default 400, 413, 415, 422). 401 and 403 are sink-level and may not be
	// listed.
	PermanentStatuses []int
	// Treat409AsDelivered counts a 409 as delivered; by default a 409 is an
	// Idempotency-Key receiver still processing the original request, and
	// is retried.
	Treat409AsDelivered bool
	// Batch, when MaxEvents > 0, sends up to MaxEvents events per request
	// (docs/sinks.md "Batched delivery"). It cannot be combined with
	// FormatCloudEvents.
	Batch Batch
	// TLS configures https connections; nil uses the system roots.
	TLS *tls.Config
	// Logger receives debug lines per request (never bodies or secrets).
	Logger zerolog.Logger
}

// Batch configures batched delivery.
type Batch struct {
	// MaxEvents is the most events in one request; 0 turns batching off
	// (one event per request, its body as it is).
	MaxEvents int
	// MaxWait is how long the first event of a batch waits for more
	// (default DefaultBatchWait).
	MaxWait time.Duration
	// Ordered declares that the receiver applies a batch's events in order
	// and, for each aggregate, applies none after the first it does not
	// apply: a batch may then carry several events of one aggregate, in
	// commit order (docs/sinks.md "Ordered batches"). It needs MaxEvents.
	Ordered bool
}

// DefaultBatchWait is Batch.MaxWait's default.
const DefaultBatchWait = 10 * time.Millisecond

// New validates cfg and returns a Sink. It makes no request. With
// batching on it starts the goroutine that gathers batches, which Close
// stops.
func New(cfg Config) (*Sink, error) {
	if cfg.Name == "" {
		return nil, errors.New("webhook sink: name is required")
	}
	fail := func(format string, args ...any) (*Sink, error) {
		return nil, fmt.Errorf("webhook sink %q: "+format, append([]any{cfg.Name}, args...)...)
	}
	if err := CheckURL(cfg.URL); err != nil {
		return fail("%v", err)
	}
	urlTmpl, _ := parseURLTemplate(cfg.URL)
	if urlTmpl != nil && cfg.Batch.MaxEvents > 0 {
		return fail("a url with {{ }} cannot batch: a batch is one request, to one URL")
	}
	if cfg.Timeout < 0 || cfg.Concurrency < 0 || cfg.MaxBody < 0 {
		return fail("timeout, concurrency and max_body must not be negative")
	}
	reserved := []string{"Content-Type", "Content-Length", "Transfer-Encoding", "Connection", "Host",
		"Idempotency-Key", "Webhook-Id", "Webhook-Timestamp", "Webhook-Signature", "Webhook-Attempt", "Outbox-Event-Key",
		"Traceparent", "Tracestate", "Outbox-Batch-Size"}
	if cfg.Batch.MaxEvents < 0 || cfg.Batch.MaxWait < 0 {
		return fail("batch max_events and max_wait must not be negative")
	}
	if cfg.Batch.Ordered && cfg.Batch.MaxEvents == 0 {
		return fail("batch.ordered needs batch.max_events: it says how the receiver applies a batch")
	}
	if cfg.Batch.MaxEvents > 0 && cfg.Format == FormatCloudEvents {
		return fail("batch.max_events: batching cannot be combined with format cloudevents, whose binary mode carries one event per request")
	}
	switch cfg.Format {
	case "", FormatEnvelope:
		if cfg.CloudEventsSource != "" {
			return fail("a CloudEvents source is only used with format cloudevents")
		}
	case FormatCloudEvents:
		if cfg.CloudEventsSource == "" {
			return fail("format cloudevents needs a source (ce-source)")
		}
		// The attributes the sink sets; other ce- headers configured are
		// extension attributes, sent as they are.
		reserved = append(reserved, "Ce-Specversion", "Ce-Id", "Ce-Source", "Ce-Type", "Ce-Subject", "Ce-Time")
	default:
		return fail("format %q is not one of envelope, cloudevents", cfg.Format)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.MaxBody == 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	if cfg.PermanentStatuses == nil {
		cfg.PermanentStatuses = DefaultPermanentStatuses()
	}
	s := &Sink{
		name:      cfg.Name,
		url:       cfg.URL,
		urlTmpl:   urlTmpl,
		ceSource:  cfg.CloudEventsSource,
		maxBody:   cfg.MaxBody,
		permanent: make(map[int]bool, len(cfg.PermanentStatuses)),
		treat409:  cfg.Treat409AsDelivered,
		headers:   make(http.Header, len(cfg.Headers)),
		auth:      cfg.Auth,
		log:       cfg.Logger.With().Str("sink", cfg.Name).Logger(),
		slots:     make(chan struct{}, cfg.Concurrency),
		jobs:      make(chan job, cfg.Concurrency),
		closing:   make(chan struct{}),
		drained:   make(chan struct{}),
	}
	// The workers run until Close, whatever the context of the Sends.
	var workersCtx context.Context
	s.workers, workersCtx = relay.NewGroup(context.Background())
	s.stopped = workersCtx.Done()
	for _, code := range cfg.PermanentStatuses {
		switch {
		case code < 400 || code > 599:
			return fail("permanent status %d is not an HTTP error status (400-599)", code)
		case code == http.StatusUnauthorized || code == http.StatusForbidden:
			return fail("permanent status %d is sink-level (credentials): it opens the circuit instead", code)
		}
		s.permanent[code] = true
	}

	switch cfg.Auth.Type {
	case "", AuthNone:
		s.auth.Type = AuthNone
	case AuthJWT:
		if cfg.Auth.Secret == "" {
			return fail("auth type jwt needs a secret")
		}
		reserved = append(reserved, "Authorization")
	case AuthStandardWebhooks:
		// Several secrets separated by spaces rotate a key without a gap:
		// the request carries one signature per secret, and Standard
		// Webhooks receivers accept any signature that verifies.
		for _, secret := range strings.Fields(cfg.Auth.Secret) {
			key, err := signingKey(secret)
			if err != nil {
				return fail("auth type standard-webhooks: %v", err)
			}
			s.signKeys = append(s.signKeys, key)
		}
		if len(s.signKeys) == 0 {
			return fail("auth type standard-webhooks needs a secret")
		}
	case AuthHeader:
		if !validHeaderName(cfg.Auth.Header) || cfg.Auth.Value == "" {
			return fail("auth type header needs a valid header name and a value")
		}
		if !validHeaderValue(cfg.Auth.Value) {
			return fail("auth header value must not contain line breaks or NUL")
		}
		name := http.CanonicalHeaderKey(cfg.Auth.Header)
		if slices.Contains(reserved, name) {
			return fail("auth header %s is set by the sink itself", name)
		}
		s.auth.Header = name
		reserved = append(reserved, name)
	case AuthBasic:
		if cfg.Auth.Username == "" || strings.Contains(cfg.Auth.Username, ":") {
			return fail("auth type basic needs a username without a colon")
		}
		reserved = append(reserved, "Authorization")
	default:
		return fail("auth type %q is not one of none, jwt, header, basic, standard-webhooks", cfg.Auth.Type)
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.Headers)) {
		value := cfg.Headers[name]
		if !validHeaderName(name) {
			return fail("header %q is not a valid header name", name)
		}
		if !validHeaderValue(value) {
			return fail("header %s must not contain line breaks or NUL", name)
		}
		if slices.Contains(reserved, http.CanonicalHeaderKey(name)) {
			return fail("header %s is set by the sink itself", http.CanonicalHeaderKey(name))
		}
		s.headers.Set(name, value)
	}

	// One HTTP/1.1 keep-alive pool per sink, sized to its concurrency.
	// HTTP/2 is off: the written/not-written analysis above the transport
	// (and the re-send rules it relies on) is HTTP/1.1's, n8n serves
	// HTTP/1.1, and one connection per request in flight is what the
	// concurrency bound means.
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	dialer := &net.Dialer{Timeout: cfg.Timeout, KeepAlive: 30 * time.Second}
	s.transport = &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         dialer.DialContext,
		TLSClientConfig:     cfg.TLS.Clone(),
		TLSHandshakeTimeout: cfg.Timeout,
		MaxIdleConns:        cfg.Concurrency,
		MaxIdleConnsPerHost: cfg.Concurrency,
		IdleConnTimeout:     idleConnTimeout,
		DisableCompression:  true,
		Protocols:           protocols,
	}
	s.client = &http.Client{
		Transport: s.transport,
		Timeout:   cfg.Timeout,
		// A redirect is not followed: following it would re-send the POST
		// (or turn it into a GET). The 3xx is returned and is transient.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	s.reqCtx, s.cancelReqs = context.WithCancel(context.Background())
	if cfg.Batch.MaxEvents > 0 {
		s.batchMax, s.batchWait = cfg.Batch.MaxEvents, cfg.Batch.MaxWait
		if s.batchWait == 0 {
			s.batchWait = DefaultBatchWait
		}
		s.batchOrdered = cfg.Batch.Ordered
		s.pending = make(chan []batchItem, s.batchMax)
		s.workers.Go("batch assembler", s.assemble)
	}
	return s, nil
}

// validHeaderName reports whether name is an RFC 9110 token.
func validHeaderName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

func validHeaderValue(v string) bool { return !strings.ContainsAny(v, "\r\n\x00") }
