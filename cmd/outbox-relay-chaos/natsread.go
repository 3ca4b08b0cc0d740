package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// natsMessage is one message on the stream's subjects: a publish seen by the
// tap (every attempt that reached the server, duplicates included) or a copy
// the stream stored.
type natsMessage struct {
	At   time.Duration // tap: arrival; stored: the server's timestamp
	ID   string        // Nats-Msg-Id without its deployment's scope (idemKey)
	Body string
}

// idemKey is the Nats-Msg-Id of a message without the scope of the
// deployment that published it (docs/sinks.md, "Message ids"): what the
// check compares with the event key. A Msg-Id that is not so scoped is
// returned whole, for the check to report.
func idemKey(h nats.Header) string {
	id, dep := h.Get(nats.MsgIdHdr), h.Get(natssink.HeaderDeployment)
	if key, ok := strings.CutPrefix(id, dep+":"); ok && dep != "" {
		return key
	}
	return id
}

// tap records every publish on the stream's subjects on a core NATS
// subscription that reconnects across server restarts (publishes while it
// is disconnected are not seen; the stream's contents are the record of
// what was stored).
type tap struct {
	nc    *nats.Conn
	sub   *nats.Subscription
	since func() time.Duration

	mu  sync.Mutex
	got []natsMessage
}

func startTap(url, subject string, since func() time.Duration) (*tap, error) {
	t := &tap{since: since}
	nc, err := nats.Connect(url, nats.Name("outbox-relay-chaos tap"), nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		return nil, err
	}
	t.nc = nc
	t.sub, err = nc.Subscribe(subject, func(m *nats.Msg) {
		msg := natsMessage{At: t.since(), ID: idemKey(m.Header), Body: string(m.Data)}
		t.mu.Lock()
		t.got = append(t.got, msg)
		t.mu.Unlock()
	})
	if err == nil {
		err = t.sub.SetPendingLimits(-1, -1)
	}
	if err == nil {
		err = nc.Flush()
	}
	if err != nil {
		nc.Close()
		return nil, err
	}
	return t, nil
}

// stop drains the subscription and returns every publish seen.
func (t *tap) stop() []natsMessage {
	_ = t.sub.Unsubscribe()
	t.nc.Close()
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.got
}

// streamCount is the number of messages the stream holds.
func streamCount(ctx context.Context, js jetstream.JetStream, stream string) (uint64, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

// readStream returns every message the stream holds, in stream order, with
// its timestamp relative to base.
func readStream(ctx context.Context, js jetstream.JetStream, stream string, base time.Time) ([]natsMessage, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	want := info.State.Msgs
	out := make([]natsMessage, 0, want)
	if want == 0 {
		return out, nil
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, fmt.Errorf("ordered consumer: %w", err)
	}
	for uint64(len(out)) < want {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, fmt.Errorf("fetch: %w", err)
		}
		n := 0
		for m := range batch.Messages() {
			meta, err := m.Metadata()
			if err != nil {
				return nil, err
			}
			out = append(out, natsMessage{At: meta.Timestamp.Sub(base), ID: idemKey(m.Headers()), Body: string(m.Data())})
			n++
		}
		if n == 0 && ctx.Err() != nil {
			return nil, fmt.Errorf("read %d of %d messages: %w (last fetch: %v)", len(out), want, ctx.Err(), batch.Error())
		}
	}
	return out, nil
}
