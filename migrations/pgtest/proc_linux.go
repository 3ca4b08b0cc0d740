package pgtest

import (
	"fmt"
	"os"
	"strconv"
	"syscall"
)

// sysProcAttr runs a server binary as cred (nil: the current user) and has
// the kernel send it SIGQUIT (immediate shutdown) when the thread that
// started it exits, so a crashed test binary leaves no server behind. Go sets
// the parent-death signal after switching credentials, which would otherwise
// clear it.
func sysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGQUIT}
}

// serverProcesses returns the live processes whose working directory is
// dataDir. The postmaster changes into its data directory before it forks, so
// these are the postmaster and its children, including children orphaned by a
// killed postmaster. Zombies have no working directory and are not listed.
func serverProcesses(dataDir string) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cwd, err := os.Readlink("/proc/" + e.Name() + "/cwd")
		if err != nil {
			continue // exited, a zombie, or not ours to inspect
		}
		if cwd == dataDir {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}
