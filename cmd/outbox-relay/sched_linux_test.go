package main

import (
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/outbox-relay/outbox-relay/cmd/internal/procs"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// threadPolicies returns the scheduling policy of each thread of process pid.
func threadPolicies(t *testing.T, pid int) map[int]uint32 {
	t.Helper()
	got, err := procs.ThreadPolicies(pid)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// startNormal starts the relay from a thread under the default policy,
// whatever earlier in-process relays did to this test process.
func (s *setup) startNormal(t *testing.T, cfgPath string, logs *syncBuffer) int {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	attr, err := unix.SchedGetAttr(0, 0)
	if err == nil {
		attr.Policy, attr.Flags = unix.SCHED_NORMAL, 0
		err = unix.SchedSetAttr(0, attr, 0)
	}
	if err != nil {
		t.Fatalf("start the relay under SCHED_NORMAL: %v", err)
	}
	return s.startProcess(t, cfgPath, logs).Process.Pid
}

// allUnder reports whether every thread of pid runs under policy, and
// what they run under.
func allUnder(t *testing.T, pid int, policy uint32) (bool, map[int]uint32) {
	got := threadPolicies(t, pid)
	for _, p := range got {
		if p != policy {
			return false, got
		}
	}
	return len(got) > 1, got
}

// run's threads start under the default policy (a relay starts wide, and
// may have a backlog to drain), move to SCHED_BATCH once the relay is
// quiet and runs on one P, and keep the default policy under
// cpu_scheduling: normal (docs/configuration.md).
func TestRun_CPUSchedulingFollowsTheLoad(t *testing.T) {
	if runtime.NumCPU() < 2 {
		skipOrFailInCI(t, "one CPU: the Sizer, which moves the policy with the scheduler's size, does not run")
	}
	def := newSetup(t, pgtest.NewDatabase(t))
	normal := newSetup(t, pgtest.NewDatabase(t))
	var defLogs, normalLogs syncBuffer
	defPid := def.startNormal(t, def.configFile(t, ""), &defLogs)
	normalPid := normal.startNormal(t, normal.configFileWith(t, "", "cpu_scheduling: normal"), &normalLogs)
	// Wide at the start, for the first NarrowAfter seconds at least.
	eventually(t, 5*time.Second, "the relay's threads", func() bool { return len(threadPolicies(t, defPid)) > 1 })
	if ok, got := allUnder(t, defPid, unix.SCHED_NORMAL); !ok {
		t.Fatalf("right after the start (wide): relay threads %v, want all SCHED_NORMAL\n%s", got, defLogs.String())
	}
	def.publishWriters(t, 1, 5, 5, "sched-a")
	def.waitDone(t, "event_key LIKE 'sched-a%'", 5)
	eventually(t, time.Duration(procs.DefaultNarrowAfter+30)*time.Second, "the quiet relay's threads under SCHED_BATCH", func() bool {
		ok, _ := allUnder(t, defPid, unix.SCHED_BATCH)
		return ok
	})
	def.publishWriters(t, 1, 5, 5, "sched-b")
	def.waitDone(t, "event_key LIKE 'sched-b%'", 5)
	time.Sleep(2 * time.Second) // both relays have been quiet as long
	if ok, got := allUnder(t, normalPid, unix.SCHED_NORMAL); !ok {
		t.Errorf("cpu_scheduling: normal: relay threads %v, want all SCHED_NORMAL\n%s", got, normalLogs.String())
	}
}
