package natstest_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

func connect(tb testing.TB, s *natstest.Server, opts ...nats.Option) *nats.Conn {
	tb.Helper()
	nc, err := nats.Connect(s.URL(), append(s.ClientOptions(), opts...)...)
	if err != nil {
		tb.Fatalf("connect: %v", err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

func TestRestartKeepsStreamAndReconnects(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s := natstest.Start(t, natstest.WithSyncAlways())
	port := s.Port()

	reconnected := make(chan struct{}, 1)
	nc := connect(t, s,
		nats.MaxReconnects(-1),
		nats.ReconnectWait(50*time.Millisecond),
		nats.ReconnectHandler(func(*nats.Conn) {
			select {
			case reconnected <- struct{}{}:
			default:
			}
		}))
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:       "EVENTS",
		Subjects:   []string{"events.>"},
		Storage:    jetstream.FileStorage,
		Duplicates: time.Hour,
	}); err != nil {
		t.Fatalf("create stream: %v", err)
	}
	msg := &nats.Msg{Subject: "events.order", Data: []byte(`{"id":1}`)}
	ack, err := js.PublishMsg(ctx, msg, jetstream.WithMsgID("event-1"))
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	if ack.Duplicate || ack.Sequence != 1 {
		t.Fatalf("first publish ack = %+v, want sequence 1, not duplicate", ack)
	}

	s.Shutdown()
	if s.Server() != nil {
		t.Error("Server() after Shutdown is not nil")
	}
	s.Restart(t)
	if s.Port() != port {
		t.Errorf("port changed from %d to %d", port, s.Port())
	}
	select {
	case <-reconnected:
	case <-ctx.Done():
		t.Fatal("client did not reconnect after Restart")
	}

	stream, err := js.Stream(ctx, "EVENTS")
	if err != nil {
		t.Fatalf("stream after restart: %v", err)
	}
	if n := stream.CachedInfo().State.Msgs; n != 1 {
		t.Errorf("stream holds %d messages after restart, want 1", n)
	}
	got, err := stream.GetMsg(ctx, 1)
	if err != nil {
		t.Fatalf("get message 1: %v", err)
	}
	if !bytes.Equal(got.Data, msg.Data) || got.Header.Get(jetstream.MsgIDHeader) != "event-1" {
		t.Errorf("message 1 = %q with Msg-Id %q, want %q with event-1", got.Data, got.Header.Get(jetstream.MsgIDHeader), msg.Data)
	}
	// The duplicate window is persisted with the stream.
	ack, err = js.PublishMsg(ctx, &nats.Msg{Subject: "events.order", Data: msg.Data}, jetstream.WithMsgID("event-1"))
	if err != nil {
		t.Fatalf("republish: %v", err)
	}
	if !ack.Duplicate {
		t.Errorf("republish after restart ack = %+v, want a duplicate", ack)
	}
}

func TestRestartWaitsForBusyPort(t *testing.T) {
	s := natstest.Start(t)
	s.Shutdown()
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port())))
	if err != nil {
		t.Fatalf("hold the port: %v", err)
	}
	time.AfterFunc(300*time.Millisecond, func() { _ = l.Close() })
	s.Restart(t)
	nc := connect(t, s)
	if !nc.IsConnected() {
		t.Error("not connected after Restart")
	}
}

func TestOptions(t *testing.T) {
	t.Run("token", func(t *testing.T) {
		s := natstest.Start(t, natstest.WithToken("s3cret"))
		if nc, err := nats.Connect(s.URL()); err == nil {
			nc.Close()
			t.Fatal("connected without the token")
		} else if !errors.Is(err, nats.ErrAuthorization) {
			t.Errorf("connect without token: %v, want an authorization error", err)
		}
		connect(t, s)
	})
	t.Run("user and password", func(t *testing.T) {
		s := natstest.Start(t, natstest.WithUserPassword("relay", "pw"))
		if nc, err := nats.Connect(s.URL(), nats.UserInfo("relay", "wrong")); err == nil {
			nc.Close()
			t.Fatal("connected with a wrong password")
		}
		connect(t, s)
	})
	t.Run("max payload", func(t *testing.T) {
		s := natstest.Start(t, natstest.WithMaxPayload(4096))
		nc := connect(t, s)
		if got := nc.MaxPayload(); got != 4096 {
			t.Errorf("MaxPayload() = %d, want 4096", got)
		}
		if err := nc.Publish("big", make([]byte, 4097)); !errors.Is(err, nats.ErrMaxPayload) {
			t.Errorf("publish 4097 bytes: %v, want ErrMaxPayload", err)
		}
	})
	t.Run("sync always", func(t *testing.T) {
		s := natstest.Start(t, natstest.WithSyncAlways())
		if !s.Server().JetStreamConfig().SyncAlways {
			t.Error("JetStream SyncAlways is off")
		}
		plain := natstest.Start(t)
		if plain.Server().JetStreamConfig().SyncAlways {
			t.Error("JetStream SyncAlways is on without WithSyncAlways")
		}
	})
}
