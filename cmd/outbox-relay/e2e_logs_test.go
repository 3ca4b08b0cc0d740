package main

import (
	"encoding/json"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestRun_LogsOfACleanStart runs the relay binary as a person would, twice:
// a first start that creates the slot, and a restart that finds a backlog
// written while it was stopped, older than sweep_after. Every JSON line of
// both runs parses, carries each key once, and has its time to the
// millisecond; neither run logs a warning or an error: a backlog the relay
// delivers within sweep_after of attaching is not "stuck", and stopping is
// not a failure (docs/operations.md, "reconcile").
func TestRun_LogsOfACleanStart(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	const sweepAfter = 2 * time.Second
	cfgPath := s.configFileWith(t, "", "source: {sweep_after: 2s}")

	first, second := newLogLines(t, nil), newLogLines(t, nil)
	relay := s.startProcess(t, cfgPath, first)
	s.waitSlot(t)
	s.publishWriters(t, 1, 5, 5, "before")
	s.waitAllDelivered(t, 30*time.Second, s.keys(t, "true"))
	stopProcess(t, relay)

	// A backlog written while the relay is down, pending longer than
	// sweep_after when it starts again.
	s.publishWriters(t, 2, 100, 10, "backlog")
	time.Sleep(sweepAfter + 500*time.Millisecond)
	relay = s.startProcess(t, cfgPath, second)
	s.waitAllDelivered(t, 30*time.Second, s.keys(t, "true"))
	// The stuck-rows alarm would have fired by now: the sweeper runs at
	// once and then every second.
	time.Sleep(sweepAfter + 1500*time.Millisecond)
	stopProcess(t, relay)

	for run, log := range map[string]*logLines{"first start": first, "restart with a backlog": second} {
		lines := log.Lines()
		if len(lines) < 5 {
			t.Fatalf("%s: %d log lines", run, len(lines))
		}
		for _, line := range lines {
			fields := mustLogLine(t, line)
			if at, _ := fields["time"].(string); !jsonTime.MatchString(at) {
				t.Errorf("%s: time %q is not RFC 3339 UTC with milliseconds: %s", run, at, line)
			}
			if level := fields["level"]; level == "warn" || level == "error" {
				t.Errorf("%s: a clean start logs a %s: %s", run, level, line)
			}
			for k, v := range fields {
				if !durationKey(k) {
					continue
				}
				// One form: Go's duration text, as time.Duration prints it.
				switch v := v.(type) {
				case json.Number:
					t.Errorf("%s: duration %s=%s is a bare number: %s", run, k, v, line)
				case string:
					if d, err := time.ParseDuration(v); err != nil || d.String() != v {
						t.Errorf("%s: duration %s=%q is not in time.Duration's form: %s", run, k, v, line)
					}
				}
			}
		}
		if t.Failed() {
			t.Logf("%s:\n%s", run, strings.Join(lines, "\n"))
		}
	}
}

// durationKey reports whether a log field names a duration by the
// relay's naming (retry_in, status_interval, oldest_age, sweep_after, …).
func durationKey(k string) bool {
	for _, suffix := range []string{"_in", "interval", "_age", "_after", "_every", "_window", "timeout", "took"} {
		if strings.HasSuffix(k, suffix) {
			return true
		}
	}
	return false
}

// stopProcess sends SIGTERM to the relay process and waits for it to exit
// 0, as a supervisor would.
func stopProcess(t *testing.T, relay *exec.Cmd) {
	t.Helper()
	if err := relay.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- relay.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("relay exited after SIGTERM: %v", err)
		}
	case <-time.After(45 * time.Second):
		t.Fatal("relay did not exit within 45 s of SIGTERM")
	}
}
