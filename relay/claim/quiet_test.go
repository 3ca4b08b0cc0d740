package claim_test

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
)

// syncLog collects a source's log lines; zerolog writes from the sweeper and
// the claim loop at once.
type syncLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *syncLog) warnings() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range strings.Split(l.buf.String(), "\n") {
		if strings.Contains(line, `"level":"warn"`) || strings.Contains(line, `"level":"error"`) {
			out = append(out, line)
		}
	}
	return out
}

// TestStuckAlarm_WaitsSweepAfterFromStart: rows older than sweep_after when
// the source starts (a backlog the stream is about to deliver) are measured
// at once, but the warning waits until the relay has had sweep_after to
// deliver them since it started; rows still pending then are reported.
func TestStuckAlarm_WaitsSweepAfterFromStart(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "backlog1", AggType: "order", AggID: "A", Age: time.Hour},
		event{Key: "backlog2", AggType: "order", AggID: "B", Age: time.Hour},
	)
	const sweepAfter = 1500 * time.Millisecond
	r := MustEngine(t, f, options{Routes: []relay.Route{{Sink: newFakeSink("a", nil)}}, PollInterval: 50 * time.Millisecond, SweepAfter: sweepAfter})
	var log syncLog
	cfg := r.SourceConfig(t, nil)
	cfg.Logger = zerolog.New(&log).Level(zerolog.InfoLevel)
	src, err := claim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	runSource(t, src)

	waitFor(t, 5*time.Second, "the first sweep to measure the rows", func() bool { return src.StuckRows() == 2 })
	if w := log.warnings(); len(w) > 0 && time.Since(started) < sweepAfter {
		t.Fatalf("warned %v after start, before the relay had sweep_after (%v) to deliver the rows: %s", time.Since(started), sweepAfter, w)
	}
	waitFor(t, 10*time.Second, "the stuck-rows warning", func() bool { return len(log.warnings()) > 0 })
	if since := time.Since(started); since < sweepAfter {
		t.Fatalf("warned %v after start, before sweep_after (%v)", since, sweepAfter)
	}
	if w := log.warnings(); !strings.Contains(w[0], "rows pending longer than sweep_after") || !strings.Contains(w[0], `"rows":2`) {
		t.Fatalf("warning: %s", w[0])
	}
}

// stoppingStore is a claim.Store whose ReleaseOwned sees its caller stop
// meanwhile: the term ends while the source starts, as on a switch from
// replication to polling.
type stoppingStore struct {
	claim.Store
	stop func()
}

func (s *stoppingStore) ReleaseOwned(ctx context.Context, owner string) (int64, error) {
	s.stop()
	<-ctx.Done()
	return s.Store.ReleaseOwned(ctx, owner)
}

// TestRun_StoppedWhileStartingLogsNoWarning: a source stopped while it
// returns the rows it left claimed (its context is cancelled: the term
// ended) has nothing to report; it does not log the cancellation as a
// failure.
func TestRun_StoppedWhileStartingLogsNoWarning(t *testing.T) {
	f := MustFixture(t)
	r := MustEngine(t, f, options{Routes: []relay.Route{{Sink: newFakeSink("a", nil)}}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var log syncLog
	cfg := r.SourceConfig(t, &stoppingStore{Store: r.Store, stop: cancel})
	cfg.Logger = zerolog.New(&log).Level(zerolog.InfoLevel)
	src, err := claim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Run(ctx); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if w := log.warnings(); len(w) > 0 {
		t.Fatalf("a source stopped while starting logged: %s", strings.Join(w, "\n"))
	}
}
