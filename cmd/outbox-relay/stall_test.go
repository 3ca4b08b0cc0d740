package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/supervisor"
)

// fakeStream and fakeEngine are the detector's inputs, set by the test.
type fakeStream struct{ received, acked relay.LSN }

func (f *fakeStream) Progress() (relay.LSN, relay.LSN) { return f.received, f.acked }

type fakeEngine struct {
	unsettled map[relay.Path]int
	settled   map[relay.Path]uint64
}

func (f *fakeEngine) Progress(p relay.Path) (int, uint64) { return f.unsettled[p], f.settled[p] }

func newFakeEngine() *fakeEngine {
	return &fakeEngine{unsettled: map[relay.Path]int{}, settled: map[relay.Path]uint64{}}
}

// stallClock drives a stallWatch with a clock the test moves.
type stallClock struct {
	w   *stallWatch
	h   *health
	now time.Time
}

func newStallClock(after time.Duration) *stallClock {
	c := &stallClock{h: &health{}, now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	c.w = newStallWatch(after, c.h, zerolog.Nop())
	c.w.now = func() time.Time { return c.now }
	return c
}

// step moves the clock by d and checks.
func (c *stallClock) step(d time.Duration) string {
	c.now = c.now.Add(d)
	c.w.check()
	return c.h.stalledReason()
}

func TestStallWatch(t *testing.T) {
	const after = time.Minute
	type step struct {
		advance time.Duration
		change  func(s *fakeStream, e *fakeEngine)
		stalled string // "" or a part of the reason
	}
	for _, tc := range []struct {
		name  string
		after time.Duration
		steps []step
	}{
		{"idle stream for hours", after, []step{
			{0, func(s *fakeStream, e *fakeEngine) { s.received, s.acked = 100, 100 }, ""},
			{time.Hour, nil, ""},
			{time.Hour, nil, ""},
		}},
		{"events after a long idle time are not a stall at once", after, []step{
			{0, func(s *fakeStream, e *fakeEngine) { s.received, s.acked = 100, 100 }, ""},
			{time.Hour, nil, ""},
			{time.Second, func(s *fakeStream, e *fakeEngine) { s.received = 200 }, ""},
			{30 * time.Second, nil, ""},
			{30 * time.Second, nil, "the stream has acknowledged nothing new for 1m0s (acknowledged 0/64, read up to 0/C8"},
		}},
		{"a stream that keeps acknowledging", after, []step{
			{0, func(s *fakeStream, e *fakeEngine) { s.received, s.acked = 200, 100 }, ""},
			{50 * time.Second, func(s *fakeStream, e *fakeEngine) { s.received, s.acked = 300, 200 }, ""},
			{50 * time.Second, func(s *fakeStream, e *fakeEngine) { s.received, s.acked = 400, 300 }, ""},
			{50 * time.Second, func(s *fakeStream, e *fakeEngine) { s.received, s.acked = 500, 400 }, ""},
		}},
		{"a stream stalled, then moving again", after, []step{
			{0, func(s *fakeStream, e *fakeEngine) { s.received, s.acked = 200, 100; e.unsettled[relay.PathStream] = 3 }, ""},
			{time.Minute, nil, "the stream has acknowledged nothing new for 1m0s (acknowledged 0/64, read up to 0/C8, 3 events unsettled)"},
			{time.Minute, nil, "for 2m0s"},
			{time.Second, func(s *fakeStream, e *fakeEngine) { s.acked = 200; e.unsettled[relay.PathStream] = 0 }, ""},
		}},
		{"events the engine holds though everything read is acknowledged", after, []step{
			{0, func(s *fakeStream, e *fakeEngine) { s.received, s.acked = 100, 100; e.unsettled[relay.PathStream] = 1 }, ""},
			{time.Minute, nil, "1 events unsettled"},
		}},
		{"a claim path settling nothing", after, []step{
			{0, func(s *fakeStream, e *fakeEngine) { e.unsettled[relay.PathClaim] = 5; e.settled[relay.PathClaim] = 7 }, ""},
			{59 * time.Second, nil, ""},
			{time.Second, nil, "the claim path has settled nothing for 1m0s (5 events in flight)"},
			{time.Second, func(s *fakeStream, e *fakeEngine) { e.settled[relay.PathClaim] = 8 }, ""},
		}},
		{"both paths", after, []step{
			{0, func(s *fakeStream, e *fakeEngine) { s.received = 1; e.unsettled[relay.PathClaim] = 5 }, ""},
			{time.Minute, nil, "the stream has acknowledged nothing new for 1m0s (acknowledged 0/0, read up to 0/1, 0 events unsettled); the claim path"},
		}},
		{"stall_after 0", 0, []step{
			{0, func(s *fakeStream, e *fakeEngine) { s.received = 1; e.unsettled[relay.PathClaim] = 5 }, ""},
			{24 * time.Hour, nil, ""},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newStallClock(tc.after)
			s, e := &fakeStream{}, newFakeEngine()
			c.w.set(e, s)
			for i, st := range tc.steps {
				if st.change != nil {
					st.change(s, e)
				}
				got := c.step(st.advance)
				if (st.stalled == "") != (got == "") || !strings.Contains(got, st.stalled) {
					t.Fatalf("step %d: stalled %q, want %q", i, got, st.stalled)
				}
			}
		})
	}
}

// TestStallWatch_FollowsTerms: the detector forgets a term's engine and
// stream when leadership ends, and the stream when the term falls back to
// polling; a stalled term's end is not a stall of the next one.
func TestStallWatch_FollowsTerms(t *testing.T) {
	c := newStallClock(time.Minute)
	s, e := &fakeStream{received: 2, acked: 1}, newFakeEngine()
	obs := &recordingObserver{}
	cfg := c.w.watch(supervisor.Config{Observer: obs})
	c.w.set(e, s)
	c.step(0)
	if got := c.step(2 * time.Minute); !strings.Contains(got, "stream") {
		t.Fatalf("stalled %q, want the stream", got)
	}
	cfg.Observer.Mode("poll")
	if got := c.step(time.Second); got != "" {
		t.Fatalf("after the fall-back to polling: stalled %q", got)
	}
	e.unsettled[relay.PathClaim] = 1
	c.step(time.Second)
	if got := c.step(2 * time.Minute); !strings.Contains(got, "claim path") {
		t.Fatalf("stalled %q, want the claim path", got)
	}
	cfg.Observer.Leading(false)
	if got := c.step(time.Hour); got != "" {
		t.Fatalf("between terms: stalled %q", got)
	}
	if len(obs.modes) != 1 || len(obs.leader) != 1 {
		t.Errorf("the wrapped observer was not told: modes %v, leader %v", obs.modes, obs.leader)
	}
}

// recordingObserver records the modes and leadership it is told of.
type recordingObserver struct {
	supervisor.NopObserver
	modes  []string
	leader []bool
}

func (o *recordingObserver) Mode(m string)  { o.modes = append(o.modes, m) }
func (o *recordingObserver) Leading(l bool) { o.leader = append(o.leader, l) }

// TestHealthEndpoints_Stalled: /healthz and /readyz answer 503 with the
// reason while the relay is stalled, and 200 again after.
func TestHealthEndpoints_Stalled(t *testing.T) {
	h := &health{}
	h.set(true, "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addr, _, err := serveHTTP(ctx, httpConfig("127.0.0.1:0"), h, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	get := func(path string) (int, string) {
		t.Helper()
		return httpGet(t, "http://"+addr.String()+path)
	}
	for _, p := range []string{"/healthz", "/readyz"} {
		if code, _ := get(p); code != 200 {
			t.Fatalf("%s = %d before any stall", p, code)
		}
	}
	h.setStalled("the stream has acknowledged nothing new for 5m0s")
	for p, want := range map[string]string{"/healthz": "stalled: the stream has acknowledged nothing new for 5m0s", "/readyz": "not ready: stalled: the stream"} {
		if code, body := get(p); code != 503 || !strings.Contains(body, want) {
			t.Errorf("%s while stalled = %d %q, want 503 with %q", p, code, body, want)
		}
	}
	h.setStalled("")
	for _, p := range []string{"/healthz", "/readyz"} {
		if code, _ := get(p); code != 200 {
			t.Errorf("%s = %d after the stall", p, code)
		}
	}
}

func httpConfig(listen string) config.HTTPConfig { return config.HTTPConfig{Listen: listen} }

// httpGet GETs url and returns the status and body.
func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
