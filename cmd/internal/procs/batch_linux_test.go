package procs

import (
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// policies returns the scheduling policy of every thread of the process.
func policies(t *testing.T) map[int]uint32 {
	t.Helper()
	got, err := ThreadPolicies(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// YieldOnWake moves every thread, and the threads created after it run
// under SCHED_BATCH too; the nice value stays; PreemptOnWake moves them
// back. Not parallel: it changes the whole test process.
func TestYieldOnWake_MovesEveryThreadAndItsLaterThreadsAndBack(t *testing.T) {
	before, err := unix.Getpriority(unix.PRIO_PROCESS, 0)
	if err != nil {
		t.Fatal(err)
	}
	moved, err := YieldOnWake()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("moved %d threads", moved)
	for tid, p := range policies(t) {
		if p != unix.SCHED_BATCH {
			t.Errorf("thread %d: policy %d, want SCHED_BATCH (%d)", tid, p, unix.SCHED_BATCH)
		}
	}
	// Threads locked by goroutines force the runtime to create new ones.
	const n = 8
	got := make(chan uint32, n)
	release := make(chan struct{})
	for range n {
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			attr, err := unix.SchedGetAttr(0, 0)
			if err != nil {
				got <- 255
			} else {
				got <- attr.Policy
			}
			<-release
		}()
	}
	for range n {
		if p := <-got; p != unix.SCHED_BATCH {
			t.Errorf("a thread created after YieldOnWake: policy %d, want SCHED_BATCH", p)
		}
	}
	close(release)
	if after, _ := unix.Getpriority(unix.PRIO_PROCESS, 0); after != before {
		t.Errorf("nice value changed: %d before, %d after", before, after)
	}
	if again, err := YieldOnWake(); err != nil || again != 0 {
		t.Errorf("a second call moved %d threads (%v), want 0", again, err)
	}
	if _, err := PreemptOnWake(); err != nil {
		t.Fatal(err)
	}
	for tid, p := range policies(t) {
		if p != unix.SCHED_NORMAL {
			t.Errorf("after PreemptOnWake, thread %d: policy %d, want SCHED_NORMAL", tid, p)
		}
	}
}
