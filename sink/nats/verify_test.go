package nats_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// What the sink publishes, ParseStored reads back: the key (also one that
// travels encoded), the replay number, the id; a message another producer
// put on the subjects is not ours. Read starts at a time, then carries on
// from where it stopped.
func TestStreamReader_ReadsBackWhatTheSinkPublished(t *testing.T) {
	srv := natstest.Start(t)
	s := MustNew(t, testConfig(srv))
	js := MustJetStream(t, srv)
	ctx := context.Background()

	old := delivery(1)
	if err := sendSync(t, s, old); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	since := time.Now()

	var sent []natssink.StoredEvent
	for i, key := range []string{"evt-2", " padded key ", "b64:looks-encoded", "ends~r7", "evt-3"} {
		d := delivery(10 + i)
		d.Event.EventKey = key
		if key == "evt-3" {
			d.Replay = 2
		}
		if err := sendSync(t, s, d); err != nil {
			t.Fatalf("send %q: %v", key, err)
		}
		sent = append(sent, natssink.StoredEvent{EventKey: key, Replay: d.Replay, MsgID: testDeployment.MsgID(d)})
	}
	if _, err := js.Publish(ctx, "outbox.order.placed", []byte(`{}`), jetstream.WithMsgID("someone-else")); err != nil {
		t.Fatal(err)
	}

	r, err := natssink.OpenStream(ctx, natssink.ReaderConfig{URL: srv.URL(), Options: srv.ClientOptions(), Stream: testStream, Deployment: testDeployment.ID})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Removed || r.FirstStored.IsZero() {
		t.Errorf("a stream that removed nothing: removed %v, first stored %v", r.Removed, r.FirstStored)
	}
	var got []natssink.StoredEvent
	n, err := r.Read(ctx, since, func(ev natssink.StoredEvent) {
		if ev.Stored.Before(since) || time.Since(ev.Stored) > time.Minute {
			t.Errorf("%s stored at %s, read from %s", ev.EventKey, ev.Stored, since)
		}
		ev.Stored = time.Time{}
		got = append(got, ev)
	})
	if err != nil {
		t.Fatal(err)
	}
	if n != 6 || r.Foreign != 1 || !slices.Equal(got, sent) {
		t.Fatalf("read %d (%d foreign):\n got  %+v\n want %+v", n, r.Foreign, got, sent)
	}

	// The next Read carries on after the last message read.
	d := delivery(99)
	if err := sendSync(t, s, d); err != nil {
		t.Fatal(err)
	}
	got = nil
	if n, err := r.Read(ctx, time.Time{}, func(ev natssink.StoredEvent) { got = append(got, ev) }); err != nil || n != 1 || len(got) != 1 || got[0].EventKey != "evt-99" {
		t.Fatalf("carry on: %d read, %+v, %v", n, got, err)
	}
	if n, err := r.Read(ctx, time.Time{}, func(natssink.StoredEvent) {}); err != nil || n != 0 {
		t.Fatalf("nothing new: %d read, %v", n, err)
	}
}

func TestParseStored(t *testing.T) {
	h := func(kv ...string) nats.Header {
		out := nats.Header{}
		for i := 0; i < len(kv); i += 2 {
			out.Set(kv[i], kv[i+1])
		}
		return out
	}
	for _, c := range []struct {
		name string
		h    nats.Header
		want natssink.StoredEvent
		ours bool
	}{
		{"an event", h("Nats-Msg-Id", "k", natssink.HeaderEventKey, "k", natssink.HeaderEventID, "1"), natssink.StoredEvent{EventKey: "k", MsgID: "k"}, true},
		{"a replay", h("Nats-Msg-Id", "k~r3", natssink.HeaderEventKey, "k", natssink.HeaderOriginalEventKey, "k", natssink.HeaderEventID, "1"), natssink.StoredEvent{EventKey: "k", Replay: 3, MsgID: "k~r3"}, true},
		{"an encoded key", h("Nats-Msg-Id", "b64:IGsg", natssink.HeaderEventKey, "b64:IGsg", natssink.HeaderEventID, "1"), natssink.StoredEvent{EventKey: " k ", MsgID: "b64:IGsg"}, true},
		{"no event headers", h("Nats-Msg-Id", "k"), natssink.StoredEvent{}, false},
		{"a key that does not decode", h("Nats-Msg-Id", "k", natssink.HeaderEventKey, "b64:!!", natssink.HeaderEventID, "1"), natssink.StoredEvent{}, false},
		{"no id", h(natssink.HeaderEventKey, "k", natssink.HeaderEventID, "1"), natssink.StoredEvent{}, false},
		{"ours, scoped", h("Nats-Msg-Id", "dep-a:k", natssink.HeaderEventKey, "k", natssink.HeaderEventID, "1", natssink.HeaderDeployment, "dep-a"), natssink.StoredEvent{EventKey: "k", MsgID: "dep-a:k"}, true},
		{"another deployment's", h("Nats-Msg-Id", "dep-b:k", natssink.HeaderEventKey, "k", natssink.HeaderEventID, "1", natssink.HeaderDeployment, "dep-b"), natssink.StoredEvent{}, false},
	} {
		got, ours := natssink.ParseStored(c.h, "dep-a")
		if got != c.want || ours != c.ours {
			t.Errorf("%s: %+v, %v; want %+v, %v", c.name, got, ours, c.want, c.ours)
		}
	}
}

// A stream whose retention removes consumed messages cannot show what was
// delivered; an embedded server cannot be reached from another process.
func TestOpenStream_Refuses(t *testing.T) {
	srv := natstest.Start(t)
	js := MustJetStream(t, srv)
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "WORK", Subjects: []string{"work.>"}, Retention: jetstream.WorkQueuePolicy}); err != nil {
		t.Fatal(err)
	}
	if _, err := natssink.OpenStream(ctx, natssink.ReaderConfig{URL: srv.URL(), Options: srv.ClientOptions(), Stream: "WORK", Subject: "work.{{.EventType}}"}); err == nil {
		t.Error("a work-queue stream was opened")
	}
	if _, err := natssink.OpenStream(ctx, natssink.ReaderConfig{}); err == nil {
		t.Error("an embedded server's stream was opened")
	}
}
