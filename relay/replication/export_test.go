package replication

import (
	"context"
	"errors"
	"fmt"
	"time"
	"weak"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Exported for the tests in package replication_test.
var (
	ParseServerDuration = parseServerDuration
	ParseTimestamptz    = parseTimestamptz
)

// ParseInsert reads an Insert message as the stream does (parseItem, then
// the decoder's tupleReader), for comparison with pglogrepl; nil for any
// other message.
func ParseInsert(data []byte) (*pglogrepl.InsertMessage, error) {
	it, err := parseItem(data)
	if err != nil || it.kind != itemInsert {
		return nil, err
	}
	var r tupleReader
	t, err := r.read(it.tuple)
	if err != nil {
		return nil, err
	}
	m := &pglogrepl.InsertMessage{RelationID: it.rel, Tuple: t}
	m.SetType(pglogrepl.MessageTypeInsert)
	return m, nil
}

// Item is what parseItem reads of a Begin or a Commit.
type Item struct {
	Begin, Commit bool
	LSN           relay.LSN // a Begin's final LSN, a Commit's end LSN
	Time          time.Time
	Xid           uint32
}

// ParseItem runs parseItem on a Begin or a Commit.
func ParseItem(data []byte) (Item, error) {
	it, err := parseItem(data)
	return Item{Begin: it.kind == itemBegin, Commit: it.kind == itemCommit, LSN: it.lsn, Time: it.time, Xid: it.xid}, err
}

// Decoder is the parser and the decoder of a session streaming outbox, as
// the receiver and the decoder run them, with a consumer that drops what
// it is given.
type Decoder struct{ d *decoder }

func NewDecoder(outbox relay.QualifiedName) *Decoder {
	return &Decoder{newDecoder(&droppingConsumer{}, outbox)}
}

// Feed decodes pgoutput messages and returns the events submitted.
func (d *Decoder) Feed(msgs ...[]byte) (events int, err error) {
	c := d.d.consumer.(*droppingConsumer)
	c.events = 0
	for _, data := range msgs {
		it, err := parseItem(data)
		if err != nil {
			return c.events, err
		}
		if err := d.d.handle(context.Background(), it); err != nil {
			return c.events, err
		}
	}
	return c.events, nil
}

type droppingConsumer struct {
	recordingConsumer
	events int
	seen   func(*relay.Event) // when set, sees each event before it is dropped
	// batch, when set, sees each batch submitted.
	batch func([]*relay.Event)
}

func (c *droppingConsumer) Submit(_ context.Context, events []*relay.Event) error {
	c.events += len(events)
	if c.batch != nil {
		c.batch(events)
	}
	if c.seen != nil {
		for _, ev := range events {
			c.seen(ev)
		}
	}
	return nil
}

// FeedAndWatch is Feed, and returns a weak pointer to the first event's
// payload: it becomes nil once nothing keeps the payload, the decoder
// included, and the garbage collector has run.
func (d *Decoder) FeedAndWatch(msgs ...[]byte) (weak.Pointer[byte], error) {
	c := d.d.consumer.(*droppingConsumer)
	var payload weak.Pointer[byte]
	c.seen = func(ev *relay.Event) {
		if len(ev.Payload) > 0 && payload == (weak.Pointer[byte]{}) {
			payload = weak.Make(&ev.Payload[0])
		}
	}
	defer func() { c.seen = nil }()
	_, err := d.Feed(msgs...)
	return payload, err
}

// FeedBatches is Feed, and returns how many events, and how many payload
// bytes, each batch the decoder submitted held.
func (d *Decoder) FeedBatches(msgs ...[]byte) (events, bytes []int, err error) {
	c := d.d.consumer.(*droppingConsumer)
	c.batch = func(batch []*relay.Event) {
		n := 0
		for _, ev := range batch {
			n += len(ev.Payload)
		}
		events, bytes = append(events, len(batch)), append(bytes, n)
	}
	defer func() { c.batch = nil }()
	_, err = d.Feed(msgs...)
	return events, bytes, err
}

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
		it, err := parseItem(data)
		if err != nil {
			return rec.events, fmt.Errorf("parse pgoutput message %q: %w", data[0], err)
		}
		if err := d.handle(context.Background(), it); err != nil {
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
func (r *recordingConsumer) Commit(relay.LSN)                         {}
func (r *recordingConsumer) Keepalive(relay.LSN)                      {}
func (r *recordingConsumer) Settled() (relay.LSN, bool)               { return 0, false }
func (r *recordingConsumer) Restart(context.Context, relay.LSN) error { return nil }
func (r *recordingConsumer) Sent(time.Duration)                       {}
func (r *recordingConsumer) HandOver(context.Context, []*relay.Event) error {
	return nil
}
func (r *recordingConsumer) HandOverSettled(context.Context) error { return nil }
func (r *recordingConsumer) Divert([]relay.AggregateKey) func([]relay.AggregateKey) {
	return func([]relay.AggregateKey) {}
}
