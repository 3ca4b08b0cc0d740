package replication

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/relay"
)

// maxBatch and maxBatchBytes (of payloads) bound the events handed to Submit
// at once, so that a transaction of any size never sits whole in memory.
const (
	maxBatch      = 256
	maxBatchBytes = 4 << 20
)

// decoder turns pgoutput messages into consumer calls; see "How a session
// runs" in stream.go. It lives for one session: relation messages are sent
// again on every new stream.
type decoder struct {
	consumer  relay.Consumer
	outbox    relay.QualifiedName
	relations map[uint32]*relation

	inTxn      bool
	commitLSN  relay.LSN
	commitTime time.Time
	xid        uint32
	batch      []*relay.Event
	batchBytes int
}

func newDecoder(c relay.Consumer, outbox relay.QualifiedName) *decoder {
	return &decoder{consumer: c, outbox: outbox, relations: make(map[uint32]*relation)}
}

func (d *decoder) run(ctx context.Context, q *queue) error {
	for {
		g, err := q.get(ctx)
		if err != nil {
			return err
		}
		for _, it := range g.items {
			if err := d.handle(ctx, it); err != nil {
				return err
			}
		}
		q.release(g)
	}
}

func (d *decoder) handle(ctx context.Context, it streamItem) error {
	if it.msg == nil {
		if !d.inTxn {
			d.consumer.Keepalive(it.walEnd)
		}
		return nil
	}
	switch m := it.msg.(type) {
	case *pglogrepl.RelationMessage:
		d.relations[m.RelationID] = newRelation(m, d.outbox)
	case *pglogrepl.BeginMessage:
		if d.inTxn {
			return errors.New("decode: BEGIN inside a transaction")
		}
		d.inTxn = true
		d.commitLSN = relay.LSN(m.FinalLSN)
		d.commitTime = m.CommitTime
		d.xid = m.Xid
	case *pglogrepl.InsertMessage:
		rel, ok := d.relations[m.RelationID]
		if !ok {
			return fmt.Errorf("decode: INSERT into relation %d before its RELATION message", m.RelationID)
		}
		if !rel.outbox {
			return nil
		}
		if !d.inTxn {
			return fmt.Errorf("decode: INSERT into %s outside a transaction", rel.name)
		}
		ev, err := rel.event(m.Tuple)
		if err != nil {
			return err
		}
		ev.CommitLSN = d.commitLSN
		ev.CommitTime = d.commitTime
		ev.Xid = d.xid
		d.batch = append(d.batch, ev)
		d.batchBytes += len(ev.Payload)
		if len(d.batch) >= maxBatch || d.batchBytes >= maxBatchBytes {
			return d.submit(ctx)
		}
	case *pglogrepl.CommitMessage:
		if !d.inTxn {
			return errors.New("decode: COMMIT outside a transaction")
		}
		// The end of the commit record, not its start (CommitLSN): a slot
		// restarted at CommitLSN would stream the transaction again.
		end := relay.LSN(m.TransactionEndLSN)
		if err := d.submit(ctx); err != nil {
			return err
		}
		d.consumer.Commit(end)
		d.inTxn = false
	}
	// Update, Delete, Truncate, Type and Origin messages do not concern the
	// stream path.
	return nil
}

func (d *decoder) submit(ctx context.Context) error {
	if len(d.batch) == 0 {
		return nil
	}
	batch := d.batch
	d.batch, d.batchBytes = nil, 0 // the consumer may keep the slice
	if err := d.consumer.Submit(ctx, batch); err != nil {
		return fmt.Errorf("submit: %w", err)
	}
	return nil
}

// parseMessage is pglogrepl.Parse for messages that may be truncated or
// corrupt. pglogrepl indexes a message without bounds checks and sizes what
// it allocates by the lengths the message claims, so such a message would
// panic and take the relay down, or allocate up to 16 GiB, instead of ending
// the session with an error. parseMessage checks the claimed lengths of the
// messages that allocate by them, and turns any other out-of-bounds read into
// an error.
func parseMessage(data []byte) (m pglogrepl.Message, err error) {
	if len(data) == 0 {
		return nil, errors.New("empty message")
	}
	if err := checkClaimedLengths(data); err != nil {
		return nil, err
	}
	defer func() {
		if r := recover(); r != nil {
			m, err = nil, fmt.Errorf("truncated or malformed (%d bytes)", len(data))
		}
	}()
	if m := parseInsert(data); m != nil {
		return &m.msg, nil
	}
	return pglogrepl.Parse(data)
}

// insertMessage is an Insert message and its tuple in one allocation.
type insertMessage struct {
	msg   pglogrepl.InsertMessage
	tuple pglogrepl.TupleData
}

// parseInsert decodes a well-formed Insert message as pglogrepl does, in
// four allocations where pglogrepl makes two per column and grows the
// column list as it goes: the tuple's bytes are copied once (data is
// pgconn's read buffer) and each value is a slice of that copy
// (docs/performance.md, "Hand-offs"). It returns nil for any other message
// and for an Insert whose header pglogrepl would refuse, which is then
// left to pglogrepl.Parse and its error. checkClaimedLengths has checked
// every claimed length; parseMessage recovers from any other bad index.
func parseInsert(data []byte) *insertMessage {
	// 'I', the relation id (4 bytes), 'N', the column count (2 bytes):
	// pglogrepl asks for 8 bytes after the type.
	if len(data) < 9 || data[0] != byte(pglogrepl.MessageTypeInsert) || data[5] != 'N' {
		return nil
	}
	ncols := int(binary.BigEndian.Uint16(data[6:]))
	buf := bytes.Clone(data[8:])
	m := &insertMessage{}
	m.msg.SetType(pglogrepl.MessageTypeInsert)
	m.msg.RelationID = binary.BigEndian.Uint32(data[1:])
	m.msg.Tuple = &m.tuple
	m.tuple.ColumnNum = uint16(ncols)
	if ncols == 0 {
		return m // pglogrepl leaves Columns nil
	}
	cols := make([]pglogrepl.TupleDataColumn, ncols)
	m.tuple.Columns = make([]*pglogrepl.TupleDataColumn, ncols)
	off := 0
	for i := range cols {
		c := &cols[i]
		c.DataType = buf[off]
		off++
		if c.DataType == pglogrepl.TupleDataTypeText || c.DataType == pglogrepl.TupleDataTypeBinary {
			c.Length = binary.BigEndian.Uint32(buf[off:])
			off += 4
			end := off + int(c.Length)
			c.Data = buf[off:end:end]
			off = end
		}
		m.tuple.Columns[i] = c
	}
	return m
}

// checkClaimedLengths reports an error when an Insert, Update, Delete or
// Truncate message claims more values or relations than its bytes can hold.
func checkClaimedLengths(data []byte) error {
	typ, rest := pglogrepl.MessageType(data[0]), data[1:]
	switch typ {
	case pglogrepl.MessageTypeInsert, pglogrepl.MessageTypeUpdate, pglogrepl.MessageTypeDelete:
		if len(rest) < 5 {
			return nil // too short to claim a length
		}
		kind, tuple := rest[4], rest[5:] // after the relation id
		n, err := tupleSize(tuple)
		if err == nil && typ == pglogrepl.MessageTypeUpdate && (kind == 'K' || kind == 'O') && len(tuple) > n {
			// The new tuple follows the old one and a byte pglogrepl skips.
			_, err = tupleSize(tuple[n+1:])
		}
		return err
	case pglogrepl.MessageTypeTruncate:
		// The relation count and the options byte, then 4 bytes per relation.
		if len(rest) >= 5 && uint64(binary.BigEndian.Uint32(rest))*4 > uint64(len(rest)-5) {
			return fmt.Errorf("%d relations in %d bytes", binary.BigEndian.Uint32(rest), len(rest)-5)
		}
	}
	return nil
}

// tupleSize returns the size of the TupleData at the start of b, or an
// error when a value's claimed length runs past b's end.
func tupleSize(b []byte) (int, error) {
	if len(b) < 2 {
		return 0, errors.New("tuple cut before its column count")
	}
	ncols, off := int(binary.BigEndian.Uint16(b)), 2
	for i := range ncols {
		if off >= len(b) {
			return 0, fmt.Errorf("tuple cut at column %d of %d", i+1, ncols)
		}
		kind := b[off]
		off++
		if kind != pglogrepl.TupleDataTypeText && kind != pglogrepl.TupleDataTypeBinary {
			continue
		}
		if len(b)-off < 4 {
			return 0, fmt.Errorf("tuple cut in the length of column %d", i+1)
		}
		n := uint64(binary.BigEndian.Uint32(b[off:]))
		off += 4
		if n > uint64(len(b)-off) {
			return 0, fmt.Errorf("tuple column %d claims %d bytes, %d are left", i+1, n, len(b)-off)
		}
		off += int(n)
	}
	return off, nil
}

// The outbox columns the stream decodes.
const (
	colID = iota
	colEventKey
	colEventType
	colAggregateType
	colAggregateID
	colPayload
	colCreatedAt
	colAvailableAt
	colAttempts
	colStatus
	colTraceContext // optional: migration 008
	numCols
)

var colNames = [numCols]string{
	colID:            "id",
	colEventKey:      "event_key",
	colEventType:     "event_type",
	colAggregateType: "aggregate_type",
	colAggregateID:   "aggregate_id",
	colPayload:       "payload",
	colCreatedAt:     "created_at",
	colAvailableAt:   "available_at",
	colAttempts:      "attempts",
	colStatus:        "status",
	colTraceContext:  "trace_context",
}

// relation is what a RELATION message says about a table.
type relation struct {
	name   string // namespace.name, for messages
	outbox bool
	ncols  int
	pos    [numCols]int // position of each outbox column in a tuple; -1 when absent
}

func newRelation(m *pglogrepl.RelationMessage, outbox relay.QualifiedName) *relation {
	r := &relation{
		name:   relay.QualifiedName{Schema: m.Namespace, Name: m.RelationName}.Quoted(),
		outbox: m.Namespace == outbox.Schema && m.RelationName == outbox.Name,
		ncols:  len(m.Columns),
	}
	for c := range r.pos {
		r.pos[c] = -1
	}
	for i, col := range m.Columns {
		for c, name := range colNames {
			if col.Name == name {
				r.pos[c] = i
			}
		}
	}
	return r
}

func (r *relation) errorf(c int, format string, args ...any) error {
	return fmt.Errorf("decode INSERT into %s, column %q: %s", r.name, colNames[c], fmt.Sprintf(format, args...))
}

// value returns column c's text; null reports NULL.
func (r *relation) value(t *pglogrepl.TupleData, c int) (data []byte, null bool, err error) {
	i := r.pos[c]
	if i < 0 {
		return nil, false, r.errorf(c, "the relation has no such column (is it excluded by the publication's column list?)")
	}
	col := t.Columns[i]
	switch col.DataType {
	case pglogrepl.TupleDataTypeNull:
		return nil, true, nil
	case pglogrepl.TupleDataTypeText:
		return col.Data, false, nil
	case pglogrepl.TupleDataTypeToast:
		return nil, false, r.errorf(c, "unchanged TOAST value in an INSERT")
	default:
		return nil, false, r.errorf(c, "unexpected value format %q", col.DataType)
	}
}

func (r *relation) timestamp(t *pglogrepl.TupleData, c int) (time.Time, error) {
	data, null, err := r.value(t, c)
	if err != nil || null {
		return time.Time{}, err
	}
	ts, err := parseTimestamptz(string(data))
	if err != nil {
		return time.Time{}, r.errorf(c, "%v", err)
	}
	return ts, nil
}

// event decodes an outbox row. id and event_key must not be NULL; a NULL
// created_at, available_at or attempts decodes as the zero value.
func (r *relation) event(t *pglogrepl.TupleData) (*relay.Event, error) {
	if t == nil || len(t.Columns) != r.ncols {
		n := 0
		if t != nil {
			n = len(t.Columns)
		}
		return nil, fmt.Errorf("decode INSERT into %s: %d columns, the RELATION message had %d", r.name, n, r.ncols)
	}
	a := new(eventAlloc)
	ev := &a.ev
	var err error

	data, null, err := r.value(t, colID)
	if err != nil {
		return nil, err
	}
	if null {
		return nil, r.errorf(colID, "NULL")
	}
	if ev.ID, err = strconv.ParseInt(string(data), 10, 64); err != nil {
		return nil, r.errorf(colID, "%v", err)
	}

	// The text columns are copied into one string, and the nullable ones
	// point into the event's own allocation: two allocations for five
	// values (docs/performance.md, "Hand-offs").
	var texts [len(textCols)][]byte
	var nulls [len(textCols)]bool
	size := 0
	for i, c := range textCols {
		if texts[i], nulls[i], err = r.value(t, c); err != nil {
			return nil, err
		}
		if c == colEventKey && nulls[i] {
			return nil, r.errorf(colEventKey, "NULL")
		}
		size += len(texts[i])
	}
	var b strings.Builder
	b.Grow(size)
	for _, v := range texts {
		b.Write(v)
	}
	all, off := b.String(), 0
	for i, c := range textCols {
		v := all[off : off+len(texts[i])]
		off += len(texts[i])
		switch c {
		case colEventKey:
			ev.EventKey = v
		case colStatus:
			ev.Status = v // the engine skips rows inserted settled; NULL reads as pending
		default:
			if !nulls[i] {
				a.text[i-1] = v
				*textField(ev, c) = &a.text[i-1]
			}
		}
	}

	// jsonb's text form, verbatim; pglogrepl allocated it for this message.
	if ev.Payload, _, err = r.value(t, colPayload); err != nil {
		return nil, err
	}

	if ev.CreatedAt, err = r.timestamp(t, colCreatedAt); err != nil {
		return nil, err
	}
	if ev.AvailableAt, err = r.timestamp(t, colAvailableAt); err != nil {
		return nil, err
	}

	data, null, err = r.value(t, colAttempts)
	if err != nil {
		return nil, err
	}
	if !null {
		n, err := strconv.ParseInt(string(data), 10, 32)
		if err != nil {
			return nil, r.errorf(colAttempts, "%v", err)
		}
		ev.Attempts = int(n)
	}

	// trace_context is optional (a table not migrated to 008 has none) and
	// never stops the stream: a value it cannot read is no trace context.
	if r.pos[colTraceContext] >= 0 {
		if data, null, err := r.value(t, colTraceContext); err == nil && !null {
			ev.TraceContext = data
		}
	}
	return ev, nil
}

// textCols are the outbox's text columns, event_key first and status
// last; the three between are the event's nullable strings.
var textCols = [...]int{colEventKey, colEventType, colAggregateType, colAggregateID, colStatus}

// eventAlloc is an event and the strings its nullable fields point to.
type eventAlloc struct {
	ev   relay.Event
	text [len(textCols) - 2]string
}

// textField returns the event's field for one of the nullable text columns.
func textField(ev *relay.Event, c int) **string {
	switch c {
	case colEventType:
		return &ev.EventType
	case colAggregateType:
		return &ev.AggregateType
	default:
		return &ev.AggregateID
	}
}

// Timestamps PostgreSQL cannot order against real ones: 'infinity' decodes as
// the last microsecond of year 9999, '-infinity' as the zero time.
var infinity = time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC)

// parseTimestamptz parses timestamptz output with DateStyle ISO, which the
// replication connection sets, as are TimeZone=UTC ("+00"); other offsets are
// accepted too. Years after 9999 have more than four digits and years before
// 1 AD end in " BC", as PostgreSQL prints them.
func parseTimestamptz(s string) (time.Time, error) {
	switch s {
	case "infinity":
		return infinity, nil
	case "-infinity":
		return time.Time{}, nil
	}
	text, bc := strings.CutSuffix(s, " BC")
	year, standIn := 0, false // standIn: text has year 2000 in place of year
	if digits := strings.IndexByte(text, '-'); digits > 4 || bc && digits == 4 {
		// Go's layouts read exactly four year digits: parse with a leap
		// stand-in year, then put the real one back (1 BC is year 0).
		y, err := strconv.Atoi(text[:digits])
		if err != nil || y < 1 || text[0] < '0' || text[0] > '9' {
			return time.Time{}, invalidTimestamptz(s)
		}
		year, text, standIn = y, "2000"+text[digits:], true
		if bc {
			year = 1 - y
		}
	} else if bc {
		return time.Time{}, invalidTimestamptz(s)
	}
	for _, layout := range [...]string{
		"2006-01-02 15:04:05.999999999Z07",
		"2006-01-02 15:04:05.999999999Z07:00",
		"2006-01-02 15:04:05.999999999Z07:00:00",
	} {
		t, err := time.Parse(layout, text)
		if err != nil {
			continue
		}
		if standIn {
			_, offset := t.Zone()
			actual := time.Date(year, t.Month(), t.Day(), t.Hour(), t.Minute(), t.Second(), t.Nanosecond(), time.FixedZone("", offset))
			if actual.Day() != t.Day() { // February 29 of a year that is not a leap year
				return time.Time{}, invalidTimestamptz(s)
			}
			t = actual
		}
		if _, offset := t.Zone(); offset == 0 && strings.HasSuffix(text, "-00:00:01") {
			// time.Parse reads an offset of -1 s as none: -1 is its sentinel.
			t = t.Add(time.Second)
		}
		return t.UTC(), nil
	}
	return time.Time{}, invalidTimestamptz(s)
}

func invalidTimestamptz(s string) error {
	return fmt.Errorf("invalid timestamptz %q (want ISO DateStyle, e.g. 2026-12-02 16:17:36.123456+00)", s)
}
