package main

import (
	"bytes"
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// sinkCLI runs `outbox-relay sink ARGS… --config cfgPath` in this process
// and returns its exit code and output.
func sinkCLI(t *testing.T, cfgPath string, args ...string) (int, string) {
	t.Helper()
	var out bytes.Buffer
	code := Execute(context.Background(), append(append([]string{"sink"}, args...), "--config", cfgPath), &out, &out)
	return code, out.String()
}

// waitPausedRound publishes events under prefix while hook is paused and
// checks that NATS gets them all, the webhook none, and the slot's
// confirmed position passes the WAL written by them: the paused sink does
// not hold the slot.
func (s *setup) waitPausedRound(t *testing.T, prefix string) {
	t.Helper()
	s.publishWriters(t, 2, 60, 3, prefix)
	_, written := s.slotLSN(t)
	keys := s.keys(t, "event_key LIKE '"+prefix+"-%'")
	eventually(t, 60*time.Second, prefix+": every event at NATS", func() bool {
		msgs := byKey(streamMessages(t, s.nats.URL()))
		for k := range keys {
			if len(msgs[k]) == 0 {
				return false
			}
		}
		return true
	})
	eventually(t, 30*time.Second, prefix+": the slot's confirmed position past the events", func() bool {
		confirmed, _ := s.slotLSN(t)
		return confirmed >= written
	})
	for _, d := range s.hook.deliveries() {
		if strings.HasPrefix(d.EventKey, prefix+"-") {
			t.Fatalf("%s: the paused webhook got %s", prefix, d.EventKey)
		}
	}
}

// TestRelay_PauseAcrossRestartAndTakeover: a sink paused with the CLI gets
// nothing while the other sink gets every event and the slot moves on; the
// pause holds across a restart of the relay and across a leader takeover
// by a second relay, status shows it, and after the resume the held events
// reach the sink, each once, in per-aggregate order. An unknown sink is a
// usage error naming the configured ones.
func TestRelay_PauseAcrossRestartAndTakeover(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfgPath := s.configFile(t, "")

	if code, out := sinkCLI(t, cfgPath, "pause", "nope"); code != exitUsage || !strings.Contains(out, `no such sink "nope" (configured: nats, hook)`) {
		t.Fatalf("pause an unknown sink: exit %d: %s", code, out)
	}
	var logA syncBuffer
	a := s.startProcess(t, cfgPath, &logA)
	s.waitSlot(t)
	s.publishWriters(t, 1, 10, 2, "before")
	s.waitDone(t, "event_key LIKE 'before-%'", 10)

	if code, out := sinkCLI(t, cfgPath, "pause", "hook", "--reason", "n8n upgrade"); code != exitOK || !strings.Contains(out, "sink hook paused") {
		t.Fatalf("pause: exit %d: %s", code, out)
	}
	eventually(t, 5*time.Second, "the relay to notice the pause", func() bool { return strings.Contains(logA.String(), "sink paused") })
	s.waitPausedRound(t, "paused")

	var status bytes.Buffer
	if code := Execute(context.Background(), []string{"status", "--config", cfgPath}, &status, &status); code != exitOK ||
		!strings.Contains(status.String(), "hook since") || !strings.Contains(status.String(), "n8n upgrade") {
		t.Fatalf("status while paused: exit %d:\n%s", code, status.String())
	}

	// A restart: the new process reads the pause before it sends.
	a.Process.Signal(syscall.SIGTERM)
	a.Wait()
	var logB syncBuffer
	b := s.startProcess(t, cfgPath, &logB)
	s.waitSlot(t)
	s.waitPausedRound(t, "restarted")

	// A takeover: a second relay stands by, the leader dies, and the new
	// leader reads the pause too.
	var logC syncBuffer
	s.startProcess(t, cfgPath, &logC)
	eventually(t, 10*time.Second, "the second relay standing by", func() bool { return strings.Contains(logC.String(), "standing by") })
	before := s.walsenderPID(t)
	b.Process.Signal(syscall.SIGKILL)
	b.Wait()
	eventually(t, 20*time.Second, "the standby streaming", func() bool {
		pid := s.walsenderPID(t)
		return pid != 0 && pid != before && strings.Contains(logC.String(), "leader for the slot")
	})
	s.waitPausedRound(t, "takeover")

	if code, out := sinkCLI(t, cfgPath, "resume", "hook"); code != exitOK || !strings.Contains(out, "sink hook resumed") {
		t.Fatalf("resume: exit %d: %s", code, out)
	}
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 60*time.Second, keys)
	hook := s.hook.deliveries()
	checkOrder(t, "webhook", hook)
	if n := len(byKey(hook)); n != len(keys) {
		t.Fatalf("the webhook got %d events, want %d", n, len(keys))
	}
	if !strings.Contains(logC.String(), "sink resumed") {
		t.Errorf("the leader did not log the resume:\n%s", logC.String())
	}
}
