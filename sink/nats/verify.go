package nats

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// What verify --deep reads of a stream (docs/operations.md, "verify"): the
// messages this relay published, told apart and read back by the headers
// buildHeader writes.

// StoredEvent is what a message in the stream says of the event it
// carries.
type StoredEvent struct {
	// EventKey is the event's key, decoded from HeaderEventKey.
	EventKey string
	// Replay is 0, or n for the message of the event's n-th operator
	// replay.
	Replay int
	// MsgID is the message's Nats-Msg-Id.
	MsgID string
	// Stored is when the stream stored the message (Read sets it).
	Stored time.Time
}

// ParseStored tells whether a message with header h is an event the
// deployment named deployment (Deployment.ID; "" for any) published and,
// if so, which: the key from HeaderEventKey (as HeaderValue encodes it),
// the replay number from the "~r<n>" that ends a replay's Nats-Msg-Id
// (Deployment.MsgID), a replay being marked by HeaderOriginalEventKey. A
// message without the relay's headers, whose key header does not decode,
// or that another deployment published (HeaderDeployment) is not one of
// ours; a message without HeaderDeployment was published before the
// scoping (docs/sinks.md, "Message ids") and counts as ours.
func ParseStored(h nats.Header, deployment string) (StoredEvent, bool) {
	id := h.Get(jetstream.MsgIDHeader)
	raw := h.Get(HeaderEventKey)
	if id == "" || raw == "" || h.Get(HeaderEventID) == "" {
		return StoredEvent{}, false
	}
	if dep := h.Get(HeaderDeployment); deployment != "" && dep != "" && dep != deployment {
		return StoredEvent{}, false
	}
	key, ok := decodeHeaderValue(raw)
	if !ok {
		return StoredEvent{}, false
	}
	ev := StoredEvent{EventKey: key, MsgID: id}
	if h.Get(HeaderOriginalEventKey) != "" && hasReplaySuffix(id) {
		n, err := strconv.Atoi(id[strings.LastIndex(id, "~r")+2:])
		if err != nil || n <= 0 {
			return StoredEvent{}, false
		}
		ev.Replay = n
	}
	return ev, true
}

// decodeHeaderValue reverses HeaderValue.
func decodeHeaderValue(v string) (string, bool) {
	enc, ok := strings.CutPrefix(v, EncodedPrefix)
	if !ok {
		return v, true
	}
	b, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil {
		return "", false
	}
	return string(b), true
}

// ReaderConfig says which stream a StreamReader reads and how to reach it.
type ReaderConfig struct {
	// URL is the server URL (a comma-separated list for a cluster); an
	// embedded server lives in the relay's process and cannot be read.
	URL     string
	Options []nats.Option
	// Stream is the stream's name (default DefaultStreamName).
	Stream string
	// Subject is the sink's subject template (default DefaultSubject):
	// only messages on the subjects it renders are read.
	Subject string
	// Deployment is the Deployment.ID of the sink: messages another
	// deployment published into the same stream are not read as ours.
	Deployment string
	// IdleTimeout bounds the wait for the next message while the stream
	// has more [10s].
	IdleTimeout time.Duration
}

// StreamReader reads a sink's stream for verify with an ordered consumer:
// headers only, from a time, then on from where it stopped. It is used by
// one goroutine; Close releases it.
type StreamReader struct {
	cfg    ReaderConfig
	nc     *nats.Conn
	stream jetstream.Stream
	filter string
	// next is the stream sequence the next Read starts at; 0 before the
	// first.
	next uint64

	// Foreign counts the messages read that are not this relay's events.
	Foreign int64
	// FirstStored is when the stream's first message was stored, and
	// Removed says whether the stream's retention (or a person) has removed
	// messages before it.
	FirstStored time.Time
	Removed     bool
}

// OpenStream connects and looks the stream up. It fails for a stream whose
// retention removes messages once consumed (work queue, interest): such a
// stream cannot show what was delivered.
func OpenStream(ctx context.Context, cfg ReaderConfig) (*StreamReader, error) {
	if cfg.URL == "" {
		return nil, errors.New("the sink runs an embedded NATS server, inside the relay's process: its stream cannot be read from here")
	}
	if cfg.Stream == "" {
		cfg.Stream = DefaultStreamName
	}
	if cfg.Subject == "" {
		cfg.Subject = DefaultSubject
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = 10 * time.Second
	}
	tmpl, err := parseSubjectTemplate(cfg.Subject)
	if err != nil {
		return nil, err
	}
	filter, err := tmpl.pattern()
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(cfg.URL, append([]nats.Option{nats.Name("outbox-relay verify")}, cfg.Options...)...)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redactURL(cfg.URL), err)
	}
	r := &StreamReader{cfg: cfg, nc: nc, filter: filter}
	js, err := jetstream.New(nc)
	if err == nil {
		r.stream, err = js.Stream(ctx, cfg.Stream)
	}
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("look up stream %q: %w", cfg.Stream, err)
	}
	info := r.stream.CachedInfo()
	if p := info.Config.Retention; p != jetstream.LimitsPolicy {
		nc.Close()
		return nil, fmt.Errorf("stream %q has %s retention: it removes messages once consumed, so it cannot show what was delivered", cfg.Stream, p)
	}
	r.FirstStored = info.State.FirstTime
	r.Removed = info.State.FirstSeq > 1
	return r, nil
}

// Close closes the connection.
func (r *StreamReader) Close() { r.nc.Close() }

// Read calls fn with each of this relay's events stored on the sink's
// subjects: on the first call from since, on later calls from where the
// previous one stopped; each call ends at the last message stored when it
// began. It returns the number of messages read (Foreign counts those not
// ours), or an error when the stream cannot be read or says nothing for
// IdleTimeout while it holds more.
func (r *StreamReader) Read(ctx context.Context, since time.Time, fn func(StoredEvent)) (int64, error) {
	info, err := r.stream.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %q: %w", r.cfg.Stream, err)
	}
	last := info.State.LastSeq
	cc := jetstream.OrderedConsumerConfig{FilterSubjects: []string{r.filter}, HeadersOnly: true}
	if r.next == 0 {
		cc.DeliverPolicy, cc.OptStartTime = jetstream.DeliverByStartTimePolicy, &since
	} else {
		if r.next > last {
			return 0, nil
		}
		cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, r.next
	}
	r.next = last + 1
	if info.State.Msgs == 0 {
		return 0, nil
	}
	cons, err := r.stream.OrderedConsumer(ctx, cc)
	if err != nil {
		return 0, fmt.Errorf("stream %q: ordered consumer: %w", r.cfg.Stream, err)
	}
	if ci := cons.CachedInfo(); ci != nil && ci.NumPending == 0 {
		return 0, nil
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(4096))
	if err != nil {
		return 0, fmt.Errorf("stream %q: read: %w", r.cfg.Stream, err)
	}
	defer it.Stop()
	// AfterFunc forwards ctx's end to the blocked Next, not a worker:
	// it.Stop only unblocks it.
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	var n int64
	for {
		m, err := it.Next(jetstream.NextMaxWait(r.cfg.IdleTimeout))
		switch {
		case ctx.Err() != nil:
			return n, ctx.Err()
		case errors.Is(err, nats.ErrTimeout):
			return n, fmt.Errorf("stream %q: no message for %s after %d read, though it holds more up to sequence %d", r.cfg.Stream, r.cfg.IdleTimeout, n, last)
		case err != nil:
			return n, fmt.Errorf("stream %q: read: %w", r.cfg.Stream, err)
		}
		meta, err := m.Metadata()
		if err != nil {
			return n, fmt.Errorf("stream %q: read: %w", r.cfg.Stream, err)
		}
		if meta.Sequence.Stream > last {
			return n, nil
		}
		n++
		if ev, ours := ParseStored(m.Headers(), r.cfg.Deployment); ours {
			ev.Stored = meta.Timestamp
			fn(ev)
		} else {
			r.Foreign++
		}
		if meta.Sequence.Stream == last || meta.NumPending == 0 {
			return n, nil
		}
	}
}
