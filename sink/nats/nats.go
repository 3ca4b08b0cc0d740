// Package nats implements relay.Sink for NATS JetStream.
//
// Each event is published asynchronously to a subject rendered from a
// template over its type and aggregate columns, with Nats-Msg-Id set to its
// event key scoped by the deployment (Deployment.MsgID), so JetStream drops
// a repeat within the stream's duplicate window and never takes another
// deployment's event for one. An event counts as delivered only on its PubAck (a duplicate ack
// included). With no URL the sink runs an embedded server (StartEmbedded).
//
// A PubAck is only as durable as the server's storage policy: nats-server
// acknowledges before fsync by default, so a single server that crashes can
// lose acknowledged messages. Use R3 streams or sync_interval: always; the
// embedded server syncs every write unless told otherwise.
//
// An event with a trace context carries the producer's traceparent and
// tracestate headers. With Format FormatCloudEvents a message is a
// CloudEvent in the binary content mode of the CloudEvents NATS binding: the
// payload as data and ce- headers, ce-id being the Nats-Msg-Id. See
// docs/ecosystem.md.
package nats

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Type is the sink type this package implements, as configured
// (type: nats).
const Type = "nats"

// Formats: what a message carries.
const (
	// FormatEnvelope (or empty) publishes Delivery.Body, the envelope.
	FormatEnvelope = "envelope"
	// FormatCloudEvents publishes a CloudEvent in the binary content mode
	// of the CloudEvents NATS binding: the event's payload as the data, its
	// attributes as ce- headers (relay.CloudEventsHeaders, and
	// ce-datacontenttype).
	FormatCloudEvents = "cloudevents"
)

// Connection liveness settings; see connect.
const (
	pingInterval        = 5 * time.Second
	maxPingsOutstanding = 2
	flusherTimeout      = 10 * time.Second
)

// Defaults applied by New to zero Config fields.
const (
	DefaultMaxPending = 4096
	DefaultAckTimeout = 10 * time.Second
)

// Config configures a Sink. Zero values take the defaults named below.
type Config struct {
	// Name is the sink's name, the ledger's action. Required.
	Name string
	// URL is the server URL (a comma-separated list for a cluster). Empty
	// runs an embedded server under DataDir, owned by the sink.
	URL string
	// Subject is a text/template rendering an event's subject from
	// SubjectFields (EventType, AggregateType, AggregateID, EventKey — never
	// the payload); each field is sanitised into one valid token. Default
	// DefaultSubject.
	Subject string
	Stream  StreamConfig
	// Deployment scopes the message ids to the outbox the sink publishes
	// from. Required.
	Deployment Deployment
	// MaxPending is the async publish window: Send blocks while this many
	// publishes await their PubAck. Default DefaultMaxPending.
	MaxPending int
	// AckTimeout bounds the wait for one PubAck; past it the outcome is
	// unknown. Default DefaultAckTimeout.
	AckTimeout time.Duration
	// Format is FormatEnvelope (or empty) or FormatCloudEvents.
	Format string
	// CloudEventsSource is ce-source, required with FormatCloudEvents.
	CloudEventsSource string
	// Options are extra client options (credentials, token, TLS,
	// reconnect tuning), applied after the sink's own.
	Options []nats.Option
	Logger  zerolog.Logger

	// DataDir holds the embedded server's store (DataDir/nats); used and
	// required only when URL is empty.
	DataDir string
	// SyncAlways makes the embedded server fsync every write before
	// acknowledging it; nil means true. See StartEmbedded.
	SyncAlways *bool
}

// StreamConfig names the JetStream stream the sink publishes into.
type StreamConfig struct {
	// Name of the stream. Default DefaultStreamName.
	Name string
	// Subjects the stream is created with when Create is set; default the
	// subject template's literal prefix followed by ">" ("outbox.>"). An
	// existing stream is never changed.
	Subjects []string
	// DuplicateWindow is the duplicate_window the stream is created with;
	// an existing stream with a smaller one is used with a warning.
	// Default DefaultDuplicateWindow.
	DuplicateWindow time.Duration
	// Create creates the stream (file storage) when it does not exist. It
	// is implied for the embedded server.
	Create bool
	// MaxMsgSize is the created stream's max_msg_size in bytes; 0 leaves
	// it unlimited (the server's max_payload still applies).
	MaxMsgSize int64
}

// Sink publishes deliveries to a JetStream stream. It is safe for
// concurrent use.
type Sink struct {
	name       string
	log        zerolog.Logger
	subject    *subjectTemplate
	ceSource   string // ce-source; "" unless the format is cloudevents
	deployment Deployment
	maxPending int
	// maxMsgSize is the stream's max_msg_size, or 0 when unlimited; set
	// with ready.
	maxMsgSize atomic.Int64

	nc     *nats.Conn
	js     jetstream.JetStream
	server *server.Server // the embedded server, or nil
	url    string         // the configured URL list, without credentials

	// ready is set once the stream has been checked, in New or, when the
	// server was down at start, by awaitStream; until then Send reports
	// SinkDown and Down says why: connectErr, the last failed attempt to
	// connect (cleared on connecting), or streamErr, the last failed check.
	ready      atomic.Bool
	connectErr atomic.Pointer[error]
	streamErr  atomic.Pointer[error]
	// connected wakes awaitStream when the client connects;
	// connectFailed is closed once an attempt to connect failed.
	connected     chan struct{}
	connectFailed chan struct{}
	failOnce      sync.Once
	// checks runs awaitStream, when the server was down at start, until
	// the stream is checked or Close.
	checks   *relay.Group
	released atomic.Bool // the connection is being closed on purpose

	// window holds one token per publish awaiting its PubAck; it bounds
	// Send, which waits for a free slot while honouring ctx.
	window chan struct{}

	mu      sync.Mutex
	closed  bool
	sending sync.WaitGroup // Sends past the closed check
	closing chan struct{}  // closed by Close: stop accepting
	// pending holds the publishes awaiting their outcome, by message: the
	// client's ack and error handlers complete them on its own goroutines
	// (docs/performance.md, "Between goroutines"); completing counts those taken
	// whose done has not returned. drained is closed once the sink is
	// closed and neither has any.
	pending    map[*nats.Msg]inflight
	completing int
	drained    chan struct{}

	closeOnce sync.Once
	closeErr  error

	duplicates atomic.Int64
	// dupWindow is the sink's duplicate_window (the stream's is at least
	// that); storedAgain counts retries JetStream stored as new messages
	// though their event is older than it: outbox_relay_nats_duplicates_stored_total.
	dupWindow   time.Duration
	storedAgain prometheus.Counter
}

var _ relay.Sink = (*Sink)(nil)

type inflight struct {
	key  string
	done func(error)
	// mayRepeat: a retry of an event older than the duplicate window, so
	// an earlier attempt's copy may have left the window.
	mayRepeat bool
}

// New connects to the server (or starts the embedded one) and checks the
// stream (see StreamConfig). The connection reconnects forever. New fails,
// naming the stream and the fix, when the stream is missing (and Create is
// false), does not capture the subject template, or has a smaller duplicate
// window; and when the configuration is invalid.
//
// A server that cannot be reached (refused, unresolvable, its TLS or the
// credentials refused) does not fail New: the sink is down (docs/sinks.md,
// "A server down at start"). Its Sends report SinkDown and Down says why
// while the client keeps connecting; once it connects the sink checks the
// stream as above, and a check that fails keeps it down, logged, and is
// made again until it passes. The embedded server is started here and must
// be reached. The caller must Close the returned Sink.
func New(ctx context.Context, cfg Config) (*Sink, error) {
	if err := applyDefaults(&cfg); err != nil {
		return nil, err
	}
	subject, err := parseSubjectTemplate(cfg.Subject)
	if err != nil {
		return nil, fmt.Errorf("nats sink %q: %w", cfg.Name, err)
	}
	pattern, err := subject.pattern()
	if err != nil {
		return nil, fmt.Errorf("nats sink %q: %w", cfg.Name, err)
	}

	s := &Sink{
		name:          cfg.Name,
		log:           cfg.Logger.With().Str("sink", cfg.Name).Logger(),
		subject:       subject,
		ceSource:      cfg.CloudEventsSource,
		deployment:    cfg.Deployment,
		maxPending:    cfg.MaxPending,
		window:        make(chan struct{}, cfg.MaxPending),
		closing:       make(chan struct{}),
		pending:       make(map[*nats.Msg]inflight, cfg.MaxPending),
		drained:       make(chan struct{}),
		connected:     make(chan struct{}, 1),
		connectFailed: make(chan struct{}),
		dupWindow:     cfg.Stream.DuplicateWindow,
		// Created at 0 now, so the series exists before the first retry.
		storedAgain: relay.NATSDuplicatesStored.WithLabelValues(cfg.Name),
	}
	s.checks, _ = relay.NewGroup(context.Background())
	ok := false
	defer func() {
		if !ok {
			s.release()
		}
	}()

	url := cfg.URL
	if url == "" {
		syncAlways := cfg.SyncAlways == nil || *cfg.SyncAlways
		s.server, url, err = StartEmbedded(cfg.DataDir, syncAlways, s.log)
		if err != nil {
			return nil, fmt.Errorf("nats sink %q: %w", cfg.Name, err)
		}
		cfg.Stream.Create = true
	}
	s.url = redactURL(url)
	if err := s.connect(url, cfg.Options, s.server == nil); err != nil {
		return nil, fmt.Errorf("nats sink %q: %w", cfg.Name, err)
	}
	s.js, err = jetstream.New(s.nc,
		jetstream.WithPublishAsyncMaxPending(cfg.MaxPending),
		jetstream.WithPublishAsyncTimeout(cfg.AckTimeout),
		jetstream.WithPublishAsyncAckHandler(s.onAck),
		jetstream.WithPublishAsyncErrHandler(s.onError))
	if err != nil {
		return nil, fmt.Errorf("nats sink %q: %w", cfg.Name, err)
	}
	if !s.nc.IsConnected() {
		select {
		case <-s.connectFailed:
		case <-time.After(firstErrorWait):
		}
		// The checks run until Close, whatever New's ctx.
		s.checks.GoTask("stream check", func(ctx context.Context) error { s.awaitStream(ctx, cfg, pattern); return nil })
		ok = true
		s.log.Error().Err(s.Down()).Str("stream", cfg.Stream.Name).
			Msg("nats sink is down at start: its events wait on the claim path while it keeps connecting; the other sinks run")
		return s, nil
	}
	maxMsgSize, err := s.ensureStream(ctx, cfg.Stream, cfg.Stream.Create, pattern)
	if err != nil {
		return nil, fmt.Errorf("nats sink %q: %w", cfg.Name, err)
	}
	ok = true
	s.up(cfg, maxMsgSize)
	return s, nil
}

func applyDefaults(cfg *Config) error {
	if cfg.Name == "" {
		return errors.New("nats sink: name is required")
	}
	if err := cfg.Deployment.Validate(); err != nil {
		return fmt.Errorf("nats sink %q: %w", cfg.Name, err)
	}
	if cfg.Subject == "" {
		cfg.Subject = DefaultSubject
	}
	if cfg.Stream.Name == "" {
		cfg.Stream.Name = DefaultStreamName
	}
	if cfg.Stream.DuplicateWindow == 0 {
		cfg.Stream.DuplicateWindow = DefaultDuplicateWindow
	}
	if cfg.MaxPending == 0 {
		cfg.MaxPending = DefaultMaxPending
	}
	if cfg.AckTimeout == 0 {
		cfg.AckTimeout = DefaultAckTimeout
	}
	switch cfg.Format {
	case "", FormatEnvelope:
		if cfg.CloudEventsSource != "" {
			return fmt.Errorf("nats sink %q: a CloudEvents source is only used with format cloudevents", cfg.Name)
		}
	case FormatCloudEvents:
		if cfg.CloudEventsSource == "" {
			return fmt.Errorf("nats sink %q: format cloudevents needs a source (ce-source)", cfg.Name)
		}
	default:
		return fmt.Errorf("nats sink %q: format %q is not one of envelope, cloudevents", cfg.Name, cfg.Format)
	}
	switch {
	case cfg.MaxPending < 0:
		return fmt.Errorf("nats sink %q: max_pending %d must be positive", cfg.Name, cfg.MaxPending)
	case cfg.AckTimeout < 0:
		return fmt.Errorf("nats sink %q: ack timeout %s must be positive", cfg.Name, cfg.AckTimeout)
	case cfg.Stream.DuplicateWindow < 0:
		return fmt.Errorf("nats sink %q: stream.duplicate_window %s must be positive", cfg.Name, cfg.Stream.DuplicateWindow)
	case cfg.Stream.MaxMsgSize < 0 || cfg.Stream.MaxMsgSize > math.MaxInt32:
		return fmt.Errorf("nats sink %q: stream.max_msg_size %d must be between 0 and %d", cfg.Name, cfg.Stream.MaxMsgSize, math.MaxInt32)
	case cfg.URL == "" && cfg.DataDir == "":
		return fmt.Errorf("nats sink %q: with no url the embedded server needs a data_dir", cfg.Name)
	}
	return nil
}

// Name returns the sink's name.
func (s *Sink) Name() string { return s.name }

// ClientURL returns the URL the sink is connected to, without credentials
// ("" while it is not); for the embedded server, the URL to subscribe to.
func (s *Sink) ClientURL() string { return redactURL(s.nc.ConnectedUrl()) }

// Duplicates returns how many publishes JetStream acknowledged as duplicates
// of a message it already stored (each counted as delivered).
func (s *Sink) Duplicates() int64 { return s.duplicates.Load() }

// Send publishes d and calls done exactly once: nil on a PubAck (a duplicate
// included), or a relay.DeliveryError:
//   - Permanent, without publishing, when the message (headers included) is
//     larger than the server's max_payload or the stream's max_msg_size, its
//     subject is unusable, its event key is empty (wrapping
//     relay.ErrEmptyEventKey), or, with format cloudevents, it has no type
//     (wrapping relay.ErrNoEventType); or when the server refuses it as too
//     large.
//   - SinkDown, without publishing, when the connection is not up or the
//     sink is closed; or when no stream answers (deleted, JetStream down).
//   - Transient when the stream refused the message (nothing stored), or
//     ctx ended before it was published (wrapping ctx.Err()).
//   - Unknown when it was published but no PubAck came (ack timeout, lost
//     connection, Close): it may be stored. A retry carries the same
//     Nats-Msg-Id, so JetStream drops it within the duplicate window.
//
// Send blocks while MaxPending publishes await their PubAck, until ctx ends.
// Sending the same Delivery again is safe: it carries the same Nats-Msg-Id
// and body. done may run on the NATS client's goroutines (the one that reads
// PubAcks, an ack timer, the reconnect handler), which complete every later
// publish: it must not block, and in particular must not call Send, which
// can wait for a window slot only they free.
func (s *Sink) Send(ctx context.Context, d *relay.Delivery, done func(error)) {
	key := d.Event.EventKey
	msg, err := s.message(d)
	if err != nil {
		done(err)
		return
	}
	if err := ctx.Err(); err != nil {
		done(relay.TransientError(fmt.Errorf("publish %s: not sent: %w", key, err), 0))
		return
	}
	if !s.enter() {
		done(relay.SinkDownError(fmt.Errorf("publish %s: %w", key, ErrClosed), 0))
		return
	}
	defer s.sending.Done()

	select {
	case s.window <- struct{}{}:
	case <-ctx.Done():
		done(relay.TransientError(fmt.Errorf("publish %s: not sent, %d publishes awaiting acks: %w", key, s.maxPending, ctx.Err()), 0))
		return
	case <-s.closing:
		done(relay.SinkDownError(fmt.Errorf("publish %s: %w", key, ErrClosed), 0))
		return
	}
	if err := s.Down(); err != nil {
		<-s.window
		done(relay.SinkDownError(fmt.Errorf("publish %s: %w", key, err), 0))
		return
	}

	// Pending before it is published: its PubAck may arrive before
	// PublishMsgAsync returns.
	s.mu.Lock()
	s.pending[msg] = inflight{key: key, done: done, mayRepeat: s.mayRepeat(d)}
	s.mu.Unlock()
	if _, err := s.js.PublishMsgAsync(msg); err != nil {
		s.complete(msg, func(inflight) error { return classifyPublishError(key, err) })
	}
}

// message builds d's message, or a Permanent error when it cannot be
// published as it is.
func (s *Sink) message(d *relay.Delivery) (*nats.Msg, error) {
	key := d.Event.EventKey
	if key == "" {
		return nil, relay.PermanentError(fmt.Errorf("event %d: %w", d.Event.ID, relay.ErrEmptyEventKey))
	}
	subject, err := s.subject.render(d.Event)
	if err == nil {
		err = validatePublishSubject(subject)
	}
	if err != nil {
		return nil, relay.PermanentError(fmt.Errorf("event %s: subject: %w", key, err))
	}
	msg := &nats.Msg{Subject: subject, Header: buildHeader(s.deployment, d), Data: d.Body}
	if s.ceSource != "" {
		ce, err := relay.CloudEventsHeaders(d.Event, s.deployment.MsgID(d), s.ceSource)
		if err != nil {
			return nil, relay.PermanentError(fmt.Errorf("event %s: %w", key, err))
		}
		for _, a := range ce {
			msg.Header.Set(a.Name, a.Value)
		}
		msg.Header.Set(HeaderCloudEventsContentType, relay.CloudEventsContentType)
		msg.Data = relay.CloudEventsData(d.Event)
	}
	hdr := headerSize(msg.Header)
	size := int64(hdr + len(msg.Data))
	if limit := s.nc.MaxPayload(); limit > 0 && size > limit {
		return nil, relay.PermanentError(fmt.Errorf("event %s: message is %d bytes (headers included), over the server's max_payload of %d", key, size, limit))
	}
	if limit := s.maxMsgSize.Load(); limit > 0 && size > limit {
		return nil, relay.PermanentError(fmt.Errorf("event %s: message is %d bytes (headers included), over the stream's max_msg_size of %d", key, size, limit))
	}
	if hdr > maxHeaderSize {
		return nil, relay.PermanentError(fmt.Errorf("event %s: headers are %d bytes, over JetStream's limit of %d", key, hdr, maxHeaderSize))
	}
	return msg, nil
}

// enter admits a Send unless the sink is closed; the caller must call
// s.sending.Done when admitted.
func (s *Sink) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.sending.Add(1)
	return true
}

// onAck is the client's handler for a PubAck.
func (s *Sink) onAck(_ jetstream.JetStream, msg *nats.Msg, ack *jetstream.PubAck) {
	s.complete(msg, func(p inflight) error { return s.acked(p, ack) })
}

// onError is the client's handler for a publish that got no PubAck: an
// error answer, the ack timeout, a lost connection.
func (s *Sink) onError(_ jetstream.JetStream, msg *nats.Msg, err error) {
	s.complete(msg, func(p inflight) error { return classifyAckError(p.key, err) })
}

// complete gives msg's publish its outcome, once, and reports whether it
// did: a later report on the same message (Close gave up on it first) is
// ignored.
func (s *Sink) complete(msg *nats.Msg, outcome func(inflight) error) bool {
	s.mu.Lock()
	p, ok := s.pending[msg]
	if ok {
		delete(s.pending, msg)
		s.completing++
	}
	s.mu.Unlock()
	if !ok {
		return false
	}
	err := outcome(p)
	<-s.window
	p.done(err)
	s.mu.Lock()
	s.completing--
	s.drainedLocked()
	s.mu.Unlock()
	return true
}

// drainedLocked closes drained once the sink is closed and every publish
// is complete. s.mu is held.
func (s *Sink) drainedLocked() {
	if s.closed && len(s.pending) == 0 && s.completing == 0 {
		select {
		case <-s.drained:
		default:
			close(s.drained)
		}
	}
}

func (s *Sink) acked(p inflight, ack *jetstream.PubAck) error {
	if ack.Duplicate {
		s.duplicates.Add(1)
	} else if p.mayRepeat {
		s.storedAgain.Inc()
	}
	return nil
}

// mayRepeat reports whether d is a retry that JetStream may store as a
// second copy: its event is older than the duplicate window (or of unknown
// age), so an earlier attempt, if it was stored, may have left the window.
// A retry of a younger event cannot be one: JetStream would drop it as a
// duplicate. An operator replay is a new copy by intent (its own id).
func (s *Sink) mayRepeat(d *relay.Delivery) bool {
	created := d.Event.CreatedAt
	return d.Attempt > 1 && d.Replay == 0 && (created.IsZero() || time.Since(created) >= s.dupWindow)
}

// Close stops accepting Sends (later ones get SinkDown), waits for every
// in-flight publish's PubAck until ctx ends, then completes the rest with
// Unknown, closes the connection and shuts the embedded server down. Every
// done has been called when Close returns. It returns an error when
// publishes were abandoned; calling it again returns the same result.
func (s *Sink) Close(ctx context.Context) error {
	s.closeOnce.Do(func() { s.closeErr = s.close(ctx) })
	return s.closeErr
}

func (s *Sink) close(ctx context.Context) error {
	checkErr := s.checks.Stop()
	s.mu.Lock()
	s.closed = true
	close(s.closing)
	s.mu.Unlock()
	// Admitted Sends either publish or give up on s.closing; none blocks.
	s.sending.Wait()
	s.mu.Lock()
	s.drainedLocked()
	s.mu.Unlock()

	var err error
	select {
	case <-s.drained:
	case <-ctx.Done():
		s.mu.Lock()
		abandoned := make([]*nats.Msg, 0, len(s.pending))
		for msg := range s.pending {
			abandoned = append(abandoned, msg)
		}
		s.mu.Unlock()
		gaveUp := 0
		for _, msg := range abandoned {
			if s.complete(msg, func(p inflight) error {
				return relay.UnknownError(fmt.Errorf("publish %s: sink closed before the PubAck arrived", p.key))
			}) {
				gaveUp++
			}
		}
		// Outcomes the client was reporting meanwhile finish too.
		<-s.drained
		if gaveUp > 0 {
			err = fmt.Errorf("close nats sink %q: gave up waiting for %d PubAcks (outcome unknown): %w", s.name, gaveUp, ctx.Err())
		}
	}
	s.release()
	s.log.Info().Int64("duplicates", s.Duplicates()).Msg("nats sink closed")
	if checkErr != nil && err == nil {
		err = fmt.Errorf("close nats sink %q: %w", s.name, checkErr)
	}
	return err
}

// release closes the connection and stops the embedded server.
func (s *Sink) release() {
	s.released.Store(true)
	if s.nc != nil {
		s.nc.Close()
	}
	if s.server != nil {
		s.server.Shutdown()
		s.server.WaitForShutdown()
	}
}
