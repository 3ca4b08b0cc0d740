package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// clockTicks is USER_HZ, the unit of the CPU times in /proc (100 on every
// Linux architecture Go supports).
const clockTicks = 100

// procTimes is one process's line of /proc/PID/stat.
type procTimes struct {
	ppid int
	// own is utime+stime; reaped is cutime+cstime, the CPU of the children
	// it has waited for.
	own, reaped int64
	start       uint64 // start time, to tell a reused pid apart
}

// cpuSnapshot is the machine's CPU counters and every process's CPU times at
// one moment.
type cpuSnapshot struct {
	busy, total int64 // jiffies summed over all CPUs (/proc/stat "cpu")
	irq, steal  int64 // irq+softirq, and time the hypervisor took (in busy)
	procs       map[int]procTimes
}

// takeSnapshot reads /proc/stat and /proc/*/stat.
func takeSnapshot() (cpuSnapshot, error) {
	s := cpuSnapshot{procs: map[int]procTimes{}}
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return s, err
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	fields := strings.Fields(string(line))
	if len(fields) < 5 || fields[0] != "cpu" {
		return s, fmt.Errorf("unexpected /proc/stat: %q", line)
	}
	for i, f := range fields[1:] {
		v, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return s, fmt.Errorf("parse /proc/stat: %w", err)
		}
		if i >= 8 { // guest and guest_nice are already counted in user and nice
			break
		}
		s.total += v
		if i != 3 && i != 4 { // idle, iowait
			s.busy += v
		}
		switch i {
		case 5, 6:
			s.irq += v
		case 7:
			s.steal += v
		}
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return s, err
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if t, ok := readProcTimes(pid); ok {
			s.procs[pid] = t
		}
	}
	return s, nil
}

// readProcTimes parses /proc/PID/stat; false when the process is gone.
func readProcTimes(pid int) (procTimes, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procTimes{}, false
	}
	// The command name is in parentheses and may contain anything.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procTimes{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): ppid is field 4, utime..cstime 14..17,
	// starttime 22.
	if len(f) < 20 {
		return procTimes{}, false
	}
	num := func(k int) int64 { v, _ := strconv.ParseInt(f[k-3], 10, 64); return v }
	return procTimes{
		ppid:   int(num(4)),
		own:    num(14) + num(15),
		reaped: num(16) + num(17),
		start:  uint64(num(22)),
	}, true
}

// cpuGroups names the process trees whose CPU a phase reports: each root pid
// with its live descendants and the children they have reaped. The root
// "bench" (this process) counts only its own CPU; its reaped children are
// reported as "reaped" (pg_recvlogical in the ceiling phase). Kernel threads
// (children of kthreadd, pid 2) are always their own group, "kthreads".
type cpuGroups map[string]int

// cpuUsage is the CPU each group used over a window, in cores (1.0 = one CPU
// busy for the whole window).
type cpuUsage struct {
	wall   time.Duration
	groups map[string]float64
	// others is the CPU of every process outside this benchmark's tree,
	// kernel threads excluded.
	others float64
	// kernel is kernel threads plus irq and softirq time (much of it the
	// benchmark's own I/O and loopback traffic); steal is CPU the hypervisor
	// gave to other guests.
	kernel, steal float64
}

// usage computes the CPU used between two snapshots.
func usage(a, b cpuSnapshot, roots cpuGroups) cpuUsage {
	ncpu := int64(runtime.NumCPU())
	elapsed := float64(b.total-a.total) / float64(ncpu) / clockTicks // seconds
	u := cpuUsage{wall: time.Duration(elapsed * float64(time.Second)), groups: map[string]float64{}}
	if elapsed <= 0 {
		return u
	}
	rootOf := map[int]string{2: "kthreads"}
	for name, pid := range roots {
		if pid > 0 {
			rootOf[pid] = name
		}
	}
	self := os.Getpid()
	group := func(pid int) string {
		for depth := 0; pid > 1 && depth < 64; depth++ {
			if name, ok := rootOf[pid]; ok {
				return name
			}
			p, ok := b.procs[pid]
			if !ok {
				return ""
			}
			pid = p.ppid
		}
		return ""
	}
	delta := func(pid int, now procTimes, own bool) int64 {
		v := now.own
		if !own {
			v += now.reaped
		}
		if then, ok := a.procs[pid]; ok && then.start == now.start {
			w := then.own
			if !own {
				w += then.reaped
			}
			v -= w
		}
		return v
	}
	var ours int64
	ticks := map[string]int64{}
	for pid, t := range b.procs {
		g := group(pid)
		if g == "" {
			continue
		}
		if pid == self {
			d := delta(pid, t, true)
			ticks["bench"] += d
			r := t.reaped - a.procs[pid].reaped
			ticks["reaped"] += r
			ours += d + r
			continue
		}
		d := delta(pid, t, false)
		ticks[g] += d
		if g != "kthreads" {
			ours += d
		}
	}
	for g, v := range ticks {
		u.groups[g] = float64(v) / clockTicks / elapsed
	}
	kernel := ticks["kthreads"] + b.irq - a.irq
	steal := b.steal - a.steal
	others := b.busy - a.busy - ours - kernel - steal
	if others < 0 {
		others = 0
	}
	cores := func(v int64) float64 { return float64(v) / clockTicks / elapsed }
	u.others, u.kernel, u.steal = cores(others), cores(kernel), cores(steal)
	return u
}

// cpuMeter measures one window: start it, run the phase, stop it.
type cpuMeter struct {
	roots cpuGroups
	start cpuSnapshot
}

// startCPU takes the first snapshot of a window.
func startCPU(roots cpuGroups) *cpuMeter {
	s, _ := takeSnapshot()
	return &cpuMeter{roots: roots, start: s}
}

// stop takes the second snapshot and returns the window's usage.
func (m *cpuMeter) stop() cpuUsage {
	s, _ := takeSnapshot()
	return usage(m.start, s, m.roots)
}

// waitQuiet waits until processes outside roots' trees use less than
// threshold cores over one second, or maxWait passes. It returns the last
// measurement and how long it waited.
func waitQuiet(ctx context.Context, roots cpuGroups, threshold float64, maxWait time.Duration) (float64, time.Duration, error) {
	begin := time.Now()
	for {
		m := startCPU(roots)
		select {
		case <-ctx.Done():
			return 0, time.Since(begin), ctx.Err()
		case <-time.After(time.Second):
		}
		others := m.stop().others
		if others < threshold || time.Since(begin) >= maxWait {
			return others, time.Since(begin), nil
		}
	}
}

// rssSampler samples a process's VmRSS every 100 ms and reads its VmHWM
// (the kernel's peak resident set).
type rssSampler struct {
	pid  int
	stop chan struct{}
	done chan struct{}

	mu      sync.Mutex
	maxRSS  int64 // kB
	hwm     int64 // kB
	samples int
}

// sampleRSS starts sampling pid.
func sampleRSS(pid int) *rssSampler {
	s := &rssSampler{pid: pid, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			s.sample()
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
		}
	}()
	return s
}

func (s *rssSampler) sample() {
	rss, hwm, err := readMemStatus(s.pid)
	if err != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.samples++
	s.maxRSS = max(s.maxRSS, rss)
	s.hwm = max(s.hwm, hwm)
}

// finish takes a last sample (call it while the process still runs) and
// stops sampling. It returns the peak in bytes: the larger of VmHWM and the
// largest VmRSS sample.
func (s *rssSampler) finish() (peak int64, maxRSS int64) {
	s.sample()
	close(s.stop)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	return max(s.hwm, s.maxRSS) * 1024, s.maxRSS * 1024
}

// readMemStatus returns VmRSS and VmHWM of pid in kB.
func readMemStatus(pid int) (rss, hwm int64, err error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		for _, k := range []struct {
			prefix string
			dst    *int64
		}{{"VmRSS:", &rss}, {"VmHWM:", &hwm}} {
			if rest, ok := strings.CutPrefix(line, k.prefix); ok {
				v, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
				*k.dst = v
			}
		}
	}
	if rss == 0 && hwm == 0 {
		return 0, 0, errors.New("no VmRSS in /proc/PID/status")
	}
	return rss, hwm, sc.Err()
}

// memTotal returns the machine's memory from /proc/meminfo.
func memTotal() string {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
		}
	}
	return "unknown"
}

// cpuModel returns the first model name in /proc/cpuinfo.
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// loadAvg returns the 1, 5 and 15 minute load averages as printed by the
// kernel.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}
