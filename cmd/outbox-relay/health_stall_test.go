package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestHealth_ForcedStall forces the relay to stall and watches /healthz,
// /readyz and outbox_relay_stalled (docs/operations-health.md, "Health that
// sees a stall"), with http.stall_after 2s: they pass while the relay idles
// for longer than that, fail with the stalled path and why once events have
// waited 2 s without progress, and pass again once it progresses.
//
//   - stream, webhook never answers: the webhook holds the request (timeout
//     10m) and lane_block_max (10m) keeps the stream from handing the event
//     off, so the slot cannot be acknowledged past it;
//   - stream, checkpoint table locked: every event is delivered, but the
//     checkpoint that must precede their acknowledgement waits on the lock;
//   - claim path (poll mode), webhook never answers: a claimed event stays
//     in flight and nothing settles.
func TestHealth_ForcedStall(t *testing.T) {
	for _, tc := range []struct {
		name   string
		poll   bool
		stall  func(t *testing.T, s *setup) (release func())
		reason string
	}{
		{"stream, webhook never answers", false, hangWebhook, "the stream has acknowledged nothing new"},
		{"stream, checkpoint table locked", false, lockCheckpointTable, "the stream has acknowledged nothing new"},
		{"claim path, webhook never answers", true, hangWebhook, "the claim path has settled nothing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSetup(t, pgtest.NewDatabase(t))
			addr := freeAddr(t)
			top := ""
			if tc.poll {
				top = "source: {mode: poll}\n"
			}
			cfg := s.configFileWith(t, "    timeout: 10m", top)
			replaceInFile(t, cfg, "delivery:\n", "delivery:\n  lane_block_max: 10m\n")
			replaceInFile(t, cfg, `http: {listen: "127.0.0.1:0"}`, fmt.Sprintf("http: {listen: %q, stall_after: 2s}", addr))
			s.startInProcess(t, cfg)
			if tc.poll {
				eventually(t, 20*time.Second, "the relay polling", func() bool {
					resp, err := http.Get("http://" + addr + "/readyz")
					if err != nil { // not listening yet
						return false
					}
					resp.Body.Close()
					return resp.StatusCode == 200
				})
			} else {
				s.waitStreaming(t)
			}
			s.publishOne(t, "warm-up")
			s.waitDelivered(t, "warm", 1, 20*time.Second)

			// Idle for longer than stall_after: healthy.
			time.Sleep(3 * time.Second)
			for _, p := range []string{"/healthz", "/readyz"} {
				if code, body := httpGet(t, "http://"+addr+p); code != 200 {
					t.Fatalf("%s while idle = %d %q", p, code, body)
				}
			}

			release := tc.stall(t, s)
			var once sync.Once
			t.Cleanup(func() { once.Do(release) })
			s.publishOne(t, "stalled-1")
			published := time.Now()
			var body string
			eventually(t, 20*time.Second, "/healthz failing", func() bool {
				var code int
				code, body = httpGet(t, "http://"+addr+"/healthz")
				return code == 503
			})
			failed := time.Since(published)
			if !strings.Contains(body, "stalled: "+tc.reason) {
				t.Errorf("/healthz body %q, want it to say %q", body, tc.reason)
			}
			if code, rbody := httpGet(t, "http://"+addr+"/readyz"); code != 503 || !strings.Contains(rbody, tc.reason) {
				t.Errorf("/readyz while stalled = %d %q, want 503 saying %q", code, rbody, tc.reason)
			}
			if v, _ := sample(scrapeFamilies(t, addr)["outbox_relay_stalled"]); v != 1 {
				t.Errorf("outbox_relay_stalled = %v while stalled, want 1", v)
			}
			t.Logf("%s: /healthz failed %v after the event was published: %s", tc.name, failed.Round(10*time.Millisecond), strings.TrimSpace(body))
			// 2 s of stall_after, a check every 200 ms, and in poll mode
			// up to 1 s (poll_interval) before the event is claimed.
			if failed < 2*time.Second || failed > 4500*time.Millisecond {
				t.Errorf("/healthz failed %v after the event, want between 2 and 4.5 s", failed)
			}

			once.Do(release)
			released := time.Now()
			eventually(t, 30*time.Second, "/healthz passing again", func() bool {
				code, _ := httpGet(t, "http://"+addr+"/healthz")
				return code == 200
			})
			t.Logf("%s: /healthz passed again %v after the stall was released", tc.name, time.Since(released).Round(10*time.Millisecond))
			if v, _ := sample(scrapeFamilies(t, addr)["outbox_relay_stalled"]); v != 0 {
				t.Errorf("outbox_relay_stalled = %v after the stall, want 0", v)
			}
			s.waitDelivered(t, "stalled", 1, 30*time.Second)
		})
	}
}

// publishOne publishes one event keyed key.
func (s *setup) publishOne(t *testing.T, key string) {
	t.Helper()
	if _, err := s.pool.Exec(context.Background(), `SELECT outbox_publish('order.placed', 'order', 'o-1', $1, '{}'::jsonb)`, key); err != nil {
		t.Fatalf("publish %s: %v", key, err)
	}
}

// hangWebhook makes the webhook hold every request until released.
func hangWebhook(t *testing.T, s *setup) func() {
	gate := make(chan struct{})
	s.hook.setReply(func(delivery) int {
		<-gate
		return 204
	})
	return func() { close(gate) }
}

// lockCheckpointTable holds an ACCESS EXCLUSIVE lock on the checkpoint
// table until released.
func lockCheckpointTable(t *testing.T, s *setup) func() {
	ctx := context.Background()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE relay_checkpoint IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	return func() {
		if err := tx.Rollback(ctx); err != nil {
			t.Errorf("release the lock: %v", err)
		}
	}
}
