//go:build unix && !linux

package pgtest

import "syscall"

// sysProcAttr runs a server binary as cred (nil: the current user). Outside
// Linux there is no parent-death signal: a crashed test binary leaves its
// servers running.
func sysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred}
}

// serverProcesses cannot find the children of a killed postmaster outside
// Linux; it reports none, so Start after Kill may meet a shared memory block
// still in use and fail.
func serverProcesses(dataDir string) ([]int, error) {
	return nil, nil
}
