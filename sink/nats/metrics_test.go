package nats_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// storedAgain reads outbox_relay_nats_duplicates_stored_total for sink,
// and whether the series exists.
func storedAgain(t *testing.T, sink string) (float64, bool) {
	t.Helper()
	ch := make(chan prometheus.Metric, 64)
	go func() {
		relay.NATSDuplicatesStored.Collect(ch)
		close(ch)
	}()
	value, found := 0.0, false
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		for _, l := range d.GetLabel() {
			if l.GetName() == "sink" && l.GetValue() == sink {
				value, found = d.GetCounter().GetValue(), true
			}
		}
	}
	return value, found
}

// TestDuplicatesStoredMetric: outbox_relay_nats_duplicates_stored_total
// exists at 0 from New, and counts a retry JetStream stored as a new
// message although the event is older than the duplicate window (its first
// copy, if stored, has left the window: a second copy), and nothing else: a
// first attempt, a retry JetStream dropped as a duplicate, a retry of an
// event younger than the window, an operator replay.
func TestDuplicatesStoredMetric(t *testing.T) {
	srv := natstest.Start(t)
	cfg := testConfig(srv)
	cfg.Name = "nats-dup-metric"
	cfg.Stream.DuplicateWindow = 500 * time.Millisecond
	s := MustNew(t, cfg)
	js := MustJetStream(t, srv)

	if v, ok := storedAgain(t, cfg.Name); !ok || v != 0 {
		t.Fatalf("after New: %v (series exists: %v), want 0", v, ok)
	}

	fresh := delivery(1)
	fresh.Event.CreatedAt = time.Now()
	send := func(d *relay.Delivery, attempt, replay int) {
		t.Helper()
		again := *d
		again.Attempt, again.Replay = attempt, replay
		if err := sendSync(t, s, &again); err != nil {
			t.Fatalf("attempt %d: %v", attempt, err)
		}
	}
	send(fresh, 1, 0) // stored
	send(fresh, 2, 0) // a duplicate within the window
	time.Sleep(700 * time.Millisecond)
	// Now older than the window: a first attempt is not a retry, a replay
	// is meant to be a new copy.
	other := delivery(2)
	other.Event.CreatedAt = time.Now().Add(-time.Hour)
	send(other, 1, 0)
	send(other, 2, 1)
	if v, _ := storedAgain(t, cfg.Name); v != 0 {
		t.Fatalf("before any second copy: %v, want 0", v)
	}
	young := delivery(3)
	young.Event.CreatedAt = time.Now()
	send(young, 2, 0) // a retry stored as new, but its event is younger than the window
	if v, _ := storedAgain(t, cfg.Name); v != 0 {
		t.Fatalf("after a young event's retry: %v, want 0", v)
	}

	send(fresh, 3, 0) // past the window: stored a second time
	if v, _ := storedAgain(t, cfg.Name); v != 1 {
		t.Fatalf("after a retry past the window: %v, want 1", v)
	}
	if n := len(stored(t, js, testStream)); n != 5 {
		t.Fatalf("stream holds %d messages, want 5 (evt-1 twice, evt-2 and its replay, evt-3)", n)
	}
}
