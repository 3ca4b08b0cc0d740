package procs

import (
	"fmt"
	"os"
	"syscall"
)

// selfExe is the running binary even if its file was replaced or removed
// since it started. Tests point it elsewhere.
var selfExe = "/proc/self/exe"

// KeepSysmonAwake runs the rest of the process with SysmonSetting (see
// sysmon.go): the runtime reads GODEBUG's scheduler settings only when the
// process starts, so it executes the same binary again, same arguments and
// process id, with the setting added. It returns nil at once when the
// environment already decides (WithSysmonSetting), and an error, leaving
// the process as it was, when the binary cannot be executed again.
func KeepSysmonAwake() error {
	env, changed := WithSysmonSetting(os.Environ())
	if !changed {
		return nil
	}
	if err := syscall.Exec(selfExe, os.Args, env); err != nil {
		return fmt.Errorf("execute the relay again with GODEBUG=%s: %w", SysmonSetting, err)
	}
	return nil // not reached
}
