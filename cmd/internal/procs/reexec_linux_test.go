package procs

import (
	"strings"
	"testing"
)

// TestKeepSysmonAwakeRunsOnWhenItCannotExecute: a binary that cannot be
// executed again (no /proc, a seccomp profile without execve) leaves the
// process running as it was, with an error that names the setting.
func TestKeepSysmonAwakeRunsOnWhenItCannotExecute(t *testing.T) {
	t.Setenv("GODEBUG", "")
	selfExe = t.TempDir() + "/no-such-binary"
	t.Cleanup(func() { selfExe = "/proc/self/exe" })
	err := KeepSysmonAwake()
	if err == nil || !strings.Contains(err.Error(), SysmonSetting) {
		t.Fatalf("KeepSysmonAwake() = %v, want an error naming %s", err, SysmonSetting)
	}
}

// TestKeepSysmonAwakeLeavesTheOperatorsSetting: with schedtrace in GODEBUG
// it does not try to execute anything (the path it would execute does not
// exist, so a try would return an error).
func TestKeepSysmonAwakeLeavesTheOperatorsSetting(t *testing.T) {
	t.Setenv("GODEBUG", "schedtrace=0")
	selfExe = t.TempDir() + "/no-such-binary"
	t.Cleanup(func() { selfExe = "/proc/self/exe" })
	if err := KeepSysmonAwake(); err != nil {
		t.Fatalf("KeepSysmonAwake() with GODEBUG=schedtrace=0 tried to execute: %v", err)
	}
}
