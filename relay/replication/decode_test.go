package replication_test

import (
	"encoding/binary"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"weak"

	"github.com/outbox-relay/outbox-relay/relay/replication"
)

// TestMalformedMessagesAreErrors: pglogrepl.Parse indexes a message without
// bounds checks and sizes what it allocates by the lengths the message
// claims, so one truncated or corrupt message panicked the relay (found by
// FuzzDecodeMessages: "I0000N000") or made it allocate up to 16 GiB. Each
// must instead be an error, which ends the session and reconnects, and
// allocate no more than the message's size.
func TestMalformedMessagesAreErrors(t *testing.T) {
	rel := relationMessage(outboxRelID, "public", "integration_outbox", outboxColumns)
	row := make([]tupleValue, len(outboxColumns))
	for i := range row {
		row[i] = textValue("1")
	}
	ins := insertMessage(outboxRelID, row)
	hugeValue := binary.BigEndian.AppendUint32([]byte{'I', 0, 0, 0x40, 0x06, 'N', 0, 1, 't'}, 0xFFFFFFF0)
	tests := []struct {
		name string
		msgs [][]byte
	}{
		{"found by the fuzzer: truncated tuple", [][]byte{[]byte("I0000N000"), []byte("0")}},
		{"insert cut inside a value", [][]byte{rel, ins[:len(ins)-3]}},
		{"insert cut after the column count", [][]byte{rel, ins[:8]}},
		{"insert value of 4 GiB", [][]byte{rel, append(hugeValue, "abc"...)}},
		{"relation cut inside a column", [][]byte{rel[:40], ins}},
		{"relation cut after the column count", [][]byte{rel[:len("R")+4+len("public\x00integration_outbox\x00")+1+2]}},
		{"update with a 4 GiB old key", [][]byte{append([]byte{'U', 0, 0, 0x40, 0x06, 'K', 0, 1, 't', 0xFF, 0xFF, 0xFF, 0xFF}, make([]byte, 8)...)}},
		{"update with a 4 GiB new value", [][]byte{append([]byte{'U', 0, 0, 0x40, 0x06, 'O', 0, 1, 'n', 'X', 0, 1, 'b', 0xFF, 0xFF, 0xFF, 0xFF}, make([]byte, 8)...)}},
		{"update cut before its new tuple", [][]byte{{'U', 0, 0, 0x40, 0x06, 'O', 0, 1, 'n'}}},
		{"delete cut inside its key", [][]byte{{'D', 0, 0, 0x40, 0x06, 'K', 0, 2, 'n'}}},
		{"truncate of 268 million relations", [][]byte{{'T', 0x0F, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0, 1}}},
		{"logical message with a long content", [][]byte{{'M', 1, 0, 0, 0, 0, 0, 0, 0, 1, 'p', 0, 0xFF, 0xFF, 0xFF, 0xFF}}},
		{"logical message without a prefix end", [][]byte{{'M', 1, 0, 0, 0, 0, 0, 0, 0, 1, 'p', 'p', 'p', 'p', 'p'}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			events, err := replication.DecodeMessages(outboxName, tt.msgs...)
			runtime.ReadMemStats(&after)
			if err == nil || !strings.HasPrefix(err.Error(), "parse pgoutput message") {
				t.Fatalf("%d events, error %v; want a parse error", len(events), err)
			}
			if n := after.TotalAlloc - before.TotalAlloc; n > 1<<20 {
				t.Fatalf("decoding allocated %d bytes", n)
			}
		})
	}
}

// TestTraceContextColumnIsOptional: the trace_context column (migration 008)
// is read verbatim when the relation has it; a table without it, a NULL, or
// a value in a form the decoder cannot read gives an event without trace
// context, never an error.
func TestTraceContextColumnIsOptional(t *testing.T) {
	const tc = `{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`
	withColumn := append(slices.Clone(outboxColumns), pgColumn{"trace_context", 3802})
	row := func(cols []pgColumn, traceContext tupleValue) []tupleValue {
		out := make([]tupleValue, len(cols))
		for i, c := range cols {
			switch c.name {
			case "id":
				out[i] = textValue("1")
			case "event_key":
				out[i] = textValue("k1")
			case "trace_context":
				out[i] = traceContext
			default:
				out[i] = nullValue
			}
		}
		return out
	}
	tests := []struct {
		name  string
		cols  []pgColumn
		value tupleValue
		want  string
	}{
		{"column with a value", withColumn, textValue(tc), tc},
		{"column NULL", withColumn, nullValue, ""},
		{"binary value", withColumn, tupleValue{kind: 'b', data: []byte{1}}, ""},
		{"no such column", outboxColumns, nullValue, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			events, err := replication.DecodeMessages(outboxName,
				relationMessage(outboxRelID, "public", "integration_outbox", tt.cols),
				beginMessage(finalLSN, commitTime, 7),
				insertMessage(outboxRelID, row(tt.cols, tt.value)),
				commitMessage(finalLSN, endLSN, commitTime))
			if err != nil || len(events) != 1 {
				t.Fatalf("%d events, err %v", len(events), err)
			}
			if got := string(events[0].TraceContext); got != tt.want || (tt.want == "") != (events[0].TraceContext == nil) {
				t.Fatalf("TraceContext %q, want %q", got, tt.want)
			}
		})
	}
}

// newOutboxDecoder returns the stream's parser and decoder, fed the outbox's
// RELATION message.
func newOutboxDecoder(tb testing.TB) *replication.Decoder {
	tb.Helper()
	d := replication.NewDecoder(outboxName)
	if _, err := d.Feed(relationMessage(outboxRelID, "public", "integration_outbox", outboxColumns)); err != nil {
		tb.Fatal(err)
	}
	return d
}

// outboxRow is an outbox row with the values in set, NULL elsewhere.
func outboxRow(set map[string]tupleValue) []tupleValue {
	out := make([]tupleValue, len(outboxColumns))
	for i, c := range outboxColumns {
		if v, ok := set[c.name]; ok {
			out[i] = v
		} else {
			out[i] = nullValue
		}
	}
	return out
}

// TestSingleEventTransactionAllocatesOnlyItsEvent: a single-row
// transaction (Begin, Insert, Commit) goes through the stream's parser and
// decoder allocating only what the event keeps: the copy of the tuple (its
// payload is a slice of it), the event and its text values
// (docs/performance.md, "Between goroutines"). pglogrepl allocates the Begin, the
// Commit, the Insert and two objects per column; FuzzParseItem and
// FuzzDecodeMessages check that both read the same.
func TestSingleEventTransactionAllocatesOnlyItsEvent(t *testing.T) {
	row := make([]tupleValue, len(outboxColumns))
	for i, c := range outboxColumns {
		switch c.name {
		case "id", "attempts":
			row[i] = textValue("42")
		case "created_at", "available_at":
			row[i] = textValue("2026-12-02 16:17:36.123456+00")
		case "status":
			row[i] = textValue("pending")
		default:
			row[i] = textValue(c.name + " value")
		}
	}
	d := newOutboxDecoder(t)
	begin, ins, commit := beginMessage(finalLSN, commitTime, 7), insertMessage(outboxRelID, row), commitMessage(finalLSN, endLSN, commitTime)
	var n int
	var err error
	allocs := testing.AllocsPerRun(100, func() { n, err = d.Feed(begin, ins, commit) })
	if err != nil || n != 1 {
		t.Fatalf("%d events, %v", n, err)
	}
	if allocs > 3 {
		t.Fatalf("%.0f allocations per single-event transaction, want at most 3 (the tuple's copy, the event, its texts)", allocs)
	}
}

// TestDecoderKeepsNoEventAlive: the decoder reuses its batch and its
// columns from one transaction to the next; once the consumer has let go of
// an event, nothing of the decoder may keep its payload (a large one would
// stay in memory until the next row) — the edge of that reused state.
func TestDecoderKeepsNoEventAlive(t *testing.T) {
	row := outboxRow(map[string]tupleValue{
		"id": textValue("1"), "event_key": textValue("big"), "payload": textValue(`"` + strings.Repeat("x", 1<<20) + `"`),
	})
	d := newOutboxDecoder(t)
	payload, err := d.FeedAndWatch(beginMessage(finalLSN, commitTime, 7), insertMessage(outboxRelID, row), commitMessage(finalLSN, endLSN, commitTime))
	if err != nil || payload == (weak.Pointer[byte]{}) {
		t.Fatalf("no event decoded: %v", err)
	}
	for range 3 {
		runtime.GC()
	}
	if payload.Value() != nil {
		t.Fatal("the decoder still holds the last event's payload after the consumer let go of it")
	}
	runtime.KeepAlive(d)
}

// TestDecoderBatchesByBytes: the decoder hands a transaction's events to
// the consumer in batches of at most 256 events and about 4 MiB of
// payloads: a transaction of large payloads is never held whole before the
// engine counts it against its byte budget (docs/performance.md, "Memory"),
// and a payload larger than that goes alone.
func TestDecoderBatchesByBytes(t *testing.T) {
	const rows, size = 64, 5 << 20
	d := newOutboxDecoder(t)
	payload := textValue(`"` + strings.Repeat("x", size) + `"`)
	msgs := [][]byte{beginMessage(finalLSN, commitTime, 7)}
	for i := range rows {
		msgs = append(msgs, insertMessage(outboxRelID, outboxRow(map[string]tupleValue{
			"id": textValue(strconv.Itoa(i + 1)), "event_key": textValue("big-" + strconv.Itoa(i)), "payload": payload,
		})))
	}
	msgs = append(msgs, commitMessage(finalLSN, endLSN, commitTime))
	events, bytes, err := d.FeedBatches(msgs...)
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != rows {
		t.Fatalf("%d batches of %v events, want %d of one event each", len(events), events, rows)
	}
	for i, n := range bytes {
		if events[i] != 1 || n > size+2 {
			t.Fatalf("batch %d held %d events, %d payload bytes: want one %d-byte payload", i, events[i], n, size+2)
		}
	}
}

// BenchmarkDecodeEvent: the allocations and time of one single-row
// transaction's way through the parser and the decoder (Begin, Insert,
// Commit), as the stream sees it at a steady rate (docs/performance.md,
// "Between goroutines").
func BenchmarkDecodeEvent(b *testing.B) {
	payload := `{"order_id": "` + strings.Repeat("x", 280) + `"}`
	row := make([]tupleValue, len(outboxColumns))
	for i, c := range outboxColumns {
		switch c.name {
		case "id":
			row[i] = textValue("123456789")
		case "event_type":
			row[i] = textValue("order.created")
		case "aggregate_type":
			row[i] = textValue("order")
		case "aggregate_id":
			row[i] = textValue("order-4711")
		case "event_key":
			row[i] = textValue("evt-0123456789abcdef")
		case "payload":
			row[i] = textValue(payload)
		case "status":
			row[i] = textValue("pending")
		case "attempts":
			row[i] = textValue("0")
		case "available_at", "created_at":
			row[i] = textValue("2026-12-02 16:17:36.123456+00")
		default:
			row[i] = nullValue
		}
	}
	msgs := [][]byte{
		beginMessage(finalLSN, commitTime, 7),
		insertMessage(outboxRelID, row),
		commitMessage(finalLSN, endLSN, commitTime),
	}
	d := newOutboxDecoder(b)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		n, err := d.Feed(msgs...)
		if err != nil || n != 1 {
			b.Fatalf("%d events, err %v", n, err)
		}
	}
}
