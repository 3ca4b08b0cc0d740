package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Exported for the tests in package replication_test.
var (
	ParseServerDuration = parseServerDuration
	ParseTimestamptz    = parseTimestamptz
	ParseMessage        = parseMessage
)

// DecodeMessages runs pgoutput messages (XLogData payloads) through the
// parser and the decoder of a session streaming outbox, and returns the
// events submitted and the first error, wrapped as the session wraps it.
func DecodeMessages(outbox relay.QualifiedName, msgs ...[]byte) ([]*relay.Event, error) {
	rec := &recordingConsumer{}
	d := newDecoder(rec, outbox)
	for _, data := range msgs {
		if len(data) == 0 {
			return rec.events, errors.New("empty XLogData")
		}
		m, err := parseMessage(data)
		if err != nil {
			return rec.events, fmt.Errorf("parse pgoutput message %q: %w", data[0], err)
		}
		if err := d.handle(context.Background(), streamItem{msg: m, size: int64(len(data))}); err != nil {
			return rec.events, err
		}
	}
	return rec.events, nil
}

// recordingConsumer keeps the events a decoder submits.
type recordingConsumer struct{ events []*relay.Event }

var _ relay.Consumer = (*recordingConsumer)(nil)

func (r *recordingConsumer) Submit(_ context.Context, events []*relay.Event) error {
	r.events = append(r.events, events...)
	return nil
}
func (r *recordingConsumer) Commit(relay.LSN)                            {}
func (r *recordingConsumer) Keepalive(relay.LSN)                         {}
func (r *recordingConsumer) Settled() (relay.LSN, bool)                  { return 0, false }
func (r *recordingConsumer) Restart(context.Context, relay.LSN) error    { return nil }
func (r *recordingConsumer) PositionWanted() bool                        { return false }
func (r *recordingConsumer) WaitDecoded(context.Context, relay.LSN) bool { return true }
func (r *recordingConsumer) Sent(time.Duration)                          {}
func (r *recordingConsumer) Divert([]relay.AggregateKey) func([]relay.AggregateKey) {
	return func([]relay.AggregateKey) {}
}
