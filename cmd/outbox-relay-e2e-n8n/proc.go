package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// logBuffer keeps everything a child process writes, in memory for the
// checks that look for a log line and in a file for people. It is safe for
// concurrent use.
type logBuffer struct {
	mu   sync.Mutex
	file io.Writer
	data []byte
}

// newLogBuffer appends to the file at path, creating it.
func newLogBuffer(path string) (*logBuffer, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open log: %w", err)
	}
	return &logBuffer{file: f}, nil
}

// Write keeps p and appends it to the file. Errors writing the file are
// ignored, so a full disk cannot stall the child process.
func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.data = append(l.data, p...)
	_, _ = l.file.Write(p)
	return len(p), nil
}

// Len returns the number of bytes written so far: an offset for Since.
func (l *logBuffer) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.data)
}

// Since returns what was written after offset off.
func (l *logBuffer) Since(off int) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if off > len(l.data) {
		off = len(l.data)
	}
	return string(l.data[off:])
}

// LinesSince returns the lines written after offset off that contain every
// one of the substrings.
func (l *logBuffer) LinesSince(off int, substrings ...string) []string {
	var out []string
	for line := range strings.Lines(l.Since(off)) {
		match := true
		for _, s := range substrings {
			if !strings.Contains(line, s) {
				match = false
				break
			}
		}
		if match {
			out = append(out, strings.TrimRight(line, "\n"))
		}
	}
	return out
}

// Tail returns about the last n lines, for error messages.
func (l *logBuffer) Tail(n int) string {
	lines := strings.Split(strings.TrimRight(l.Since(0), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// proc is a long-running child process (n8n, the relay) in its own process
// group, so a Ctrl-C in the terminal reaches only this tool, which then stops
// its children in order. The kernel sends the child stopSignal if this tool
// dies without stopping it.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  *logBuffer
	done chan struct{} // closed when the process has exited
	err  error         // its exit error, valid once done is closed
}

// startProc starts cmd with its output going to log. The caller must call
// stop, also on failure paths.
func startProc(name string, cmd *exec.Cmd, log *logBuffer) (*proc, error) {
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = childSysProcAttr()
	// A grandchild that keeps the output pipe open must not block Wait.
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: log, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Pid returns the process id.
func (p *proc) Pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has exited, and how.
func (p *proc) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// stop sends SIGTERM to the process and waits up to timeout for it to exit;
// then it kills the process group. Children the process left behind in its
// group get SIGKILL too. stop is safe to call again and on a process that
// has exited; it returns how long the stop took.
func (p *proc) stop(timeout time.Duration) (time.Duration, error) {
	start := time.Now()
	pid := p.Pid()
	if done, _ := p.exited(); !done {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(timeout):
			_ = syscall.Kill(-pid, syscall.SIGKILL)
			<-p.done
			return time.Since(start), fmt.Errorf("%s (pid %d) did not exit within %s of SIGTERM; killed its process group", p.name, pid, timeout)
		}
	}
	// The group is ours: anything still in it was started by the process.
	if err := syscall.Kill(-pid, 0); err == nil || !errors.Is(err, syscall.ESRCH) {
		_ = syscall.Kill(-pid, syscall.SIGKILL)
	}
	return time.Since(start), nil
}

// runLogged runs a short command to completion, returning its combined
// output. Cancelling ctx sends SIGTERM. A non-zero exit is an error that
// quotes the end of the output.
func runLogged(ctx context.Context, name string, cmd *exec.Cmd) (string, error) {
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = childSysProcAttr()
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	err := cmd.Run()
	if ctx.Err() != nil {
		return out.String(), ctx.Err()
	}
	if err != nil {
		return out.String(), fmt.Errorf("%s: %w\n%s", name, err, lastLines(out.String(), 20))
	}
	return out.String(), nil
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
