package relay

import (
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
)

// Feed passes each (event, sink) pair's outcome, as the lanes record it, to
// whoever watches the flow live: the admin API's feed (docs/operations.md,
// "Console and admin API"). It never blocks the lane: every subscriber has
// a bounded buffer, and an outcome that does not fit is dropped and counted.
// With no subscriber an outcome costs one atomic load. The zero of *Feed
// (nil) observes nothing.
type Feed struct {
	payloads bool

	mu   sync.RWMutex // observe reads subs; Subscribe and Close change it
	subs map[*FeedSubscription]struct{}
	n    atomic.Int32 // len(subs), read without mu on the lanes' path
}

// FeedItem is one pair's outcome. It carries no payload unless the feed was
// made with payloads, and then at most FeedPayloadMax bytes of it.
type FeedItem struct {
	At        time.Time `json:"at"`
	Sink      string    `json:"sink"`
	ID        int64     `json:"id"`
	EventKey  string    `json:"event_key"`
	EventType *string   `json:"event_type"`
	Path      Path      `json:"path"`
	// Outcome is delivered, failed (dead-lettered at this sink), held,
	// retry (a counted attempt failed) or deferred (not attempted, or the
	// sink is down; diverted to the claim path or tried later).
	Outcome string `json:"outcome"`
	// Reason is why a pair was not delivered; "" when it was.
	Reason string `json:"reason,omitempty"`
	// LatencySeconds is, for a delivered pair, the time from the event's
	// commit (stream) or creation (claim path) to the sink's answer: what
	// outbox_relay_delivery_latency_seconds observes.
	LatencySeconds float64 `json:"latency_seconds,omitempty"`
	Payload        *string `json:"payload,omitempty"`
}

// FeedPayloadMax bounds the payload a FeedItem carries, so that the feed's
// buffers hold a bounded number of bytes whatever the payloads weigh.
const FeedPayloadMax = 1024

// NewFeed returns a feed; with payloads, each item carries the start of the
// event's payload (FeedPayloadMax bytes).
func NewFeed(payloads bool) *Feed {
	return &Feed{payloads: payloads, subs: map[*FeedSubscription]struct{}{}}
}

// FeedSubscription receives the feed's items on C until Close.
type FeedSubscription struct {
	C       <-chan FeedItem
	c       chan FeedItem
	f       *Feed
	dropped atomic.Uint64
	once    sync.Once
}

// Subscribe starts a subscription with room for buffer items; items that
// find it full are dropped (Dropped counts them). Close it when done.
func (f *Feed) Subscribe(buffer int) *FeedSubscription {
	c := make(chan FeedItem, max(buffer, 1))
	s := &FeedSubscription{C: c, c: c, f: f}
	f.mu.Lock()
	f.subs[s] = struct{}{}
	f.n.Store(int32(len(f.subs)))
	f.mu.Unlock()
	return s
}

// Payloads reports whether the feed's items carry payload excerpts.
func (f *Feed) Payloads() bool { return f.payloads }

// Subscribers returns the number of open subscriptions.
func (f *Feed) Subscribers() int { return int(f.n.Load()) }

// Dropped returns how many items did not fit in the subscription's buffer.
func (s *FeedSubscription) Dropped() uint64 { return s.dropped.Load() }

// Close ends the subscription; C receives nothing more (it is not closed:
// a lane may be sending to it). Safe to call twice.
func (s *FeedSubscription) Close() {
	s.once.Do(func() {
		s.f.mu.Lock()
		delete(s.f.subs, s)
		s.f.n.Store(int32(len(s.f.subs)))
		s.f.mu.Unlock()
	})
}

// observe passes the outcome o of t's pair to the subscribers. A pair the
// ledger showed delivered before was not sent: it is not a delivery to
// show.
func (f *Feed) observe(t *task, o Outcome) {
	if f == nil || f.n.Load() == 0 || o.Kind == Delivered && t.p.State == PairDelivered {
		return
	}
	ev := t.w.Event
	item := FeedItem{At: time.Now(), Sink: t.l.name, ID: ev.ID, EventKey: ev.EventKey, EventType: ev.EventType, Path: t.w.path,
		Outcome: o.Kind.feedName(), Reason: o.Reason}
	if o.Kind == Delivered {
		since := ev.CommitTime
		if t.w.path == PathClaim || since.IsZero() {
			since = ev.CreatedAt
		}
		if !since.IsZero() {
			item.LatencySeconds = max(item.At.Sub(since).Seconds(), 0)
		}
	}
	if f.payloads && ev.Payload != nil {
		p := payloadExcerpt(ev.Payload)
		item.Payload = &p
	}
	f.mu.RLock()
	for s := range f.subs {
		select {
		case s.c <- item:
		default:
			s.dropped.Add(1)
		}
	}
	f.mu.RUnlock()
}

// payloadExcerpt returns at most FeedPayloadMax bytes of p, cut at a rune
// boundary, with "…" when cut.
func payloadExcerpt(p []byte) string {
	if len(p) <= FeedPayloadMax {
		return string(p)
	}
	cut := FeedPayloadMax
	for cut > 0 && !utf8.RuneStart(p[cut]) {
		cut--
	}
	return string(p[:cut]) + "…"
}

// feedName is the outcome's name in the feed.
func (k OutcomeKind) feedName() string {
	switch k {
	case Delivered:
		return "delivered"
	case Failed:
		return "failed"
	case Held:
		return "held"
	case Retry:
		return "retry"
	case Deferred:
		return "deferred"
	}
	return "unknown"
}
