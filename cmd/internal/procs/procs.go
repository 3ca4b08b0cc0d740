// Package procs sizes the Go scheduler to the relay's load
// (docs/performance.md, "The scheduler").
//
// At a steady trickle the relay's work is a chain of short hand-offs: the
// stream's reader, the decoder, each sink's lane, the NATS client's
// goroutines, the settlement loop. With more than one P, each hand-off to
// a parked goroutine wakes a second OS thread that spins looking for work
// and finds none: measured at 1,000 events/s on two cores, that spinning
// (futex wake-ups, epoll polls, steals) was about half of the relay's CPU
// per event. With one P the same hand-offs are plain function switches on
// one thread. A drain is different: the decoder, the lanes and the sinks'
// clients work at the same time, and one P would cap the relay at one
// core.
//
// The Sizer therefore watches the process's CPU time and runs the
// scheduler with one P while the relay uses little CPU, and with the
// runtime's default (GOMAXPROCS from the CPUs and the cgroup's limit) as
// soon as one P is busy. An operator who sets GOMAXPROCS in the
// environment keeps it: the Sizer does not run.
package procs

import (
	"context"
	"os"
	"runtime"
	"time"

	"github.com/rs/zerolog"
)

// Defaults, measured in docs/performance.md ("The scheduler").
const (
	// DefaultEvery is how often the process's CPU time is sampled.
	DefaultEvery = time.Second
	// DefaultWiden: CPU use (cores) at or above which one P is busy enough
	// to go wide: at one P the relay cannot use much more than one core,
	// and above this the next event may wait for a P.
	DefaultWiden = 0.7
	// DefaultNarrow: CPU use (cores) below which, for NarrowAfter samples
	// in a row, the relay goes back to one P. Below DefaultWiden by a
	// margin, so that the same load does not move it back and forth: one
	// P does the same work for less CPU than several.
	DefaultNarrow = 0.5
	// DefaultNarrowAfter is how many quiet samples in a row it takes.
	DefaultNarrowAfter = 10
)

// Sizer moves GOMAXPROCS between one and the runtime's default.
type Sizer struct {
	Every       time.Duration
	Widen       float64
	Narrow      float64
	NarrowAfter int
	Log         zerolog.Logger

	// cpu returns the process's CPU time so far; set sets GOMAXPROCS to n
	// (0: the runtime's default). Tests replace both.
	cpu func() time.Duration
	set func(n int)
	now func() time.Time
	// yield, when set, moves the process's threads to SCHED_BATCH (true)
	// or back to the default policy (false) with the narrowing and the
	// widening (batch_linux.go). Tests replace it.
	yield func(on bool) error

	wide  bool // running with the runtime's default
	quiet int  // samples in a row below Narrow while wide
}

// New returns a Sizer with the defaults, or nil when the environment sets
// GOMAXPROCS (the operator's choice stands), the machine has one CPU, or
// the system has no getrusage. With yieldWhenQuiet (cpu_scheduling:
// batch) the process's threads run under SCHED_BATCH while it runs on one
// P, unless the process was started under a policy other than the default
// (the operator's choice stands).
func New(log zerolog.Logger, yieldWhenQuiet bool) *Sizer {
	if os.Getenv("GOMAXPROCS") != "" || runtime.GOMAXPROCS(0) < 2 || processCPU == nil {
		return nil
	}
	s := &Sizer{Every: DefaultEvery, Widen: DefaultWiden, Narrow: DefaultNarrow, NarrowAfter: DefaultNarrowAfter, Log: log,
		cpu: processCPU, set: setProcs, now: time.Now}
	if yieldWhenQuiet && startedNormal() {
		s.yield = setYield
	}
	return s
}

// setYield moves the process's threads to SCHED_BATCH or back.
func setYield(on bool) error {
	if on {
		_, err := YieldOnWake()
		return err
	}
	_, err := PreemptOnWake()
	return err
}

// Run samples until ctx ends, then leaves the runtime's default in place.
// It starts wide: a relay that starts behind drains first.
func (s *Sizer) Run(ctx context.Context) {
	s.wide = true
	defer func() {
		s.set(0)
		s.policy(false)
	}()
	tick := time.NewTicker(s.Every)
	defer tick.Stop()
	lastCPU, lastAt := s.cpu(), s.now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		cpu, at := s.cpu(), s.now()
		if wall := at.Sub(lastAt); wall > 0 {
			s.observe(float64(cpu-lastCPU) / float64(wall))
		}
		lastCPU, lastAt = cpu, at
	}
}

// observe takes one sample of the cores used since the last one.
func (s *Sizer) observe(cores float64) {
	switch {
	case !s.wide && cores >= s.Widen:
		s.wide, s.quiet = true, 0
		s.set(0)
		s.policy(false)
		s.Log.Debug().Float64("cores", cores).Int("gomaxprocs", runtime.GOMAXPROCS(0)).Msg("busy: the scheduler runs wide")
	case s.wide && cores < s.Narrow:
		if s.quiet++; s.quiet >= s.NarrowAfter {
			s.wide, s.quiet = false, 0
			s.set(1)
			s.policy(true)
			s.Log.Debug().Float64("cores", cores).Msg("quiet: the scheduler runs on one thread")
		}
	case s.wide:
		s.quiet = 0
	}
}

// policy moves the threads to SCHED_BATCH (yield) or back, when the Sizer
// manages the policy. A failure (a seccomp filter refusing sched_setattr)
// is logged and ends the management: the threads keep what they have.
func (s *Sizer) policy(yield bool) {
	if s.yield == nil {
		return
	}
	if err := s.yield(yield); err != nil {
		s.Log.Warn().Err(err).Msg("cpu_scheduling: batch: the scheduling policy cannot be changed; the relay's threads keep theirs (cpu_scheduling: normal skips this)")
		s.yield = nil
	}
}

// setProcs sets GOMAXPROCS to n, or back to the runtime's default (which
// follows the cgroup's CPU limit again) for 0.
func setProcs(n int) {
	if n == 0 {
		runtime.SetDefaultGOMAXPROCS()
		return
	}
	runtime.GOMAXPROCS(n)
}
