package procs

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// fakeProcess plays the process's CPU clock and records GOMAXPROCS.
type fakeProcess struct {
	mu    sync.Mutex
	cpu   time.Duration
	at    time.Time
	cores float64 // CPU use over the next sample
	sets  []int
}

func (f *fakeProcess) sizer() *Sizer {
	return &Sizer{Every: time.Millisecond, Widen: DefaultWiden, Narrow: DefaultNarrow, NarrowAfter: 3, Log: zerolog.Nop(),
		cpu: func() time.Duration { f.mu.Lock(); defer f.mu.Unlock(); return f.cpu },
		now: func() time.Time {
			f.mu.Lock()
			defer f.mu.Unlock()
			// Each look at the clock is one sample's second later, with
			// the CPU used meanwhile.
			f.at = f.at.Add(time.Second)
			f.cpu += time.Duration(f.cores * float64(time.Second))
			return f.at
		},
		set: func(n int) { f.mu.Lock(); defer f.mu.Unlock(); f.sets = append(f.sets, n) },
	}
}

func TestSizer_Observe(t *testing.T) {
	f := &fakeProcess{}
	s := f.sizer()
	s.wide = true
	for i, step := range []struct {
		cores float64
		want  []int // GOMAXPROCS settings made so far (0: the runtime's default)
	}{
		{0.2, nil}, {0.2, nil},
		{0.6, nil},                              // between the thresholds: the quiet run starts again
		{0.2, nil}, {0.2, nil}, {0.2, []int{1}}, // three quiet samples in a row: one P
		{0.6, []int{1}},    // not busy enough to widen
		{0.9, []int{1, 0}}, // one P busy: the default at once
		{0.4, []int{1, 0}},
	} {
		s.observe(step.cores)
		if len(f.sets) != len(step.want) {
			t.Fatalf("step %d (%.1f cores): settings %v, want %v", i, step.cores, f.sets, step.want)
		}
		for j := range step.want {
			if f.sets[j] != step.want[j] {
				t.Fatalf("step %d (%.1f cores): settings %v, want %v", i, step.cores, f.sets, step.want)
			}
		}
	}
}

// TestSizer_RunMeasuresTheProcessAndRestoresTheDefault: Run turns CPU time
// into cores per sample, narrows a quiet process and leaves the runtime's
// default in place when it stops.
func TestSizer_RunMeasuresTheProcessAndRestoresTheDefault(t *testing.T) {
	f := &fakeProcess{cores: 0.1}
	s := f.sizer()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	deadline := time.Now().Add(5 * time.Second)
	sets := func() int { f.mu.Lock(); defer f.mu.Unlock(); return len(f.sets) }
	waitUntil(t, deadline, "a quiet process was never narrowed", func() bool { return sets() > 0 })
	f.mu.Lock()
	f.cores = 1.5
	f.mu.Unlock()
	waitUntil(t, deadline, "a busy process was never widened", func() bool { return sets() > 1 })
	cancel()
	<-done
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.sets[0] != 1 || f.sets[1] != 0 || f.sets[len(f.sets)-1] != 0 {
		t.Fatalf("settings %v: want one P, then the default, and the default at the end", f.sets)
	}
}

func TestNew_TheEnvironmentsGOMAXPROCSStands(t *testing.T) {
	t.Setenv("GOMAXPROCS", "2")
	if s := New(zerolog.Nop(), true); s != nil {
		t.Fatal("New returned a Sizer although GOMAXPROCS is set")
	}
}

// TestSizer_YieldsWhileNarrow: with the policy managed, the threads move
// to SCHED_BATCH with the narrowing and back with the widening; a failure
// ends the management instead of being retried at every change.
func TestSizer_YieldsWhileNarrow(t *testing.T) {
	f := &fakeProcess{}
	s := f.sizer()
	var calls []bool
	fail := false
	s.yield = func(on bool) error {
		calls = append(calls, on)
		if fail {
			return errors.New("operation not permitted")
		}
		return nil
	}
	s.wide = true
	for i, step := range []struct {
		cores float64
		want  []bool
	}{
		{0.2, nil}, {0.2, nil}, {0.2, []bool{true}}, // narrow: SCHED_BATCH
		{0.6, []bool{true}},
		{0.9, []bool{true, false}}, // wide: the default policy at once
		{0.2, []bool{true, false}}, {0.2, []bool{true, false}}, {0.2, []bool{true, false, true}},
	} {
		s.observe(step.cores)
		if !slices.Equal(calls, step.want) {
			t.Fatalf("step %d (%.1f cores): policy changes %v, want %v", i, step.cores, calls, step.want)
		}
	}
	fail = true
	s.observe(0.9)
	s.observe(0.2)
	s.observe(0.2)
	s.observe(0.2)
	if want := []bool{true, false, true, false}; !slices.Equal(calls, want) {
		t.Fatalf("after a failure: policy changes %v, want %v (no further attempt)", calls, want)
	}
	if len(f.sets) != 5 {
		t.Fatalf("GOMAXPROCS settings %v: the sizing goes on without the policy", f.sets)
	}
}

// TestSizer_RunEndsUnderTheDefaultPolicy: a Run that ends while narrow
// (SCHED_BATCH) moves the threads back, so that what follows it in the
// process — the end of run — is not scheduled as the quiet relay was.
func TestSizer_RunEndsUnderTheDefaultPolicy(t *testing.T) {
	f := &fakeProcess{cores: 0.1}
	s := f.sizer()
	var mu sync.Mutex
	var calls []bool
	s.yield = func(on bool) error { mu.Lock(); defer mu.Unlock(); calls = append(calls, on); return nil }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	waitUntil(t, time.Now().Add(5*time.Second), "a quiet process never moved to SCHED_BATCH", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(calls) > 0
	})
	cancel()
	<-done
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(calls, []bool{true, false}) {
		t.Fatalf("policy changes %v, want SCHED_BATCH and the default policy at the end", calls)
	}
}

// waitUntil polls cond until it holds, failing with what after deadline.
func waitUntil(t *testing.T, deadline time.Time, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal(what)
		}
		time.Sleep(time.Millisecond)
	}
}
