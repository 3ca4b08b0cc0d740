package main

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestRelay_StopSaysWhatItWaitsFor: a relay stopped while a slow webhook
// holds its events says at once what it waits for and for how long at most
// — while the webhook still holds every request — and, once the drain is
// over, what became of them.
func TestRelay_StopSaysWhatItWaitsFor(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	release := make(chan struct{})
	var releaseOnce sync.Once
	defer releaseOnce.Do(func() { close(release) })
	var arrived atomic.Int32
	s.hook.setReply(func(d delivery) int {
		arrived.Add(1)
		<-release
		return 204
	})
	cfg := s.configFile(t, "    concurrency: 16")
	var log syncBuffer
	stop := runInProcess(t, config.Options{Path: cfg}, zerolog.New(&log).Level(zerolog.InfoLevel).With().Timestamp().Logger())
	s.publishWriters(t, 1, 12, 12, "stop") // 12 aggregates: all 12 go out at once
	eventually(t, 30*time.Second, "the webhook holding 12 requests", func() bool { return arrived.Load() == 12 })

	stopped := make(chan struct{})
	signalled := time.Now()
	go func() { stop(); close(stopped) }()
	line := func(prefix string) string {
		for _, l := range strings.Split(log.String(), "\n") {
			if strings.Contains(l, `"message":"`+prefix) {
				return l
			}
		}
		return ""
	}
	eventually(t, 5*time.Second, "the stopping line", func() bool { return line("stopping: ") != "" })
	said := time.Since(signalled)
	if l := line("stopping: "); !strings.Contains(l, `"message":"stopping: 12 in flight, up to 10s`) || !strings.Contains(l, `"in_flight":12`) {
		t.Fatalf("stopping line: %s", l)
	}
	if said > time.Second {
		t.Errorf("the stopping line came %s after the signal, want within a second", said)
	}
	select {
	case <-stopped:
		t.Fatal("the relay stopped while the webhook still held its requests")
	default:
	}
	time.Sleep(500 * time.Millisecond) // the drain waits for the webhook
	releaseOnce.Do(func() { close(release) })
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay did not stop within 30s of the webhook's answers")
	}
	l := line("stopped: ")
	if !strings.Contains(l, `"message":"stopped: 12 delivered, 0 diverted to the claim path, in `) || !strings.Contains(l, `"delivered":12`) {
		t.Fatalf("stopped line: %s\nlog:\n%s", l, log.String())
	}
	t.Logf("%s\n%s", line("stopping: "), l)
}
