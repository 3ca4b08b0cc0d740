package supervisor_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/supervisor"
)

// fakeStandby is a standby watch the test drives: Watch reports the
// standby unavailable once down is closed; WaitHealthy returns once back is
// closed.
type fakeStandby struct {
	down, back chan struct{}
	watches    atomic.Int32
	waits      atomic.Int32
}

func newFakeStandby() *fakeStandby {
	return &fakeStandby{down: make(chan struct{}), back: make(chan struct{})}
}

type standbyDown struct{}

func (standbyDown) Error() string             { return "standby unavailable: test" }
func (standbyDown) UnavailableReason() string { return "lagging (test)" }

func (f *fakeStandby) Watch(ctx context.Context) error {
	f.watches.Add(1)
	select {
	case <-ctx.Done():
		return nil
	case <-f.down:
		select {
		case <-f.back:
			<-ctx.Done() // healthy again: watch until the phase ends
			return nil
		default:
		}
		return standbyDown{}
	}
}

func (f *fakeStandby) WaitHealthy(ctx context.Context) error {
	f.waits.Add(1)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-f.back:
		return nil
	}
}

// moves records the standby moves the Observer is told of.
type moves struct {
	supervisor.NopObserver
	mu  sync.Mutex
	tos []string
}

func (m *moves) StandbyMove(to string, _ error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.tos = append(m.tos, to)
}

func (m *moves) list() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.tos...)
}

// TestStandbyUnavailableMovesDeliveryToThePrimaryAndBack: in auto mode, when
// the standby watch reports the standby unavailable, the stream's phase ends
// and the claim path takes every due row (on the primary) — not for
// ReplicationRetry, but until the standby is healthy again; then the stream
// starts again. Both moves are reported; the slot on the standby, not the
// primary's, is the one dropped on the way back.
func TestStandbyUnavailableMovesDeliveryToThePrimaryAndBack(t *testing.T) {
	primarySlots := &slots{exists: true}
	standbySlots := &slots{exists: true}
	var streams, polls atomic.Int32
	cfg := baseConfig(supervisor.ModeAuto, primarySlots)
	cfg.SlotMaxUnconsumed = time.Hour
	cfg.ReplicationRetry = 50 * time.Millisecond // a standby fallback does not end by it
	cfg.StandbySlots = standbySlots
	sb := newFakeStandby()
	cfg.Standby = sb
	var mv moves
	cfg.Observer = &mv
	fake(cfg).stream = func(*relay.Engine) (supervisor.Runner, error) {
		streams.Add(1)
		return runner{untilDone}, nil
	}
	fake(cfg).claim = func(_ *relay.Engine, all bool) (supervisor.Runner, error) {
		if all {
			polls.Add(1)
		}
		return runner{untilDone}, nil
	}
	stop := start(t, cfg)
	eventually(t, "the stream with its standby watch", func() bool { return streams.Load() == 1 && sb.watches.Load() == 1 })
	close(sb.down)
	eventually(t, "delivery on the primary", func() bool { return polls.Load() == 1 && sb.waits.Load() == 1 })
	time.Sleep(300 * time.Millisecond) // several ReplicationRetry periods
	if n := streams.Load(); n != 1 {
		t.Fatalf("the stream started %d times while the standby was unavailable, want 1", n)
	}
	if got := mv.list(); len(got) != 1 || got[0] != "primary" {
		t.Fatalf("moves %v, want [primary]", got)
	}
	close(sb.back)
	eventually(t, "the return to the stream", func() bool { return streams.Load() == 2 })
	if got := mv.list(); len(got) != 2 || got[1] != "standby" {
		t.Fatalf("moves %v, want [primary standby]", got)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if primarySlots.dropped() != 0 {
		t.Errorf("the primary's slot view was dropped %d times; the stream's slot is the standby's", primarySlots.dropped())
	}
}

// TestStandbyUnavailableInReplicationModeKeepsStreaming: in replication
// mode an unavailable standby is logged, and the stream keeps trying it:
// no poll phase, no error.
func TestStandbyUnavailableInReplicationModeKeepsStreaming(t *testing.T) {
	cfg := baseConfig(supervisor.ModeReplication, &slots{})
	sb := newFakeStandby()
	close(sb.down)
	cfg.Standby = sb
	var polls, streams atomic.Int32
	fake(cfg).stream = func(*relay.Engine) (supervisor.Runner, error) {
		streams.Add(1)
		return runner{untilDone}, nil
	}
	fake(cfg).claim = func(_ *relay.Engine, all bool) (supervisor.Runner, error) {
		if all {
			polls.Add(1)
		}
		return runner{untilDone}, nil
	}
	stop := start(t, cfg)
	eventually(t, "the standby watch", func() bool { return sb.watches.Load() >= 1 })
	time.Sleep(200 * time.Millisecond)
	if polls.Load() != 0 || streams.Load() != 1 {
		t.Fatalf("%d poll phases and %d stream phases, want 0 and 1", polls.Load(), streams.Load())
	}
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}

// TestStandbySlotWatchdog: the relay's slot on the standby has a watchdog
// of its own, beside the primary's.
func TestStandbySlotWatchdog(t *testing.T) {
	standbySlots := &slots{exists: true}
	cfg := baseConfig(supervisor.ModePoll, &slots{})
	cfg.StandbySlots = standbySlots
	stop := start(t, cfg)
	eventually(t, "the unconsumed slot on the standby dropped", func() bool { return standbySlots.dropped() == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
