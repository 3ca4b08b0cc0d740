package main

import (
	"testing"
	"time"
)

// TestStatsPause: the table gauges refresh every 10 s from the start of a
// refresh, and a slow refresh (a count behind a large backlog) is followed
// by a pause 19 times its length, so that counting takes at most a
// twentieth of one connection's time.
func TestStatsPause(t *testing.T) {
	for _, c := range []struct{ took, want time.Duration }{
		{0, 10 * time.Second},
		{20 * time.Millisecond, 10*time.Second - 20*time.Millisecond},
		{500 * time.Millisecond, 9500 * time.Millisecond},
		{time.Second, 19 * time.Second},
		{1800 * time.Millisecond, 34200 * time.Millisecond},
	} {
		if got := statsPause(c.took); got != c.want {
			t.Errorf("statsPause(%s) = %s, want %s", c.took, got, c.want)
		}
		if busy := float64(c.took) / float64(c.took+statsPause(c.took)); busy > 0.05+1e-9 {
			t.Errorf("after a refresh of %s, counting takes %.0f%% of the time", c.took, 100*busy)
		}
	}
}
