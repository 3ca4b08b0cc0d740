package main

import (
	"hash/fnv"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// hookMode is how the receiver answers.
type hookMode int32

const (
	hookHealthy hookMode = iota // apply the side effect (once per webhook-id), 204
	hook503                     // 503, nothing applied
	hookHang                    // hold the request past the relay's timeout
	hookSlow                    // healthy, but answer after half the relay's timeout
	// hookCrawl is healthy, but answers after crawl (most of the relay's
	// timeout): with a few requests in flight, the relay's lanes fill and
	// decoding waits for them (backpressure-drop).
	hookCrawl
)

func (m hookMode) String() string {
	switch m {
	case hook503:
		return "503"
	case hookHang:
		return "hang"
	case hookSlow:
		return "slow"
	case hookCrawl:
		return "crawl"
	default:
		return "healthy"
	}
}

// rawDelivery is one request as the receiver saw it. Status is what it
// answered; 0 means it held the request until the relay gave up (the
// relay's outcome is unknown).
type rawDelivery struct {
	Index   int           // arrival order
	At      time.Duration // since the run's start
	ID      string        // webhook-id
	Attempt string        // webhook-attempt
	Body    string
	Status  int
	Applied bool   // this request applied the side effect
	From    string // the relay that sent it (X-Chaos-Relay)
}

// relayHeader names the relay that sent a webhook request: each relay's
// webhook sink sets it (sinks[].headers).
const relayHeader = "X-Chaos-Relay"

// receiver is the webhook destination. It records every request and applies
// a side effect once per webhook-id, as an idempotent consumer does; in the
// outage modes it answers 503, or holds requests past the relay's timeout (a
// held request may have applied its side effect first, as a slow consumer
// that did the work but answered too late would have), or answers 2xx but
// slowly (deliveries queue up in the relay).
type receiver struct {
	srv     *harness.HTTPServer
	since   func() time.Duration
	holdMax time.Duration // a held request is released after this at the latest
	slow    time.Duration // how long a slow answer takes
	crawl   time.Duration // how long a crawling answer takes
	mode    atomic.Int32

	mu      sync.Mutex
	got     []rawDelivery
	applied map[string]int  // webhook-id → index of the request that applied it
	okIDs   map[string]bool // webhook-ids answered with a 2xx
	seen    map[string]bool // webhook-ids of every request
	// poisonLeft is how many more events, each on its first request, the
	// receiver refuses for good (unstorable-reply); poisoned are their
	// event_keys, answered 400 with poisonBody on every request.
	poisonLeft int
	poisoned   map[string]bool
}

func newReceiver(since func() time.Duration, holdMax, slow, crawl time.Duration) (*receiver, error) {
	r := &receiver{since: since, holdMax: holdMax, slow: slow, crawl: crawl, applied: map[string]int{}, okIDs: map[string]bool{},
		seen: map[string]bool{}, poisoned: map[string]bool{}}
	srv, err := harness.ServeHTTP(r, "/hook")
	if err != nil {
		return nil, err
	}
	r.srv = srv
	return r, nil
}

func (r *receiver) url() string { return r.srv.URL }

func (r *receiver) setMode(m hookMode) { r.mode.Store(int32(m)) }

func (r *receiver) close() { r.srv.Close() }

// ServeHTTP records the request and answers according to the mode.
func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	d := rawDelivery{At: r.since(), ID: req.Header.Get("webhook-id"), Attempt: req.Header.Get("webhook-attempt"), Body: string(body),
		From: req.Header.Get(relayHeader)}
	mode := hookMode(r.mode.Load())
	switch mode {
	case hookHealthy, hookSlow, hookCrawl:
		d.Status = http.StatusNoContent
	case hook503:
		d.Status = http.StatusServiceUnavailable
	}
	r.mu.Lock()
	d.Index = len(r.got)
	key := bodyKey(d.Body)
	if key != "" && !r.poisoned[key] && r.poisonLeft > 0 && mode == hookHealthy && !r.seen[d.ID] {
		r.poisonLeft--
		r.poisoned[key] = true
	}
	r.seen[d.ID] = true
	if r.poisoned[key] {
		d.Status = http.StatusBadRequest
		r.got = append(r.got, d)
		r.mu.Unlock()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write(poisonBody)
		return
	}
	apply := mode == hookHealthy || mode == hookSlow || mode == hookCrawl || (mode == hookHang && appliesBeforeHanging(d.ID, d.Attempt))
	if _, done := r.applied[d.ID]; apply && !done {
		r.applied[d.ID] = d.Index
		d.Applied = true
	}
	if d.Status >= 200 && d.Status < 300 {
		r.okIDs[d.ID] = true
	}
	r.got = append(r.got, d)
	r.mu.Unlock()

	if mode == hookHang {
		select {
		case <-req.Context().Done():
			return // the relay gave up: its outcome is unknown
		case <-time.After(r.holdMax):
		}
		r.mu.Lock()
		r.got[d.Index].Status = http.StatusServiceUnavailable
		r.mu.Unlock()
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	if wait := map[hookMode]time.Duration{hookSlow: r.slow, hookCrawl: r.crawl}[mode]; wait > 0 {
		select {
		case <-req.Context().Done():
			// The relay gave up before the answer (its timeout counts
			// from before the request reached here): for it the outcome
			// is unknown, as for a held request, so a repeat may follow.
			r.mu.Lock()
			r.got[d.Index].Status = 0
			delete(r.okIDs, d.ID)
			for _, g := range r.got {
				if g.ID == d.ID && g.Status >= 200 && g.Status < 300 {
					r.okIDs[d.ID] = true
				}
			}
			r.mu.Unlock()
			return
		case <-time.After(wait):
		}
	}
	w.WriteHeader(d.Status)
}

// poisonBody is the body of the 400 answer to a poisoned event: over 500
// bytes of multi-byte UTF-8 with a NUL byte in it, so that a reason cut at a
// byte count splits a character and the NUL cannot go into a text column as
// it is (docs/guarantees.md, TestNoStall_UnstorableErrorText).
var poisonBody = []byte(strings.Repeat("пакет отклонён — ошибка ✗ ", 12) + "\x00" + strings.Repeat("拒否されました 🚫 ", 20))

// poison makes the receiver refuse the next n events it sees for the first
// time, in healthy mode, for good (400 with poisonBody).
func (r *receiver) poison(n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.poisonLeft += n
}

// stopPoisoning chooses no more events to refuse (those chosen stay
// refused).
func (r *receiver) stopPoisoning() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.poisonLeft = 0
}

// poisonedKeys returns the event_keys refused for good so far, and how
// many more are still to be chosen.
func (r *receiver) poisonedKeys() (map[string]bool, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]bool, len(r.poisoned))
	for k := range r.poisoned {
		out[k] = true
	}
	return out, r.poisonLeft
}

// appliesBeforeHanging decides, from the request's id and attempt (so the
// same request always decides alike), whether a held request did its work
// before the relay gave up on it: half of them do.
func appliesBeforeHanging(id, attempt string) bool {
	h := fnv.New32a()
	h.Write([]byte(id + "\x00" + attempt))
	return h.Sum32()%2 == 0
}

// deliveries returns a copy of every request recorded so far.
func (r *receiver) deliveries() []rawDelivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]rawDelivery, len(r.got))
	copy(out, r.got)
	return out
}

// counts returns how many requests arrived and how many webhook-ids got a
// 2xx.
func (r *receiver) counts() (requests, okIDs int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got), len(r.okIDs)
}
