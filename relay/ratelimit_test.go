package relay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestEngine_RateLimitNeverHoldsTheStream: a sink limited to 50 events a
// second with lane_block_max 200 ms sends what its limit allows and hands
// the rest to the claim path without an attempt (reason rate_limited),
// due when their tokens would have come; the unlimited sink gets every
// event and the stream settles them all at once.
func TestEngine_RateLimitNeverHoldsTheStream(t *testing.T) {
	store := newFakeStore()
	limited, other := newFakeSink("limited", nil), newFakeSink("other", nil)
	e := startEngine(t, relay.EngineConfig{Stream: store, Policy: relay.Policy{LaneBlockMax: 200 * time.Millisecond},
		Routes: []relay.Route{{Sink: limited, RateLimit: relay.NewRateLimit(50, 5)}, {Sink: other}}})
	c := e.Stream()
	var events []*relay.Event
	for i := range 100 {
		events = append(events, event(int64(i+1), fmt.Sprintf("a%d", i%5)))
	}
	start := time.Now()
	submit(t, c, events...)
	c.Commit(100)
	waitSettledAt(t, c, 100)
	took := time.Since(start)
	if n := len(other.sentIDs()); n != 100 {
		t.Fatalf("the unlimited sink got %d events, want 100", n)
	}
	sent := len(limited.sentIDs())
	// 5 at once, then 50 a second, for at most took plus the 200 ms wait.
	if most := 5 + int(50*took.Seconds()) + 11; sent > most || sent < 5 {
		t.Fatalf("the limited sink got %d events in %s, want 5 to %d", sent, took, most)
	}
	_, diversions, _ := store.snapshot()
	limitedOff := 0
	for id, h := range diversions {
		if h.Why == "rate_limited" {
			limitedOff++
			if h.Attempts != 0 || !h.At.After(start) {
				t.Errorf("event %d: %+v, want a diversion without an attempt, due later", id, h)
			}
		}
	}
	if limitedOff == 0 || sent+len(diversions) < 100 {
		t.Fatalf("%d sent, %d diverted (%d over the rate limit): want the rest of 100 diverted", sent, len(diversions), limitedOff)
	}
}

// TestEngine_RateLimitCountsEventsOfARun: at a sink that takes runs (an
// ordered batch), each event of a run takes a token, not each request:
// 21 events of one aggregate at 20 a second, a burst of 1, take a second
// though they go out in three requests.
func TestEngine_RateLimitCountsEventsOfARun(t *testing.T) {
	sink := newFakeRunSink("s", 10, func(req []*relay.Delivery) []error { return make([]error, len(req)) })
	store := newFakeStore()
	c := startEngine(t, relay.EngineConfig{Stream: store, Owner: "me", Policy: relay.Policy{LaneBlockMax: 5 * time.Second},
		Routes: []relay.Route{{Sink: sink, RateLimit: relay.NewRateLimit(20, 1)}}}).Stream()
	var events []*relay.Event
	for i := range 21 {
		events = append(events, event(int64(i+1), "a"))
	}
	start := time.Now()
	submit(t, c, events...)
	c.Commit(100)
	waitSettledAt(t, c, 100)
	took := time.Since(start)
	if n := sink.requestCount(); n >= 21 {
		t.Fatalf("%d requests: the events did not go out in runs", n)
	}
	if took < 900*time.Millisecond {
		t.Fatalf("21 events in %d requests took %s at 20 events/s: the limit counted requests, not events", sink.requestCount(), took)
	}
	delivered, diversions, _ := store.snapshot()
	if len(delivered) != 21 || len(diversions) != 0 {
		t.Fatalf("%d delivered, %d diverted, want 21 delivered", len(delivered), len(diversions))
	}
}
