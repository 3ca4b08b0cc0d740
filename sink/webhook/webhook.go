package webhook

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/golang-jwt/jwt/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

var _ relay.Sink = (*Sink)(nil)

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
	// TLS configures https connections; nil uses the system roots.
	TLS *tls.Config
	// Logger receives debug lines per request (never bodies or secrets).
	Logger zerolog.Logger
}

// ErrClosed is the cause of the SinkDownError a Send on a closed Sink
// reports.
var ErrClosed = errors.New("webhook sink closed")

const (
	// jwtLifetime is how long a per-request JWT is valid.
	jwtLifetime = 5 * time.Minute
	// maxRetryAfter caps a receiver's Retry-After.
	maxRetryAfter = time.Hour
	// headLimit is how much of an error response is read to classify it
	// and quote it; excerptLimit is how much of that is quoted.
	headLimit    = 4 << 10
	excerptLimit = 512
	// drainLimit is how much of a response body is read so its connection
	// can be reused; a longer body closes the connection instead.
	drainLimit = 64 << 10
	// idleConnTimeout is below Node.js's default 5 s keepAliveTimeout (n8n
	// runs on Node), so the relay does not reuse a connection the receiver
	// is about to close, which would turn the request's outcome unknown.
	idleConnTimeout = 4 * time.Second
	userAgent       = "outbox-relay"
)

// Sink posts deliveries to one webhook URL. It is safe for concurrent use.
type Sink struct {
	name      string
	url       string
	ceSource  string // ce-source; "" unless the format is cloudevents
	maxBody   int64
	permanent map[int]bool
	treat409  bool
	headers   http.Header
	auth      Auth
	signKeys  [][]byte // standard-webhooks: one signature each (rotation)
	log       zerolog.Logger

	transport *http.Transport
	client    *http.Client

	// slots holds one token per request in flight.
	slots chan struct{}
	// reqCtx is the parent of every request; Close cancels it when its
	// deadline passes with requests still in flight.
	reqCtx     context.Context
	cancelReqs context.CancelFunc

	mu        sync.Mutex // guards closed and inflight.Add
	closed    bool
	closing   chan struct{}
	closeOnce sync.Once
	inflight  sync.WaitGroup
}

// New validates cfg and returns a Sink. It makes no request.
func New(cfg Config) (*Sink, error) {
	if cfg.Name == "" {
		return nil, errors.New("webhook sink: name is required")
	}
	fail := func(format string, args ...any) (*Sink, error) {
		return nil, fmt.Errorf("webhook sink %q: "+format, append([]any{cfg.Name}, args...)...)
	}
	u, err := url.Parse(cfg.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		// Not err's text: it would print the URL's password.
		return fail("url is not an absolute http:// or https:// URL")
	}
	if cfg.Timeout < 0 || cfg.Concurrency < 0 || cfg.MaxBody < 0 {
		return fail("timeout, concurrency and max_body must not be negative")
	}
	reserved := []string{"Content-Type", "Content-Length", "Transfer-Encoding", "Connection", "Host",
		"Idempotency-Key", "Webhook-Id", "Webhook-Timestamp", "Webhook-Signature", "Webhook-Attempt", "Outbox-Event-Key",
		"Traceparent", "Tracestate"}
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
		ceSource:  cfg.CloudEventsSource,
		maxBody:   cfg.MaxBody,
		permanent: make(map[int]bool, len(cfg.PermanentStatuses)),
		treat409:  cfg.Treat409AsDelivered,
		headers:   make(http.Header, len(cfg.Headers)),
		auth:      cfg.Auth,
		log:       cfg.Logger.With().Str("sink", cfg.Name).Logger(),
		slots:     make(chan struct{}, cfg.Concurrency),
		closing:   make(chan struct{}),
	}
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
	return s, nil
}

// Name returns the sink's configured name.
func (s *Sink) Name() string { return s.name }

// Send posts d.Body (with format cloudevents, the event's payload and its
// attributes) and calls done exactly once with the outcome: nil on a
// 2xx (or a 409 with Treat409AsDelivered), otherwise an error classified by
// relay.Classify.
//
// Send blocks while Concurrency requests are in flight, until a slot frees,
// ctx is done, or the sink is closed. It calls done on the calling
// goroutine, without a request, when ctx is already done or ends while
// waiting (TransientError wrapping ctx's error), when the sink is closed
// (SinkDownError wrapping ErrClosed), when the body is over MaxBody, when
// the event key is empty (PermanentError, wrapping relay.ErrEmptyEventKey)
// and, with format cloudevents, when the event has no type (PermanentError,
// wrapping relay.ErrNoEventType).
// Otherwise the request runs on its own goroutine, which calls done; ctx no
// longer affects it (Close does).
//
// Sending the same Delivery again is safe: the id and body are the same.
func (s *Sink) Send(ctx context.Context, d *relay.Delivery, done func(error)) {
	if d.Event.EventKey == "" {
		done(relay.PermanentError(fmt.Errorf("webhook %s: event %d: %w", s.name, d.Event.ID, relay.ErrEmptyEventKey)))
		return
	}
	if err := ctx.Err(); err != nil {
		done(relay.TransientError(fmt.Errorf("webhook %s: not sent: %w", s.name, err), 0))
		return
	}
	body := d.Body
	var ce []relay.Header
	if s.ceSource != "" {
		body = relay.CloudEventsData(d.Event)
		var err error
		if ce, err = relay.CloudEventsHeaders(d.Event, IdempotencyKey(d.Event.EventKey, d.Replay), s.ceSource); err != nil {
			done(relay.PermanentError(fmt.Errorf("webhook %s: event %q: %w", s.name, d.Event.EventKey, err)))
			return
		}
	}
	if n := int64(len(body)); n > s.maxBody {
		done(relay.PermanentError(fmt.Errorf("webhook %s: event %q: body is %d bytes, over the sink's max_body of %d bytes",
			s.name, d.Event.EventKey, n, s.maxBody)))
		return
	}
	if len(body) == 0 {
		// An empty POST counts as replayable to net/http, which would then
		// re-send it on its own; the engine never builds one.
		done(relay.PermanentError(fmt.Errorf("webhook %s: event %q: empty body", s.name, d.Event.EventKey)))
		return
	}
	select {
	case s.slots <- struct{}{}:
	case <-ctx.Done():
		done(relay.TransientError(fmt.Errorf("webhook %s: not sent, waiting for a free slot: %w", s.name, ctx.Err()), 0))
		return
	case <-s.closing:
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, ErrClosed), 0))
		return
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		<-s.slots
		done(relay.SinkDownError(fmt.Errorf("webhook %s: %w", s.name, ErrClosed), 0))
		return
	}
	s.inflight.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.inflight.Done()
		err := s.post(d, body, ce)
		<-s.slots
		done(err)
	}()
}

// Close stops accepting Sends (later ones report ErrClosed), waits for the
// requests in flight to call done until ctx is done, then aborts the rest
// (their done reports Unknown or Transient, by whether they were written)
// and waits for those callbacks. It returns ctx's error when it had to
// abort. Calling Close again is safe.
func (s *Sink) Close(ctx context.Context) error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		close(s.closing)
		s.mu.Unlock()
	})
	finished := make(chan struct{})
	go func() {
		s.inflight.Wait()
		close(finished)
	}()
	var err error
	select {
	case <-finished:
	case <-ctx.Done():
		err = fmt.Errorf("webhook %s: close: requests still in flight: %w", s.name, ctx.Err())
		s.cancelReqs()
		<-finished
	}
	s.cancelReqs()
	s.transport.CloseIdleConnections()
	return err
}

// writeTrace records the connection and WroteRequest events of one
// request.
type writeTrace struct {
	mu       sync.Mutex
	wrote    bool
	writeErr error
	// dialing is set while a dial for the request has started and not
	// connected; gotConn once the request has a connection.
	dialing, gotConn bool
}

func (w *writeTrace) connectStart(string, string) {
	w.mu.Lock()
	w.dialing = true
	w.mu.Unlock()
}

func (w *writeTrace) connectDone(_, _ string, err error) {
	if err == nil {
		w.mu.Lock()
		w.dialing = false
		w.mu.Unlock()
	}
}

func (w *writeTrace) gotConnection(httptrace.GotConnInfo) {
	w.mu.Lock()
	w.gotConn = true
	w.mu.Unlock()
}

// dialTimedOut reports whether err is the request's deadline passing while
// its only dial had not connected: the receiver never answered the SYN.
func (w *writeTrace) dialTimedOut(err error) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.dialing || w.gotConn {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	ne, ok := errors.AsType[net.Error](err)
	return ok && ne.Timeout()
}

func (w *writeTrace) wroteRequest(info httptrace.WroteRequestInfo) {
	w.mu.Lock()
	w.wrote, w.writeErr = true, info.Err
	w.mu.Unlock()
}

func (w *writeTrace) result() (bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.wrote, w.writeErr
}

// post makes one request for d with body and, with format cloudevents, the
// attribute headers ce, and returns its classified outcome.
func (s *Sink) post(d *relay.Delivery, body []byte, ce []relay.Header) error {
	key := d.Event.EventKey
	id := IdempotencyKey(key, d.Replay)
	now := time.Now()
	ts := strconv.FormatInt(now.Unix(), 10)

	trace := &writeTrace{}
	ctx := httptrace.WithClientTrace(s.reqCtx, &httptrace.ClientTrace{
		ConnectStart: trace.connectStart,
		ConnectDone:  trace.connectDone,
		GotConn:      trace.gotConnection,
		WroteRequest: trace.wroteRequest,
	})
	// A *bytes.Reader: net/http knows it is in memory and writes the
	// headers and the body in one write (another reader type costs a
	// second write system call per request).
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url, bytes.NewReader(body))
	if err != nil {
		return relay.SinkDownError(fmt.Errorf("webhook %s: build request: %w", s.name, err), 0)
	}
	req.ContentLength = int64(len(body))
	// With GetBody nil net/http treats the POST as not replayable, despite
	// its Idempotency-Key, and never re-sends it on a reused connection
	// that closed after the write: a written request with no answer must
	// reach the engine as Unknown, not be repeated behind its back.
	req.GetBody = nil

	h := req.Header
	for name, values := range s.headers {
		h[name] = values
	}
	if h.Get("User-Agent") == "" {
		h.Set("User-Agent", userAgent)
	}
	h.Set("Content-Type", "application/json")
	h.Set("Idempotency-Key", id)
	h.Set("Webhook-Id", id)
	h.Set("Webhook-Timestamp", ts)
	h.Set("Webhook-Attempt", strconv.Itoa(d.Attempt))
	if headerSafe(key) {
		h.Set("Outbox-Event-Key", key)
	}
	// The producer's trace context, as stored: the same on every attempt.
	if tc := d.Event.Trace; tc.Traceparent != "" {
		h.Set("Traceparent", tc.Traceparent)
		if tc.Tracestate != "" {
			h.Set("Tracestate", tc.Tracestate)
		}
	}
	for _, a := range ce {
		h.Set(a.Name, a.Value)
	}
	switch s.auth.Type {
	case AuthStandardWebhooks:
		sigs := make([]string, len(s.signKeys))
		for i, key := range s.signKeys {
			sigs[i] = sign(key, id, ts, body)
		}
		h.Set("Webhook-Signature", strings.Join(sigs, " "))
	case AuthJWT:
		token, err := jwt.NewWithClaims(jwt.SigningMethodHS256, jwt.MapClaims{
			"event_key": key,
			"iat":       now.Unix(),
			"exp":       now.Add(jwtLifetime).Unix(),
		}).SignedString([]byte(s.auth.Secret))
		if err != nil {
			return relay.SinkDownError(fmt.Errorf("webhook %s: sign JWT: %w", s.name, err), 0)
		}
		h.Set("Authorization", "Bearer "+token)
	case AuthHeader:
		h.Set(s.auth.Header, s.auth.Value)
	case AuthBasic:
		req.SetBasicAuth(s.auth.Username, s.auth.Password)
	}

	resp, err := s.client.Do(req)
	took := time.Since(now)
	if err != nil {
		if errors.As(err, new(*url.Error)) {
			// url.Error repeats the URL, whose query may hold a token.
			err = errors.Unwrap(err)
		}
		wrote, writeErr := trace.result()
		event := s.log.Debug().Str("event_key", key).Int("attempt", d.Attempt).Dur("took", took).Err(err)
		if tlsRefused(err) {
			// The handshake failed, so no request reached the receiver,
			// even when (TLS 1.3) the client had already sent it before
			// the server refused its certificate. Every event would fail
			// alike: a sink-level failure.
			event.Msg("webhook TLS handshake failed")
			return relay.SinkDownError(fmt.Errorf("webhook %s: TLS handshake failed: %w: check the sink's tls settings (ca_file, cert_file, key_file) and the receiver's certificate", s.name, err), 0)
		}
		// The client's timeout, equal to the dialer's, usually ends a
		// dial that never completes before the dialer does, so the error
		// is the client's, not the dial's: the trace tells.
		if unreachable(err) || trace.dialTimedOut(err) {
			// No connection, so nothing was sent; and the host does not
			// resolve, refuses or does not answer for every event alike:
			// a sink-level failure, which must not use up the events'
			// max_attempts while the receiver or its DNS is down.
			event.Msg("webhook receiver unreachable")
			return relay.SinkDownError(fmt.Errorf("webhook %s: event %q: cannot connect to the receiver: %w: check the sink's url and that the receiver is up", s.name, key, err), 0)
		}
		switch {
		case writeErr != nil:
			event.Msg("webhook request not completely written")
			return relay.TransientError(fmt.Errorf("webhook %s: event %q: request not completely written: %w", s.name, key, err), 0)
		case !wrote:
			// WroteRequest fires once the whole request (Content-Length
			// bytes) is written: before that the receiver cannot have a
			// complete request, so the event is safe to send again.
			event.Msg("webhook request not written")
			return relay.TransientError(fmt.Errorf("webhook %s: event %q: request not written: %w", s.name, key, err), 0)
		default:
			event.Bool("wrote", wrote).Msg("webhook request written, no response")
			return relay.UnknownError(fmt.Errorf("webhook %s: event %q: request written, no response: %w", s.name, key, err))
		}
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
		_ = resp.Body.Close()
	}()
	s.log.Debug().Str("event_key", key).Int("attempt", d.Attempt).Int("status", resp.StatusCode).Dur("took", took).Msg("webhook response")
	return s.outcome(key, resp, now)
}

// tlsRefused reports whether err is a certificate problem of either side: the
// receiver's certificate did not verify, or the receiver refused the
// handshake (typically the client certificate: missing, unknown CA,
// expired).
func tlsRefused(err error) bool {
	if _, ok := errors.AsType[*tls.CertificateVerificationError](err); ok {
		return true
	}
	if _, ok := errors.AsType[x509.UnknownAuthorityError](err); ok {
		return true
	}
	if _, ok := errors.AsType[x509.HostnameError](err); ok {
		return true
	}
	// A received alert is a *net.OpError "remote error" around the tls
	// package's unexported alert type: only its text tells which alert.
	if op, ok := errors.AsType[*net.OpError](err); ok && op.Op == "remote error" && op.Err != nil {
		msg := op.Err.Error()
		for _, alert := range []string{
			"handshake failure", "bad certificate", "unsupported certificate",
			"revoked certificate", "expired certificate", "unknown certificate",
			"access denied", "protocol version not supported", "certificate required",
		} {
			if strings.HasSuffix(msg, "tls: "+alert) || strings.HasSuffix(msg, "tls: "+alert+" authority") {
				return true
			}
		}
	}
	return false
}

// unreachable reports whether err is a failure to connect to the receiver:
// its host does not resolve, or the connection is refused or times out.
// Cancellation by Close is not.
func unreachable(err error) bool {
	op, ok := errors.AsType[*net.OpError](err)
	return ok && op.Op == "dial" && !errors.Is(err, context.Canceled)
}

// n8nStartingUp is the body n8n sends, with status 200, while it starts.
const n8nStartingUp = "n8n is starting up. Please wait"

// outcome classifies a response as the package documentation's table says.
func (s *Sink) outcome(key string, resp *http.Response, now time.Time) error {
	code := resp.StatusCode
	if code >= 200 && code < 300 {
		// n8n answers 200 "n8n is starting up. Please wait" to every request
		// while it migrates its database at start: the workflow did not run,
		// so that answer must not count as delivered.
		head, _ := io.ReadAll(io.LimitReader(resp.Body, int64(len(n8nStartingUp))+8))
		if bytes.Equal(bytes.TrimSpace(head), []byte(n8nStartingUp)) {
			return relay.TransientError(fmt.Errorf("webhook %s: event %q: n8n answered %d %q: it is still starting, the workflow did not run",
				s.name, key, code, n8nStartingUp), time.Second)
		}
		return nil
	}
	var head []byte
	if code >= 400 {
		head, _ = io.ReadAll(io.LimitReader(resp.Body, headLimit))
	}
	retryAfter := parseRetryAfter(resp.Header.Get("Retry-After"), now)
	status := strconv.Itoa(code)
	if text := http.StatusText(code); text != "" {
		status += " " + text
	}
	prefix := fmt.Sprintf("webhook %s: event %q: receiver answered %s", s.name, key, status)
	switch {
	case code == http.StatusUnauthorized || code == http.StatusForbidden:
		return relay.SinkDownError(fmt.Errorf("webhook %s: receiver answered %s: check the sink's credentials (auth type %s)",
			s.name, status, s.auth.Type), retryAfter)
	case code == http.StatusNotFound && bytes.Contains(head, []byte("is not registered")):
		return relay.SinkDownError(fmt.Errorf("webhook %s: receiver answered %s, the n8n webhook is not registered: "+
			"publish (activate) the n8n workflow, and use its production URL (/webhook/…, not /webhook-test/…)",
			s.name, status), retryAfter)
	case code == http.StatusNotFound:
		// The URL does not exist (yet): n8n answers "Cannot POST …" while it
		// registers its webhooks at start, a proxy before the route exists.
		// Every event would get the same answer, so it is the sink's problem,
		// not the event's: open the circuit instead of dead-lettering.
		return relay.SinkDownError(fmt.Errorf("webhook %s: receiver answered %s: %s: check the sink's url (for n8n: the workflow must be published and the URL its production /webhook/… one)",
			s.name, status, excerpt(head)), retryAfter)
	case code == http.StatusConflict && s.treat409:
		return nil
	case s.permanent[code]:
		return relay.PermanentError(fmt.Errorf("%s: %s", prefix, excerpt(head)))
	case code == http.StatusRequestTimeout, code == http.StatusTooEarly, code == http.StatusTooManyRequests,
		code == http.StatusConflict, code >= 500:
		return relay.TransientError(fmt.Errorf("%s: %s", prefix, excerpt(head)), retryAfter)
	case code >= 400:
		// Any other 4xx (405, 410, ...)
		// says the request itself is wrong; repeating it cannot help.
		return relay.PermanentError(fmt.Errorf("%s: %s", prefix, excerpt(head)))
	case code >= 300 && code < 400:
		return relay.TransientError(fmt.Errorf("%s: redirects are not followed, set the sink's url to the final endpoint", prefix), retryAfter)
	default:
		return relay.TransientError(errors.New(prefix), retryAfter)
	}
}

// parseRetryAfter returns the delay a Retry-After value asks for, in either
// form (delta-seconds or HTTP-date), capped at maxRetryAfter; 0 when absent,
// invalid or in the past.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseUint(v, 10, 64); err == nil || errors.Is(err, strconv.ErrRange) {
		if err != nil || secs > uint64(maxRetryAfter/time.Second) {
			return maxRetryAfter
		}
		return time.Duration(secs) * time.Second
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0
	}
	return min(max(t.Sub(now), 0), maxRetryAfter)
}

// excerpt renders the start of a response body as one line: at most
// excerptLimit bytes, invalid UTF-8 replaced, control characters and runs
// of white space turned into single spaces.
func excerpt(b []byte) string {
	truncated := len(b) > excerptLimit
	if truncated {
		cut := excerptLimit
		for cut > 0 && !utf8.RuneStart(b[cut]) {
			cut--
		}
		b = b[:cut]
	}
	s := strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(string(b), "\uFFFD"))
	s = strings.Join(strings.Fields(s), " ")
	if s == "" {
		return "(empty body)"
	}
	if truncated {
		s += " …"
	}
	return s
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
