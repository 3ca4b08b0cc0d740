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
	"unsafe"

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
	batch      []*relay.Event // reused: Submit does not keep the slice
	batchBytes int
	tuples     tupleReader
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
	switch it.kind {
	case itemKeepalive:
		if !d.inTxn {
			d.consumer.Keepalive(it.lsn)
		}
		return nil
	case itemBegin:
		if d.inTxn {
			return errors.New("decode: BEGIN inside a transaction")
		}
		d.inTxn = true
		d.commitLSN = it.lsn
		d.commitTime = it.time
		d.xid = it.xid
		return nil
	case itemCommit:
		if !d.inTxn {
			return errors.New("decode: COMMIT outside a transaction")
		}
		// The end of the commit record, not its start (CommitLSN): a slot
		// restarted at CommitLSN would stream the transaction again.
		if err := d.submit(ctx); err != nil {
			return err
		}
		d.consumer.Commit(it.lsn)
		d.inTxn = false
		return nil
	case itemInsert:
		return d.insert(ctx, it)
	}
	switch m := it.msg.(type) {
	case *pglogrepl.RelationMessage:
		d.relations[m.RelationID] = newRelation(m, d.outbox)
	}
	// Update, Delete, Truncate, Type and Origin messages do not concern the
	// stream path.
	return nil
}

// insert decodes an Insert into the outbox into an event of the batch.
func (d *decoder) insert(ctx context.Context, it streamItem) error {
	rel, ok := d.relations[it.rel]
	if !ok {
		return fmt.Errorf("decode: INSERT into relation %d before its RELATION message", it.rel)
	}
	if !rel.outbox {
		return nil
	}
	if !d.inTxn {
		return fmt.Errorf("decode: INSERT into %s outside a transaction", rel.name)
	}
	t, err := d.tuples.read(it.tuple)
	if err != nil {
		return fmt.Errorf("decode INSERT into %s: %w", rel.name, err)
	}
	ev, err := rel.event(t)
	d.tuples.forget() // what the event keeps of the tuple, it holds itself
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
	return nil
}

func (d *decoder) submit(ctx context.Context) error {
	if len(d.batch) == 0 {
		return nil
	}
	err := d.consumer.Submit(ctx, d.batch)
	clear(d.batch) // the events are the consumer's now
	d.batch, d.batchBytes = d.batch[:0], 0
	if err != nil {
		return fmt.Errorf("submit: %w", err)
	}
	return nil
}

// parseItem reads a pgoutput message into a stream item. A Begin or a
// Commit is read into the item itself, where pglogrepl allocates it, and an
// Insert's tuple is copied once out of pgconn's read buffer (its values,
// the payload among them, are slices of that copy) and read by the
// decoder's tupleReader, where pglogrepl makes two allocations per column:
// a single-event transaction allocates nothing on its way to the consumer
// but the event itself (docs/performance.md, "Between goroutines"). FuzzParseItem
// and FuzzDecodeMessages check that they read as pglogrepl reads them.
func parseItem(data []byte) (streamItem, error) {
	it := streamItem{size: int64(len(data))}
	if len(data) == 0 {
		return it, errors.New("empty message")
	}
	switch pglogrepl.MessageType(data[0]) {
	case pglogrepl.MessageTypeBegin:
		// The final LSN, the commit time and the xid.
		if len(data) < 1+20 {
			return it, fmt.Errorf("BeginMessage must have 20 bytes, got %d bytes", len(data)-1)
		}
		it.kind = itemBegin
		it.lsn = relay.LSN(binary.BigEndian.Uint64(data[1:]))
		it.time = pgTime(data[9:])
		it.xid = binary.BigEndian.Uint32(data[17:])
	case pglogrepl.MessageTypeCommit:
		// Flags, the commit LSN, the transaction's end LSN, the commit time.
		if len(data) < 1+25 {
			return it, fmt.Errorf("CommitMessage must have 25 bytes, got %d bytes", len(data)-1)
		}
		it.kind = itemCommit
		it.lsn = relay.LSN(binary.BigEndian.Uint64(data[10:]))
		it.time = pgTime(data[18:])
	case pglogrepl.MessageTypeInsert:
		// The relation id, 'N' (a new tuple), the tuple; pglogrepl asks
		// for 8 bytes after the type. An Insert pglogrepl would refuse is
		// left to it and its error.
		if len(data) < 9 || data[5] != 'N' {
			return parseOther(it, data)
		}
		if err := checkClaimedLengths(data); err != nil {
			return it, err
		}
		it.kind = itemInsert
		it.rel = binary.BigEndian.Uint32(data[1:])
		it.tuple = bytes.Clone(data[6:])
	default:
		return parseOther(it, data)
	}
	return it, nil
}

// parseOther reads a message other than Begin, Commit and a well-formed
// Insert into it.
func parseOther(it streamItem, data []byte) (streamItem, error) {
	m, err := parseMessage(data)
	if err != nil {
		return it, err
	}
	it.kind, it.msg = itemMessage, m
	return it, nil
}

// pgTime reads a protocol timestamp, microseconds since 2000-01-01 UTC, as
// pglogrepl does.
func pgTime(b []byte) time.Time {
	const unixToY2K = 946_684_800 * 1_000_000 // microseconds
	return time.Unix(0, (unixToY2K+int64(binary.BigEndian.Uint64(b)))*1000)
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
	return pglogrepl.Parse(data)
}

// tupleReader reads an Insert's TupleData as pglogrepl does, into slices it
// reuses for every row: each value is a slice of the tuple's bytes, which
// the event keeps (its payload). read returns an error where tupleSize
// would; parseItem has run tupleSize on every tuple it passes on.
type tupleReader struct {
	tuple pglogrepl.TupleData
	cols  []pglogrepl.TupleDataColumn
	ptrs  []*pglogrepl.TupleDataColumn
}

func (r *tupleReader) read(b []byte) (*pglogrepl.TupleData, error) {
	if len(b) < 2 {
		return nil, errors.New("tuple cut before its column count")
	}
	ncols, off := int(binary.BigEndian.Uint16(b)), 2
	if cap(r.cols) < ncols {
		r.cols = make([]pglogrepl.TupleDataColumn, ncols)
		r.ptrs = make([]*pglogrepl.TupleDataColumn, ncols)
	}
	r.cols, r.ptrs = r.cols[:ncols], r.ptrs[:ncols]
	for i := range r.cols {
		c := &r.cols[i]
		*c = pglogrepl.TupleDataColumn{}
		r.ptrs[i] = c
		if off >= len(b) {
			return nil, fmt.Errorf("tuple cut at column %d of %d", i+1, ncols)
		}
		c.DataType = b[off]
		off++
		if c.DataType != pglogrepl.TupleDataTypeText && c.DataType != pglogrepl.TupleDataTypeBinary {
			continue
		}
		if len(b)-off < 4 {
			return nil, fmt.Errorf("tuple cut in the length of column %d", i+1)
		}
		c.Length = binary.BigEndian.Uint32(b[off:])
		off += 4
		if uint64(c.Length) > uint64(len(b)-off) {
			return nil, fmt.Errorf("tuple column %d claims %d bytes, %d are left", i+1, c.Length, len(b)-off)
		}
		end := off + int(c.Length)
		c.Data = b[off:end:end]
		off = end
	}
	r.tuple = pglogrepl.TupleData{ColumnNum: uint16(ncols), Columns: r.ptrs}
	if ncols == 0 {
		r.tuple.Columns = nil // as pglogrepl leaves it
	}
	return &r.tuple, nil
}

// forget drops the reader's references to the last tuple read, so that a
// large payload is not kept alive by the reader after its event is gone.
func (r *tupleReader) forget() {
	clear(r.cols)
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
	// data is a slice of the tuple's copy, which nothing writes, and the
	// string does not outlive this call: read in place rather than copied
	// into a string that time.Parse's error makes escape
	// (docs/performance.md, "Between goroutines").
	ts, err := parseTimestamptz(unsafe.String(unsafe.SliceData(data), len(data)))
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
	// values (docs/performance.md, "Between goroutines").
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

	// jsonb's text form, verbatim: a slice of the tuple's copy (parseItem).
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
