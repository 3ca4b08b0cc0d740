//go:build !linux

package procs

// Scheduling policies are Linux's here (see batch_linux.go): elsewhere the
// relay's threads keep the policy they were started with.

// YieldOnWake does nothing here.
func YieldOnWake() (int, error) { return 0, nil }

// PreemptOnWake does nothing here.
func PreemptOnWake() (int, error) { return 0, nil }

func startedNormal() bool { return false }
