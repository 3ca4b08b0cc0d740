package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Layouts: where the benchmark's processes run (docs/performance.md, "How
// it is measured").
//
//   - deploy (the default): the relay on a CPU of its own, as in a
//     deployment where it runs on its own host or container; PostgreSQL
//     (postmaster, walsenders, backends), the load, nats-server and the
//     webhook receiver on the others. The clients the relay is compared
//     with — pg_recvlogical for the ceiling and the bare pglogrepl client
//     for the floor — run on the relay's CPU, so that each ratio compares
//     two clients placed alike.
//   - shared: no placement; every process may run on every CPU.
const (
	layoutDeploy = "deploy"
	layoutShared = "shared"
)

// placement is the CPU sets of a layout; empty sets mean no placement.
type placement struct {
	layout string
	relay  unix.CPUSet // the relay and the clients compared with it
	rest   unix.CPUSet // PostgreSQL, the load, the sinks, this process
	// relayList is relay as taskset's --cpu-list.
	relayList string
}

// place returns the placement of layout on this machine and, for deploy,
// moves every thread of this process (and so every process it starts
// from now on) to the rest set. The relay takes the last CPU this process
// may use.
func place(layout string) (placement, error) {
	p := placement{layout: layout}
	if layout == layoutShared {
		return p, nil
	}
	var all unix.CPUSet
	if err := unix.SchedGetaffinity(0, &all); err != nil {
		return p, fmt.Errorf("layout %s: read the CPUs this process may use: %w", layout, err)
	}
	var cpus []int
	for i := 0; i < 1024; i++ {
		if all.IsSet(i) {
			cpus = append(cpus, i)
		}
	}
	if len(cpus) < 2 {
		return p, fmt.Errorf("layout %s needs two CPUs, this process may use %d (use -layout shared)", layout, len(cpus))
	}
	last := cpus[len(cpus)-1]
	p.relay.Set(last)
	p.relayList = strconv.Itoa(last)
	for _, c := range cpus[:len(cpus)-1] {
		p.rest.Set(c)
	}
	// A thread created later inherits the affinity of the thread that
	// creates it, and a child process that of the thread that forks it:
	// setting every thread now places everything this process starts.
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return p, fmt.Errorf("layout %s: %w", layout, err)
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if err := unix.SchedSetaffinity(tid, &p.rest); err != nil {
			return p, fmt.Errorf("layout %s: place thread %d: %w", layout, tid, err)
		}
	}
	return p, nil
}

// command returns argv run on the relay's CPU (through taskset, which
// sets the affinity before it executes argv, so every thread of the
// program has it), or argv unchanged without a placement.
func (p placement) command(argv ...string) []string {
	if p.relayList == "" {
		return argv
	}
	return append([]string{"taskset", "--cpu-list", p.relayList}, argv...)
}

// pinCurrentThread runs the calling goroutine's thread on the relay's CPU
// until the goroutine ends (it stays locked to the thread, which exits
// with it). For a client that runs inside this process.
func (p placement) pinCurrentThread() error {
	if p.relayList == "" {
		return nil
	}
	runtime.LockOSThread()
	return unix.SchedSetaffinity(0, &p.relay)
}

// describe says where each process runs, for the report.
func (p placement) describe() string {
	if p.relayList == "" {
		return "shared: no placement, every process on every CPU"
	}
	return fmt.Sprintf("deploy: the relay, pg_recvlogical and the bare pglogrepl client on CPU %s; PostgreSQL, the load, nats-server and the receiver on CPU %s",
		p.relayList, cpuList(p.rest))
}

func cpuList(s unix.CPUSet) string {
	var out []string
	for i := 0; i < 1024; i++ {
		if s.IsSet(i) {
			out = append(out, strconv.Itoa(i))
		}
	}
	return strings.Join(out, ",")
}
