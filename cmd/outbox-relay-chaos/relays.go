package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// Log messages of `outbox-relay run` (JSON logs) that tell a leader from a
// standby.
const (
	msgLeader     = `"message":"leader for the slot"`
	msgLostLeader = `"message":"leadership lost`
	msgFallback   = `"message":"replication unavailable`
)

// relaySlot is one of the HA pair: a supervised `outbox-relay run` that the
// faults kill and restart. An exit the harness did not cause is recorded
// and the relay restarted a second later, as a service manager would.
type relaySlot struct {
	name    string
	bin     string
	cfg     string
	logPath string

	mu         sync.Mutex
	cur        *harness.Relay
	logStart   int64 // size of the log when cur started
	expected   map[int]bool
	stopping   bool
	starts     int
	unexpected []string
	wg         sync.WaitGroup
}

func newRelaySlot(name, bin, cfg, logPath string) *relaySlot {
	return &relaySlot{name: name, bin: bin, cfg: cfg, logPath: logPath, expected: map[int]bool{}}
}

// start starts the relay; it must not be running.
func (r *relaySlot) start() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.startLocked()
}

func (r *relaySlot) startLocked() error {
	if r.stopping {
		return nil
	}
	var size int64
	if st, err := os.Stat(r.logPath); err == nil {
		size = st.Size()
	}
	p, err := harness.StartRelay(r.bin, r.cfg, r.logPath)
	if err != nil {
		return err
	}
	r.cur, r.logStart = p, size
	r.starts++
	r.wg.Add(1)
	go r.watch(p)
	return nil
}

// watch restarts the relay after an exit nobody asked for.
func (r *relaySlot) watch(p *harness.Relay) {
	defer r.wg.Done()
	<-p.Done()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.expected[p.Pid()] || r.stopping {
		return
	}
	r.unexpected = append(r.unexpected, fmt.Sprintf("%s (pid %d) exited with code %d; end of its log:\n%s",
		r.name, p.Pid(), p.ExitCode(), harness.Tail(r.logPath)))
	r.mu.Unlock()
	time.Sleep(time.Second)
	r.mu.Lock()
	if r.cur == p && !r.stopping {
		if err := r.startLocked(); err != nil {
			r.unexpected = append(r.unexpected, fmt.Sprintf("%s: restart failed: %v", r.name, err))
		}
	}
}

// kill sends kill -9 and waits; the exit is expected.
func (r *relaySlot) kill() {
	r.mu.Lock()
	p := r.cur
	if p != nil {
		r.expected[p.Pid()] = true
	}
	r.mu.Unlock()
	if p != nil {
		p.Kill()
	}
}

// terminate stops the relay with SIGTERM, expecting an orderly exit (code
// 0) within timeout; restart starts it again.
func (r *relaySlot) terminate(timeout time.Duration) error {
	r.mu.Lock()
	p := r.cur
	if p != nil {
		r.expected[p.Pid()] = true
	}
	r.mu.Unlock()
	if p == nil {
		return nil
	}
	if err := p.Stop(timeout); err != nil {
		return fmt.Errorf("%s: %w", r.name, err)
	}
	return nil
}

// restart starts the relay again after kill.
func (r *relaySlot) restart() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cur != nil && !r.cur.Exited() {
		return nil
	}
	return r.startLocked()
}

// stop stops the relay with SIGTERM for good; it must exit 0 within
// timeout.
func (r *relaySlot) stop(timeout time.Duration) error {
	r.mu.Lock()
	r.stopping = true
	p := r.cur
	if p != nil {
		r.expected[p.Pid()] = true
	}
	r.mu.Unlock()
	var err error
	if p != nil {
		err = p.Stop(timeout)
	}
	r.wg.Wait()
	if err != nil {
		return fmt.Errorf("%s: %w", r.name, err)
	}
	return nil
}

// leading reports whether the running relay leads the slot: its log since
// it started says it became leader and has not said it lost that since.
func (r *relaySlot) leading() bool {
	r.mu.Lock()
	p, from := r.cur, r.logStart
	r.mu.Unlock()
	if p == nil || p.Exited() {
		return false
	}
	b := r.logSince(from)
	won := bytes.LastIndex(b, []byte(msgLeader))
	return won >= 0 && won > bytes.LastIndex(b, []byte(msgLostLeader))
}

// logSince reads the relay's log from offset.
func (r *relaySlot) logSince(offset int64) []byte {
	f, err := os.Open(r.logPath)
	if err != nil {
		return nil
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil
	}
	b, _ := io.ReadAll(f)
	return b
}

// countInLog counts the lines of the whole log (every start) containing s.
func (r *relaySlot) countInLog(s string) int {
	return strings.Count(string(r.logSince(0)), s)
}

// rss is the resident memory of the running relay process in bytes, 0 when
// none runs or it cannot be read.
func (r *relaySlot) rss() int64 { return r.procStatus("VmRSS:") }

// peakRSS is the running relay process's peak resident memory so far
// (VmHWM) in bytes: it holds the peaks between two samples, which a large
// payload's delivery makes short. 0 when none runs or it cannot be read.
func (r *relaySlot) peakRSS() int64 { return r.procStatus("VmHWM:") }

// procStatus reads a field in kB of the running process's /proc status, in
// bytes.
func (r *relaySlot) procStatus(field string) int64 {
	r.mu.Lock()
	p := r.cur
	r.mu.Unlock()
	if p == nil || p.Exited() {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.Pid()))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, field); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(rest), "%d kB", &kb); err == nil {
				return kb << 10
			}
		}
	}
	return 0
}

// exits returns the unexpected exits so far.
func (r *relaySlot) exits() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.unexpected...)
}
