package main

import (
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

func (s *setup) walsenderPID(t *testing.T) int64 {
	t.Helper()
	return s.scalar(t, "SELECT coalesce(max(active_pid), 0) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active")
}

// TestRelay_HA: two relay processes on one config. Exactly one streams;
// kill -9 of the leader, and the other streams within 15 s; a leader whose
// lock connection is cut stops streaming within 5 s and the other takes
// over; no event is lost across both takeovers.
func TestRelay_HA(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfgPath := s.configFile(t, "")
	var logA, logB, logC syncBuffer

	a := s.startProcess(t, cfgPath, &logA)
	s.waitSlot(t)
	s.startProcess(t, cfgPath, &logB)
	eventually(t, 10*time.Second, "the second relay standing by", func() bool {
		return strings.Contains(logB.String(), "standing by")
	})

	var wg sync.WaitGroup
	wg.Go(func() { s.publishWritersPaced(t, 2, 600, 10, "ha", 4*time.Millisecond) })

	eventually(t, 20*time.Second, "deliveries before the kill", func() bool { return len(s.hook.deliveries()) >= 200 })
	if n := s.scalar(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay leader outbox_relay'
		AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)`); n != 1 {
		t.Fatalf("%d leader lock sessions, want 1", n)
	}
	if strings.Contains(logB.String(), "leader for the slot") {
		t.Fatal("the standby became leader while the leader was alive")
	}

	// kill -9 the leader.
	before := s.walsenderPID(t)
	a.Process.Signal(syscall.SIGKILL)
	a.Wait()
	killed := time.Now()
	eventually(t, 15*time.Second, "the standby streaming", func() bool {
		pid := s.walsenderPID(t)
		return pid != 0 && pid != before
	})
	t.Logf("kill -9 of the leader: the standby streamed after %v", time.Since(killed).Round(time.Millisecond))

	// A third relay stands by; then the leader's lock connection is cut.
	s.startProcess(t, cfgPath, &logC)
	eventually(t, 10*time.Second, "the third relay standing by", func() bool {
		return strings.Contains(logC.String(), "standing by")
	})
	before = s.walsenderPID(t)
	s.scalar(t, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'outbox-relay leader outbox_relay'
		AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)`)
	cut := time.Now()
	eventually(t, 5*time.Second, "the cut leader to stop streaming", func() bool {
		return s.walsenderPID(t) != before
	})
	t.Logf("lock connection cut: the old leader stopped streaming after %v", time.Since(cut).Round(time.Millisecond))
	eventually(t, 15*time.Second, "the other relay streaming", func() bool {
		return strings.Contains(logC.String(), "leader for the slot") && s.walsenderPID(t) != 0
	})
	t.Logf("the other relay took over after %v", time.Since(cut).Round(time.Millisecond))

	wg.Wait()
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 90*time.Second, keys)
	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		repeats := 0
		for key, copies := range byKey(ds) {
			for _, c := range copies[1:] {
				repeats++
				if c.IdemKey != copies[0].IdemKey || c.Body != copies[0].Body {
					t.Fatalf("%s: repeat of %s differs", sink, key)
				}
			}
		}
		t.Logf("%s: %d events, %d repeats across two takeovers", sink, len(keys), repeats)
		checkOrder(t, sink, ds)
	}
}
