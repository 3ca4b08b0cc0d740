package relay_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestFeed_OutcomesWithoutPayload: the feed shows each pair's outcome —
// sink, key, type, path, outcome, the reason of one not delivered, the
// latency of one delivered — and no payload unless asked for, then at most
// relay.FeedPayloadMax bytes of it.
func TestFeed_OutcomesWithoutPayload(t *testing.T) {
	for _, payloads := range []bool{false, true} {
		feed := relay.NewFeed(payloads)
		sub := feed.Subscribe(16)
		defer sub.Close()
		ok := newFakeSink("ok", nil)
		bad := newFakeSink("bad", func(*relay.Delivery) error { return relay.PermanentError(errors.New("400 Bad Request")) })
		store := newFakeStore()
		e := startEngine(t, relay.EngineConfig{Stream: store, Routes: []relay.Route{{Sink: ok}, {Sink: bad}}, Feed: feed})
		ev := event(1, "a")
		ev.Payload = []byte(`{"secret":"` + strings.Repeat("é", relay.FeedPayloadMax) + `"}`)
		ev.CommitTime = time.Now().Add(-time.Second)
		submit(t, e.Stream(), ev)
		e.Stream().Commit(100)
		waitSettledAt(t, e.Stream(), 100)

		got := map[string]relay.FeedItem{}
		for range 2 {
			select {
			case it := <-sub.C:
				got[it.Sink] = it
			case <-time.After(10 * time.Second):
				t.Fatalf("payloads %v: the feed showed %d outcomes, want 2", payloads, len(got))
			}
		}
		d, f := got["ok"], got["bad"]
		if d.Outcome != "delivered" || d.EventKey != "k1" || *d.EventType != "order.placed" || d.Path != relay.PathStream || d.ID != 1 ||
			d.LatencySeconds < 1 || d.LatencySeconds > 30 || d.Reason != "" {
			t.Errorf("payloads %v: delivered pair: %+v", payloads, d)
		}
		if f.Outcome != "failed" || !strings.Contains(f.Reason, "400 Bad Request") || f.LatencySeconds != 0 {
			t.Errorf("payloads %v: dead-lettered pair: %+v", payloads, f)
		}
		for _, it := range []relay.FeedItem{d, f} {
			switch {
			case !payloads && it.Payload != nil:
				t.Errorf("the feed shows a payload though it was made without: %q", *it.Payload)
			case payloads && (it.Payload == nil || len(*it.Payload) > relay.FeedPayloadMax+len("…") || !strings.HasPrefix(*it.Payload, `{"secret":"é`) || !strings.HasSuffix(*it.Payload, "é…")):
				t.Errorf("payload excerpt: %v", it.Payload)
			}
		}
	}
}

// TestFeed_NeverBlocksALane: a subscriber that reads nothing costs the
// lanes nothing: what does not fit in its buffer is dropped and counted,
// and every event is delivered and settled meanwhile.
func TestFeed_NeverBlocksALane(t *testing.T) {
	feed := relay.NewFeed(false)
	stuck := feed.Subscribe(4)
	defer stuck.Close()
	closed := feed.Subscribe(4)
	closed.Close()
	closed.Close()
	if n := feed.Subscribers(); n != 1 {
		t.Fatalf("%d subscribers, want 1", n)
	}
	sink := newFakeSink("s", nil)
	e := startEngine(t, relay.EngineConfig{Stream: newFakeStore(), Routes: []relay.Route{{Sink: sink}}, Feed: feed})
	var batch []*relay.Event
	for id := range int64(500) {
		batch = append(batch, event(id+1, "a"))
	}
	submit(t, e.Stream(), batch...)
	e.Stream().Commit(100)
	waitSettledAt(t, e.Stream(), 100)
	if got := len(stuck.C); got != 4 {
		t.Errorf("the stuck subscriber holds %d items, want its buffer's 4", got)
	}
	if got := stuck.Dropped(); got != 496 {
		t.Errorf("dropped %d, want 496", got)
	}
	if got := len(closed.C); got != 0 {
		t.Errorf("a closed subscription got %d items", got)
	}
}
