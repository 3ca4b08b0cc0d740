package procs

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// Yielding on wake-up (docs/performance.md, "Yielding on wake-up").
//
// The relay is woken by the data it waits for: its walsender's messages,
// the sinks' acknowledgements, its queries' results. Under the kernel's
// default policy a thread that wakes up may preempt the process running on
// its CPU — and the process that woke it is usually the one running there.
// Measured at 1,000 events/s with PostgreSQL on the same two cores, one
// relay thread preempted the relay's own walsender about 600 times a
// second before the walsender had blocked: each time the walsender
// waited for a CPU while the relay waited for what it had not yet sent,
// and the relay's walsender sent three to ten times as many transactions
// more than 10–25 ms late as a bare client's walsender beside it.
//
// Under SCHED_BATCH a thread that wakes up waits for its CPU's current
// process to block or use up its slice instead: where a CPU is idle it
// still runs at once. Nothing else changes: its share of the CPUs, its
// nice value and its limits are those of the default policy. A drain is
// different: with every CPU busy, each of the relay's wake-ups would wait
// for another process's slice: in one of two measured pairs the drains
// ran at half their rate or less. So the policy follows the Sizer
// (procs.go): SCHED_BATCH while the relay runs on one P, quiet; the
// default policy as soon as it is busy.
//
// YieldOnWake moves every thread of the process that runs under the
// default policy (SCHED_OTHER) to SCHED_BATCH, keeping its nice value.
// Threads created afterwards inherit the policy of the thread that creates
// them, so after one call the whole process runs under it. It returns how
// many threads it moved.
func YieldOnWake() (int, error) { return moveThreads(unix.SCHED_NORMAL, unix.SCHED_BATCH) }

// PreemptOnWake moves every thread under SCHED_BATCH back to the default
// policy: YieldOnWake undone.
func PreemptOnWake() (int, error) { return moveThreads(unix.SCHED_BATCH, unix.SCHED_NORMAL) }

// startedNormal reports whether the process's main thread runs under the
// default policy: otherwise the operator chose one (chrt, systemd's
// CPUSchedulingPolicy), and it stands.
func startedNormal() bool {
	attr, err := unix.SchedGetAttr(os.Getpid(), 0)
	return err == nil && attr.Policy == unix.SCHED_NORMAL
}

// moveThreads moves every thread of the process under policy from to
// policy to, keeping its nice value.
func moveThreads(from, to uint32) (int, error) {
	moved := 0
	// A thread created during a pass by a thread not yet moved is found
	// by the next pass; the passes end when one moves nothing.
	for range 10 {
		n, err := movePass(from, to)
		moved += n
		if err != nil || n == 0 {
			return moved, err
		}
	}
	return moved, nil
}

func movePass(from, to uint32) (int, error) {
	tids, err := threadIDs(os.Getpid())
	if err != nil {
		return 0, err
	}
	moved := 0
	for _, tid := range tids {
		attr, err := unix.SchedGetAttr(tid, 0)
		if errors.Is(err, unix.ESRCH) {
			continue // the thread has exited
		}
		if err != nil {
			return moved, fmt.Errorf("read thread %d's scheduling policy: %w", tid, err)
		}
		if attr.Policy != from {
			continue
		}
		attr.Policy = to
		// Only reset-on-fork carries over: the other flags ask to change
		// parameters (utilisation clamps, deadlines) this call keeps.
		attr.Flags &= unix.SCHED_FLAG_RESET_ON_FORK
		if err := unix.SchedSetAttr(tid, attr, 0); err != nil && !errors.Is(err, unix.ESRCH) {
			return moved, fmt.Errorf("set thread %d's scheduling policy to %d: %w", tid, to, err)
		}
		moved++
	}
	return moved, nil
}

// threadIDs lists the threads of process pid.
func threadIDs(pid int) ([]int, error) {
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil, fmt.Errorf("list process %d's threads: %w", pid, err)
	}
	tids := make([]int, 0, len(entries))
	for _, e := range entries {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}

// ThreadPolicies returns the scheduling policy of each thread of process
// pid that still runs (what `ps -L -o cls` shows), for tests and checks.
func ThreadPolicies(pid int) (map[int]uint32, error) {
	tids, err := threadIDs(pid)
	if err != nil {
		return nil, err
	}
	out := make(map[int]uint32, len(tids))
	for _, tid := range tids {
		if attr, err := unix.SchedGetAttr(tid, 0); err == nil {
			out[tid] = attr.Policy
		}
	}
	return out, nil
}
