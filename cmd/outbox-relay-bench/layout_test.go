package main

import (
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPlaceDeploy: in the deploy layout every process the benchmark starts
// runs on the CPUs other than the relay's, and a command run through the
// placement (the relay, pg_recvlogical) runs on the relay's CPU alone.
func TestPlaceDeploy(t *testing.T) {
	var before unix.CPUSet
	if err := unix.SchedGetaffinity(0, &before); err != nil {
		t.Fatal(err)
	}
	if before.Count() < 2 {
		t.Fatalf("the deploy layout needs two CPUs; this test process may use %d", before.Count())
	}
	t.Cleanup(func() { restoreAffinity(t, &before) })
	p, err := place(layoutDeploy)
	if err != nil {
		t.Fatal(err)
	}
	if p.relay.Count() != 1 || p.rest.Count() != before.Count()-1 {
		t.Fatalf("relay CPUs %s, rest %s; want one and the %d others", cpuList(p.relay), cpuList(p.rest), before.Count()-1)
	}
	if got := allowedCPUs(t, "cat", "/proc/self/status"); got != cpuList(p.rest) {
		t.Errorf("a process started after the placement may use CPUs %q, want %q", got, cpuList(p.rest))
	}
	if got := allowedCPUs(t, p.command("cat", "/proc/self/status")...); got != p.relayList {
		t.Errorf("a command through the placement may use CPUs %q, want %q", got, p.relayList)
	}
	if s := p.describe(); !regexp.MustCompile(`relay.* on CPU ` + p.relayList).MatchString(s) {
		t.Errorf("describe() = %q, does not say where the relay runs", s)
	}
	shared, err := place(layoutShared)
	if err != nil || len(shared.command("x")) != 1 {
		t.Errorf("shared layout: %v, command %v; want no launcher", err, shared.command("x"))
	}
}

// allowedCPUs runs argv and returns the Cpus_allowed_list it printed from
// /proc/self/status, as cpuList writes it.
func allowedCPUs(t *testing.T, argv ...string) string {
	t.Helper()
	out, err := exec.Command(argv[0], argv[1:]...).Output()
	if err != nil {
		t.Fatalf("%v: %v", argv, err)
	}
	m := regexp.MustCompile(`(?m)^Cpus_allowed_list:\s*(\S+)$`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("%v printed no Cpus_allowed_list", argv)
	}
	var set unix.CPUSet
	for _, part := range regexp.MustCompile(`[,]`).Split(string(m[1]), -1) {
		lo, hi := part, part
		if i := regexp.MustCompile(`-`).FindStringIndex(part); i != nil {
			lo, hi = part[:i[0]], part[i[1]:]
		}
		a, _ := strconv.Atoi(lo)
		b, _ := strconv.Atoi(hi)
		for c := a; c <= b; c++ {
			set.Set(c)
		}
	}
	return cpuList(set)
}

// restoreAffinity gives every thread of this process set again.
func restoreAffinity(t *testing.T, set *unix.CPUSet) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Error(err)
		return
	}
	for _, task := range tasks {
		if tid, err := strconv.Atoi(task.Name()); err == nil {
			_ = unix.SchedSetaffinity(tid, set)
		}
	}
}
