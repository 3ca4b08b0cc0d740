package nats_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

const testStream = "OUTBOX"

// testDeployment scopes the test sinks' message ids.
var testDeployment = natssink.Deployment{ID: "test"}

// scopedID is the Nats-Msg-Id a test sink sends for id.
func scopedID(id string) string { return testDeployment.ID + ":" + id }

// testConfig is a sink configuration for srv that creates the stream.
func testConfig(srv *natstest.Server) natssink.Config {
	return natssink.Config{
		Name:       "nats",
		URL:        srv.URL(),
		Subject:    natssink.DefaultSubject,
		Deployment: testDeployment,
		Stream: natssink.StreamConfig{
			Name:            testStream,
			Subjects:        []string{"outbox.>"},
			DuplicateWindow: time.Minute,
			Create:          true,
		},
		Options: append(srv.ClientOptions(), nats.ReconnectWait(50*time.Millisecond)),
		Logger:  zerolog.Nop(),
	}
}

// MustNew starts a sink and closes it when tb ends.
func MustNew(tb testing.TB, cfg natssink.Config) *natssink.Sink {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := natssink.New(ctx, cfg)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = s.Close(ctx)
	})
	return s
}

// MustJetStream connects a test client to srv.
func MustJetStream(tb testing.TB, srv *natstest.Server) jetstream.JetStream {
	tb.Helper()
	nc, err := nats.Connect(srv.URL(), append(srv.ClientOptions(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))...)
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatal(err)
	}
	return js
}

// stored reads every message of the stream through an ordered consumer.
func stored(tb testing.TB, js jetstream.JetStream, stream string) []jetstream.Msg {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		tb.Fatalf("stream %s: %v", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		tb.Fatalf("stream info: %v", err)
	}
	n := info.State.Msgs
	if n == 0 {
		return nil
	}
	// Retried: just after a cluster healed, the meta layer can answer
	// 503 "JetStream system temporarily unavailable" for a moment.
	var cons jetstream.Consumer
	for {
		cons, err = js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			tb.Fatalf("ordered consumer: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	it, err := cons.Messages()
	if err != nil {
		tb.Fatal(err)
	}
	defer it.Stop()
	msgs := make([]jetstream.Msg, 0, n)
	for range n {
		m, err := it.Next(jetstream.NextMaxWait(10 * time.Second))
		if err != nil {
			tb.Fatalf("read stream: %v (after %d of %d)", err, len(msgs), n)
		}
		msgs = append(msgs, m)
	}
	return msgs
}

// delivery returns a first-attempt delivery of an order event.
func delivery(n int) *relay.Delivery {
	e := &relay.Event{
		ID:            int64(n),
		EventKey:      fmt.Sprintf("evt-%d", n),
		EventType:     ptr("order.placed"),
		AggregateType: ptr("order"),
		AggregateID:   ptr(fmt.Sprintf("O-%d", n%31)),
		Payload:       []byte(fmt.Sprintf(`{"n": %d, "note": "é ✓"}`, n)),
		CreatedAt:     time.Date(2026, 3, 1, 12, 0, 0, 123456000, time.UTC),
	}
	return &relay.Delivery{Event: e, Body: e.AppendEnvelope(nil), Attempt: 1}
}

// sendSync sends d and returns its outcome, failing tb unless done is
// called exactly once.
func sendSync(tb testing.TB, s relay.Sink, d *relay.Delivery) error {
	tb.Helper()
	errs := make(chan error, 2)
	s.Send(context.Background(), d, func(err error) { errs <- err })
	select {
	case err := <-errs:
		select {
		case <-errs:
			tb.Fatalf("done called twice for %s", d.Event.EventKey)
		case <-time.After(20 * time.Millisecond):
		}
		return err
	case <-time.After(30 * time.Second):
		tb.Fatalf("done not called for %s", d.Event.EventKey)
		return nil
	}
}

func class(err error) relay.ErrorClass {
	c, _ := relay.Classify(err)
	return c
}

func TestDeliversConcurrently(t *testing.T) {
	srv := natstest.Start(t)
	s := MustNew(t, testConfig(srv))
	js := MustJetStream(t, srv)

	const n = 1000
	var calls [n]atomic.Int32
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			s.Send(context.Background(), delivery(i), func(err error) {
				if err != nil {
					t.Errorf("evt-%d: %v", i, err)
				}
				calls[i].Add(1)
				wg.Done()
			})
		}()
	}
	wg.Wait()
	for i := range n {
		if c := calls[i].Load(); c != 1 {
			t.Fatalf("evt-%d: done called %d times", i, c)
		}
	}

	msgs := stored(t, js, testStream)
	if len(msgs) != n {
		t.Fatalf("stream holds %d messages, want %d", len(msgs), n)
	}
	seen := map[string]bool{}
	for _, m := range msgs {
		id := m.Headers().Get(jetstream.MsgIDHeader)
		if seen[id] {
			t.Fatalf("%s stored twice", id)
		}
		seen[id] = true
		i, err := strconv.Atoi(strings.TrimPrefix(id, scopedID("evt-")))
		if err != nil {
			t.Fatalf("unexpected Nats-Msg-Id %q", id)
		}
		d := delivery(i)
		if m.Subject() != "outbox.order.order_placed" {
			t.Fatalf("%s: subject %q", id, m.Subject())
		}
		if !bytes.Equal(m.Data(), d.Body) {
			t.Fatalf("%s: data %s, want %s", id, m.Data(), d.Body)
		}
		want := map[string]string{
			natssink.HeaderEventKey:      d.Event.EventKey,
			natssink.HeaderEventType:     "order.placed",
			natssink.HeaderAggregateType: "order",
			natssink.HeaderAggregateID:   *d.Event.AggregateID,
			natssink.HeaderEventID:       strconv.Itoa(i),
			natssink.HeaderAttempt:       "1",
		}
		for k, v := range want {
			if got := m.Headers().Get(k); got != v {
				t.Fatalf("%s: header %s = %q, want %q", id, k, got, v)
			}
		}
		if got := m.Headers().Get(natssink.HeaderOriginalEventKey); got != "" {
			t.Fatalf("%s: %s set on a normal delivery", id, natssink.HeaderOriginalEventKey)
		}
	}
	if s.Duplicates() != 0 {
		t.Fatalf("Duplicates() = %d, want 0", s.Duplicates())
	}
}

func TestNullFieldsOmitHeaders(t *testing.T) {
	srv := natstest.Start(t)
	s := MustNew(t, testConfig(srv))
	js := MustJetStream(t, srv)

	e := &relay.Event{ID: 5, EventKey: "evt-null"}
	d := &relay.Delivery{Event: e, Body: e.AppendEnvelope(nil), Attempt: 2}
	if err := sendSync(t, s, d); err != nil {
		t.Fatal(err)
	}
	m := stored(t, js, testStream)[0]
	if m.Subject() != "outbox._._" {
		t.Fatalf("subject %q, want outbox._._", m.Subject())
	}
	for _, h := range []string{natssink.HeaderEventType, natssink.HeaderAggregateType, natssink.HeaderAggregateID} {
		if _, ok := m.Headers()[h]; ok {
			t.Fatalf("header %s present for a NULL column", h)
		}
	}
	if got := m.Headers().Get(natssink.HeaderAttempt); got != "2" {
		t.Fatalf("attempt header %q, want 2", got)
	}
}

func TestRepeatIsDeduplicated(t *testing.T) {
	srv := natstest.Start(t)
	s := MustNew(t, testConfig(srv))
	js := MustJetStream(t, srv)

	first := delivery(1)
	if err := sendSync(t, s, first); err != nil {
		t.Fatal(err)
	}
	again := delivery(1)
	again.Attempt = 2
	if err := sendSync(t, s, again); err != nil {
		t.Fatalf("repeat: %v", err)
	}
	if s.Duplicates() != 1 {
		t.Fatalf("Duplicates() = %d, want 1", s.Duplicates())
	}
	msgs := stored(t, js, testStream)
	if len(msgs) != 1 {
		t.Fatalf("stream holds %d messages, want 1", len(msgs))
	}
	if got := msgs[0].Headers().Get(natssink.HeaderAttempt); got != "1" {
		t.Fatalf("stored attempt %q, want the first one", got)
	}
}

func TestUnsafeKeysStayDistinct(t *testing.T) {
	srv := natstest.Start(t)
	s := MustNew(t, testConfig(srv))
	js := MustJetStream(t, srv)

	// nats.go would send both as "a b"; the second must not be dropped as
	// a duplicate of the first.
	for i, key := range []string{"a b", "a\nb"} {
		d := delivery(i)
		d.Event.EventKey = key
		if err := sendSync(t, s, d); err != nil {
			t.Fatal(err)
		}
	}
	if s.Duplicates() != 0 {
		t.Fatalf("Duplicates() = %d, want 0", s.Duplicates())
	}
	msgs := stored(t, js, testStream)
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d messages, want 2", len(msgs))
	}
	if got, want := msgs[1].Headers().Get(jetstream.MsgIDHeader), scopedID(natssink.HeaderValue("a\nb")); got != want {
		t.Fatalf("Nats-Msg-Id %q, want %q", got, want)
	}
}

func TestReplayStoresSecondMessage(t *testing.T) {
	srv := natstest.Start(t)
	s := MustNew(t, testConfig(srv))
	js := MustJetStream(t, srv)

	if err := sendSync(t, s, delivery(1)); err != nil {
		t.Fatal(err)
	}
	replay := delivery(1)
	replay.Replay = 1
	if err := sendSync(t, s, replay); err != nil {
		t.Fatalf("replay: %v", err)
	}
	// The same replay again is a duplicate of the replay.
	if err := sendSync(t, s, replay); err != nil {
		t.Fatalf("replay repeat: %v", err)
	}
	msgs := stored(t, js, testStream)
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d messages, want 2", len(msgs))
	}
	h := msgs[1].Headers()
	if got := h.Get(jetstream.MsgIDHeader); got != scopedID("evt-1~r1") {
		t.Fatalf("replay Nats-Msg-Id %q, want %s", got, scopedID("evt-1~r1"))
	}
	if got := h.Get(natssink.HeaderOriginalEventKey); got != "evt-1" {
		t.Fatalf("replay %s %q, want evt-1", natssink.HeaderOriginalEventKey, got)
	}
	if got := h.Get(natssink.HeaderEventKey); got != "evt-1" {
		t.Fatalf("replay %s %q, want evt-1", natssink.HeaderEventKey, got)
	}
	if !bytes.Equal(msgs[0].Data(), msgs[1].Data()) {
		t.Fatal("replay body differs")
	}
	if s.Duplicates() != 1 {
		t.Fatalf("Duplicates() = %d, want 1", s.Duplicates())
	}
}

func TestOversizeMessageIsPermanent(t *testing.T) {
	tests := []struct {
		name    string
		server  []natstest.Option
		stream  int64 // the created stream's max_msg_size
		body    int
		limit   string
		fitting int
	}{
		{name: "server max_payload", server: []natstest.Option{natstest.WithMaxPayload(4096)}, body: 5000, limit: "max_payload of 4096", fitting: 3000},
		{name: "stream max_msg_size", stream: 2048, body: 3000, limit: "max_msg_size of 2048", fitting: 1000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := natstest.Start(t, tt.server...)
			cfg := testConfig(srv)
			cfg.Stream.MaxMsgSize = tt.stream
			s := MustNew(t, cfg)
			js := MustJetStream(t, srv)

			big := delivery(1)
			big.Body = bytes.Repeat([]byte("x"), tt.body)
			err := sendSync(t, s, big)
			if class(err) != relay.Permanent {
				t.Fatalf("oversize: %v, want a permanent error", err)
			}
			for _, want := range []string{"evt-1", tt.limit, "bytes"} {
				if !strings.Contains(err.Error(), want) {
					t.Fatalf("error %q does not mention %q", err, want)
				}
			}
			// The events behind it keep flowing.
			small := delivery(2)
			small.Body = bytes.Repeat([]byte("y"), tt.fitting)
			if err := sendSync(t, s, small); err != nil {
				t.Fatalf("fitting message: %v", err)
			}
			msgs := stored(t, js, testStream)
			if len(msgs) != 1 || msgs[0].Headers().Get(jetstream.MsgIDHeader) != scopedID("evt-2") {
				t.Fatalf("stream holds %d messages, want only evt-2", len(msgs))
			}
		})
	}
}

func TestNewStreamChecks(t *testing.T) {
	tests := []struct {
		name     string
		existing *jetstream.StreamConfig
		modify   func(*natssink.Config)
		wantErr  []string
	}{
		{
			name:    "missing stream without create",
			modify:  func(c *natssink.Config) { c.Stream.Create = false },
			wantErr: []string{`"OUTBOX"`, "does not exist", "create: true"},
		},
		{
			name:     "subjects not captured",
			existing: &jetstream.StreamConfig{Name: testStream, Subjects: []string{"outbox.order.*"}, Duplicates: time.Hour},
			wantErr:  []string{`"OUTBOX"`, "does not capture", "outbox.*.*", "outbox.>"},
		},
		{
			name:     "subjects in another stream",
			existing: &jetstream.StreamConfig{Name: "OTHER", Subjects: []string{"outbox.>"}, Duplicates: time.Hour},
			modify:   func(c *natssink.Config) { c.Stream.Create = false },
			wantErr:  []string{`"OUTBOX"`, "does not exist"},
		},
		{
			name:     "payload in the template",
			existing: &jetstream.StreamConfig{Name: testStream, Subjects: []string{"outbox.>"}, Duplicates: time.Hour},
			modify:   func(c *natssink.Config) { c.Subject = "outbox.{{.Payload}}" },
			wantErr:  []string{"Payload"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := natstest.Start(t)
			if tt.existing != nil {
				if _, err := MustJetStream(t, srv).CreateStream(context.Background(), *tt.existing); err != nil {
					t.Fatal(err)
				}
			}
			cfg := testConfig(srv)
			if tt.modify != nil {
				tt.modify(&cfg)
			}
			s, err := natssink.New(context.Background(), cfg)
			if err == nil {
				_ = s.Close(context.Background())
				t.Fatal("New succeeded")
			}
			for _, want := range tt.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Fatalf("error %q does not mention %q", err, want)
				}
			}
		})
	}
}

// TestNewWarnsAboutASmallerDuplicateWindow: an existing stream whose
// duplicate window is smaller than the sink's (one made under an older
// default, say) is used, with a warning that names the fix: a window that is
// too short costs a second copy of a late re-send, never an event.
func TestNewWarnsAboutASmallerDuplicateWindow(t *testing.T) {
	srv := natstest.Start(t)
	if _, err := MustJetStream(t, srv).CreateStream(context.Background(),
		jetstream.StreamConfig{Name: testStream, Subjects: []string{"outbox.>"}, Duplicates: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(srv)
	cfg.Stream.DuplicateWindow = 0 // the default
	var log lockedBuffer           // the connection's callbacks log from their own goroutine
	cfg.Logger = zerolog.New(&log)
	s := MustNew(t, cfg)
	if err := sendSync(t, s, delivery(1)); err != nil {
		t.Fatalf("send: %v", err)
	}
	line := log.String()
	for _, want := range []string{`"level":"warn"`, `"stream":"OUTBOX"`, "2m0s", natssink.DefaultDuplicateWindow.String(),
		"nats stream edit OUTBOX --dupe-window " + natssink.DefaultDuplicateWindow.String()} {
		if !strings.Contains(line, want) {
			t.Fatalf("log lacks %q:\n%s", want, line)
		}
	}
}

func TestNewCreatesStream(t *testing.T) {
	srv := natstest.Start(t)
	cfg := testConfig(srv)
	cfg.Stream.Subjects = nil // derived from the template: outbox.>
	cfg.Stream.DuplicateWindow = 5 * time.Minute
	cfg.Stream.MaxMsgSize = 65536
	MustNew(t, cfg)

	st, err := MustJetStream(t, srv).Stream(context.Background(), testStream)
	if err != nil {
		t.Fatalf("stream not created: %v", err)
	}
	sc := st.CachedInfo().Config
	if len(sc.Subjects) != 1 || sc.Subjects[0] != "outbox.>" || sc.Duplicates != 5*time.Minute ||
		sc.Storage != jetstream.FileStorage || sc.MaxMsgSize != 65536 {
		t.Fatalf("created stream %+v", sc)
	}
	// A second sink finds it and accepts it.
	MustNew(t, cfg)
}

func TestReconnectsAfterServerRestart(t *testing.T) {
	srv := natstest.Start(t, natstest.WithSyncAlways())
	cfg := testConfig(srv)
	cfg.AckTimeout = 2 * time.Second
	s := MustNew(t, cfg)
	js := MustJetStream(t, srv)

	if err := sendSync(t, s, delivery(0)); err != nil {
		t.Fatal(err)
	}

	// Publish a stream of events while the server goes away: each either
	// lands or fails as SinkDown (not sent) or Unknown (sent, no ack).
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		outcomes = map[string]int{}
		calls    atomic.Int64
	)
	stop := make(chan struct{})
	sent := 0
	go func() {
		time.Sleep(20 * time.Millisecond)
		srv.Shutdown()
		close(stop)
	}()
	for i := 1; ; i++ {
		select {
		case <-stop:
		default:
			wg.Add(1)
			sent++
			s.Send(context.Background(), delivery(i), func(err error) {
				calls.Add(1)
				mu.Lock()
				if err == nil {
					outcomes["delivered"]++
				} else {
					outcomes[class(err).String()]++
				}
				mu.Unlock()
				wg.Done()
			})
			time.Sleep(time.Millisecond)
			continue
		}
		break
	}
	wg.Wait()
	if int(calls.Load()) != sent {
		t.Fatalf("done called %d times for %d sends", calls.Load(), sent)
	}
	for c := range outcomes {
		if c != "delivered" && c != relay.SinkDown.String() && c != relay.Unknown.String() {
			t.Fatalf("outcomes %v: a %s failure while the server was going down", outcomes, c)
		}
	}

	// Once the client has noticed, Sends fail fast as SinkDown; until then
	// a Send may still be written to the dying socket (Unknown).
	for deadline := time.Now().Add(10 * time.Second); ; {
		err := sendSync(t, s, delivery(100000))
		if class(err) == relay.SinkDown && err != nil {
			break
		}
		if err == nil || class(err) != relay.Unknown || time.Now().After(deadline) {
			t.Fatalf("send while down: %v, want sink-down", err)
		}
		time.Sleep(10 * time.Millisecond)
	}

	srv.Restart(t)
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := sendSync(t, s, delivery(100001))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no delivery after restart: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	msgs := stored(t, js, testStream)
	last := msgs[len(msgs)-1]
	if got := last.Headers().Get(jetstream.MsgIDHeader); got != scopedID("evt-100001") {
		t.Fatalf("last stored %q, want evt-100001", got)
	}
	t.Logf("outcomes while shutting down: %v", outcomes)
}

// hangAcks deletes the stream after the sink started and answers nothing on
// its subjects, so publishes reach a responder but never get a PubAck.
func hangAcks(t *testing.T, srv *natstest.Server) {
	t.Helper()
	js := MustJetStream(t, srv)
	if err := js.DeleteStream(context.Background(), testStream); err != nil {
		t.Fatal(err)
	}
	nc := js.Conn()
	sub, err := nc.Subscribe("outbox.>", func(*nats.Msg) {})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

func TestAckTimeoutIsUnknown(t *testing.T) {
	srv := natstest.Start(t)
	cfg := testConfig(srv)
	cfg.AckTimeout = 200 * time.Millisecond
	s := MustNew(t, cfg)
	hangAcks(t, srv)

	err := sendSync(t, s, delivery(1))
	if class(err) != relay.Unknown || !strings.Contains(err.Error(), "evt-1") {
		t.Fatalf("send without ack: %v, want unknown naming the key", err)
	}
}

func TestStreamDeletedIsSinkDown(t *testing.T) {
	srv := natstest.Start(t)
	s := MustNew(t, testConfig(srv))
	if err := MustJetStream(t, srv).DeleteStream(context.Background(), testStream); err != nil {
		t.Fatal(err)
	}
	if err := sendSync(t, s, delivery(1)); class(err) != relay.SinkDown {
		t.Fatalf("send without a stream: %v, want sink-down", err)
	}
}

func TestFullWindowBlocksUntilContextEnds(t *testing.T) {
	srv := natstest.Start(t)
	cfg := testConfig(srv)
	cfg.MaxPending = 2
	cfg.AckTimeout = time.Minute
	s := MustNew(t, cfg)
	hangAcks(t, srv)

	for i := range 2 {
		s.Send(context.Background(), delivery(i), func(error) {})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	errs := make(chan error, 1)
	s.Send(ctx, delivery(2), func(err error) { errs <- err })
	err := <-errs
	if waited := time.Since(start); waited < 80*time.Millisecond {
		t.Fatalf("Send returned after %s with a full window", waited)
	}
	if class(err) != relay.Transient || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked send: %v, want transient wrapping the deadline", err)
	}
	// The two hung publishes complete as Unknown when Close gives up.
	closeCtx, cancelClose := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancelClose()
	if err := s.Close(closeCtx); err == nil {
		t.Fatal("Close with unacknowledged publishes returned nil")
	}
}

func TestCloseCompletesEveryDelivery(t *testing.T) {
	tests := []struct {
		name string
		hang bool // acks never come: Close gives up at its deadline
	}{
		{name: "acks arrive"},
		{name: "acks never come", hang: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := natstest.Start(t)
			cfg := testConfig(srv)
			cfg.AckTimeout = time.Minute
			s, err := natssink.New(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			if tt.hang {
				hangAcks(t, srv)
			}
			const n = 200
			var calls [n]atomic.Int32
			var unknown atomic.Int32
			var wg sync.WaitGroup
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					s.Send(context.Background(), delivery(i), func(err error) {
						calls[i].Add(1)
						if class(err) == relay.Unknown && err != nil {
							unknown.Add(1)
						}
					})
				}()
			}
			time.Sleep(20 * time.Millisecond) // let some publish
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			closeErr := s.Close(ctx)
			wg.Wait() // Sends racing Close return too
			for i := range n {
				if c := calls[i].Load(); c != 1 {
					t.Fatalf("evt-%d: done called %d times", i, c)
				}
			}
			if tt.hang && (closeErr == nil || unknown.Load() == 0) {
				t.Fatalf("Close = %v with %d unknown outcomes, want an error and unknown outcomes", closeErr, unknown.Load())
			}
			if !tt.hang && closeErr != nil {
				t.Fatalf("Close: %v", closeErr)
			}
			// After Close, Send fails at once.
			if err := sendSync(t, s, delivery(n)); class(err) != relay.SinkDown || !errors.Is(err, natssink.ErrClosed) {
				t.Fatalf("send after Close: %v, want sink-down ErrClosed", err)
			}
			if err := s.Close(context.Background()); !errors.Is(err, closeErr) && err != closeErr {
				t.Fatalf("second Close = %v, want %v", err, closeErr)
			}
		})
	}
}

func TestEmbeddedServer(t *testing.T) {
	dataDir := t.TempDir()
	s, err := natssink.New(context.Background(), natssink.Config{
		Name:       "nats",
		DataDir:    dataDir,
		Deployment: testDeployment,
		Logger:     zerolog.Nop(),
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	url := s.ClientURL()
	if !strings.HasPrefix(url, "nats://127.0.0.1:") || strings.HasSuffix(url, ":4222") {
		t.Fatalf("ClientURL %q, want a free loopback port", url)
	}
	if err := sendSync(t, s, delivery(1)); err != nil {
		t.Fatalf("send: %v", err)
	}

	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("connect to the embedded server: %v", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(context.Background(), natssink.DefaultStreamName)
	if err != nil {
		t.Fatalf("default stream: %v", err)
	}
	if info, err := st.Info(context.Background()); err != nil || info.State.Msgs != 1 {
		t.Fatalf("stream info %+v, %v; want one message", info, err)
	}
	nc.Close()

	streamDir := filepath.Join(dataDir, "nats", "jetstream", "$G", "streams", natssink.DefaultStreamName)
	if _, err := os.Stat(streamDir); err != nil {
		t.Fatalf("stream store not under the data dir: %v", err)
	}

	if err := s.Close(context.Background()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	host := strings.TrimPrefix(url, "nats://")
	if c, err := net.DialTimeout("tcp", host, time.Second); err == nil {
		_ = c.Close()
		t.Fatalf("embedded server still listening on %s after Close", host)
	}
}

func TestNewRejectsConfig(t *testing.T) {
	tests := []struct {
		name    string
		cfg     natssink.Config
		wantErr string
	}{
		{"no name", natssink.Config{URL: "nats://127.0.0.1:1", Deployment: testDeployment}, "name is required"},
		{"embedded without data dir", natssink.Config{Name: "n", Deployment: testDeployment}, "data_dir"},
		{"negative window", natssink.Config{Name: "n", URL: "nats://127.0.0.1:1", Deployment: testDeployment, MaxPending: -1}, "max_pending"},
		{"huge max_msg_size", natssink.Config{Name: "n", URL: "nats://127.0.0.1:1", Deployment: testDeployment, Stream: natssink.StreamConfig{MaxMsgSize: 1 << 40}}, "max_msg_size"},
		{"no deployment", natssink.Config{Name: "n", URL: "nats://127.0.0.1:1"}, "deployment id is empty"},
		{"deployment id with a colon", natssink.Config{Name: "n", URL: "nats://127.0.0.1:1", Deployment: natssink.Deployment{ID: "a:b"}}, "only ASCII letters"},
		{"deployment id of encoded keys", natssink.Config{Name: "n", URL: "nats://127.0.0.1:1", Deployment: natssink.Deployment{ID: "b64"}}, "reserved"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := natssink.New(context.Background(), tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || strings.Contains(err.Error(), "secret") {
				t.Fatalf("New: %v, want an error mentioning %q", err, tt.wantErr)
			}
		})
	}
}

// lockedBuffer is a bytes.Buffer safe for a logger written from several
// goroutines and read by the test.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
