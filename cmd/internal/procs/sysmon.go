package procs

import "strings"

// The runtime's system monitor (docs/performance.md, "The system monitor")
//
// sysmon is the runtime's own thread that retakes Ps from blocking system
// calls and preempts long-running goroutines. When every P is idle it
// sleeps deeply, and the first system call after that wakes it with a
// futex; it then polls every 20 µs until the process is idle again, and
// sleeps deeply again. A relay at a steady trickle goes idle between
// events several times per event (the stream's read, the sink's
// acknowledgement, the settlement), so each of those paid a futex wake-up
// and a few 20 µs sleeps of a second thread: measured at 1,000 events/s,
// a quarter of the relay's CPU.
//
// With a scheduler trace period set, sysmon never sleeps deeply: it stays in
// its loop, whose period grows to 10 ms while nothing needs retaking —
// a hundred wake-ups a second instead of thousands. The period below is the
// longest GODEBUG takes (24.8 days), so the trace itself prints at most
// once per 24.8 days of the host's uptime (a line starting "SCHED" on
// stderr, at the start on a host up longer than that). What the process
// gives up: a goroutine blocked in a system call that does not return
// holds its P up to 10–20 ms before sysmon hands it on, instead of
// 20–40 µs, when that call comes right after an idle spell.

// SysmonSetting is the GODEBUG setting that keeps sysmon in its loop.
const SysmonSetting = "schedtrace=2147483647"

// WithSysmonSetting returns env (os.Environ's form) with SysmonSetting
// added to GODEBUG, and false, leaving env alone, when GODEBUG already sets
// schedtrace: the operator's value stands (schedtrace=0 turns this off).
func WithSysmonSetting(env []string) ([]string, bool) {
	out := make([]string, 0, len(env)+1)
	added := false
	for _, kv := range env {
		v, ok := strings.CutPrefix(kv, "GODEBUG=")
		if !ok {
			out = append(out, kv)
			continue
		}
		if added {
			continue // a later duplicate: the runtime reads the first
		}
		// Read as the runtime reads it: comma-separated key=value, no
		// spaces (" schedtrace=0" is an unknown key to the runtime).
		for _, field := range strings.Split(v, ",") {
			if strings.HasPrefix(field, "schedtrace=") {
				return env, false
			}
		}
		if v != "" {
			v += ","
		}
		out = append(out, "GODEBUG="+v+SysmonSetting)
		added = true
	}
	if !added {
		out = append(out, "GODEBUG="+SysmonSetting)
	}
	return out, true
}
