package claim_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
)

// startAlarmed runs a claim source over r whose log (info and up) goes to
// log, sweeping every second.
func startAlarmed(t *testing.T, r *rig, log *syncLog) {
	t.Helper()
	cfg := r.SourceConfig(t, nil)
	cfg.Logger = zerolog.New(log).Level(zerolog.InfoLevel)
	src, err := claim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	runSource(t, src)
}

// TestStuckAlarm_RowsWaitingForTheSinkAreNotReconciled: behind a slow sink
// the stream's rows wait longer than sweep_after — in flight in the lanes,
// or not received yet while the stream is behind — and the alarm says so.
// It does not tell the operator to run reconcile: these rows are the
// stream's and arrive.
func TestStuckAlarm_RowsWaitingForTheSinkAreNotReconciled(t *testing.T) {
	f := MustFixture(t)
	release := make(chan struct{})
	var once sync.Once
	defer once.Do(func() { close(release) })
	slow := newFakeSink("n8n", func(*relay.Delivery) error { <-release; return nil })
	r := MustEngine(t, f, options{Routes: routes(slow), PollInterval: 50 * time.Millisecond, SweepAfter: 300 * time.Millisecond})
	ctx := context.Background()
	stream := r.Engine.Stream()
	if err := stream.Restart(ctx, 500); err != nil {
		t.Fatal(err)
	}
	stream.Keepalive(500) // the stream has decoded past its session's start
	r.MustStream(t, f, "A", "flight-1")
	r.MustStream(t, f, "B", "flight-2")
	r.MustStream(t, f, "C", "flight-3")
	f.MustInsert(t, event{Key: "behind-1", AggType: "order", AggID: "D"}, event{Key: "behind-2", AggType: "order", AggID: "E"})

	var log syncLog
	startAlarmed(t, r, &log)
	waitFor(t, 10*time.Second, "the stuck-rows warning", func() bool { return len(log.warnings()) > 0 })
	w := log.warnings()[0]
	t.Logf("%s", w)
	for _, want := range []string{`"rows":5`, `"in_flight":3`, `"not_received":2`, `"never_streamed":0`,
		"3 are in flight in the lanes, waiting for their sinks", "2 the stream has not received them yet"} {
		if !strings.Contains(w, want) {
			t.Errorf("warning lacks %q", want)
		}
	}
	if strings.Contains(w, "reconcile") {
		t.Errorf("the warning advises reconcile for rows that wait for the sink: %s", w)
	}
	once.Do(func() { close(release) })
}

// TestStuckAlarm_RowsTheStreamNeverSawAreReconciled: rows committed before
// the stream's session began, which the stream has decoded past without
// them and does not hold, will never be streamed (a slot made after them):
// the alarm advises reconcile, with an --older-than that takes them.
func TestStuckAlarm_RowsTheStreamNeverSawAreReconciled(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t, event{Key: "old-1", AggType: "order", AggID: "A", Age: time.Hour},
		event{Key: "old-2", AggType: "order", AggID: "B", Age: time.Hour})
	r := MustEngine(t, f, options{Routes: routes(newFakeSink("n8n", nil)), PollInterval: 50 * time.Millisecond, SweepAfter: 300 * time.Millisecond})
	stream := r.Engine.Stream()
	if err := stream.Restart(context.Background(), 500); err != nil {
		t.Fatal(err)
	}
	stream.Keepalive(600)

	var log syncLog
	startAlarmed(t, r, &log)
	waitFor(t, 10*time.Second, "the stuck-rows warning", func() bool { return len(log.warnings()) > 0 })
	w := log.warnings()[0]
	t.Logf("%s", w)
	for _, want := range []string{`"rows":2`, `"never_streamed":2`, `"in_flight":0`,
		"2 were committed before the stream's session began", "run outbox-relay reconcile --older-than 1m0s"} {
		if !strings.Contains(w, want) {
			t.Errorf("warning lacks %q", want)
		}
	}
}
