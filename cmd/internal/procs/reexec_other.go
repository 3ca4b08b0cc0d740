//go:build !linux

package procs

// KeepSysmonAwake does nothing here: the relay is measured and run on
// Linux, and elsewhere the runtime's defaults stand (see sysmon.go).
func KeepSysmonAwake() error { return nil }
