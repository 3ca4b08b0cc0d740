package harness

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// Relay is a running `outbox-relay run --config FILE` subprocess.
type Relay struct {
	proc    *process
	logPath string
}

// StartRelay starts `bin run --config cfg` with the environment of this
// process plus env, appending its output to logPath.
func StartRelay(bin, cfg, logPath string, env ...string) (*Relay, error) {
	return StartRelayVia(nil, bin, cfg, logPath, env...)
}

// StartRelayVia is StartRelay through a launcher that executes the rest of
// its arguments in its own place (`taskset --cpu-list 1`): the process id
// stays the relay's.
func StartRelayVia(launcher []string, bin, cfg, logPath string, env ...string) (*Relay, error) {
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	argv := append(append(launcher[:len(launcher):len(launcher)], bin), "run", "--config", cfg)
	cmd := exec.Command(argv[0], argv[1:]...)
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stdout, cmd.Stderr = log, log
	p, err := startProcess(cmd)
	if err != nil {
		return nil, fmt.Errorf("start outbox-relay run: %w", err)
	}
	return &Relay{proc: p, logPath: logPath}, nil
}

// Pid is the relay's process id.
func (r *Relay) Pid() int { return r.proc.cmd.Process.Pid }

// LogPath is the file the relay's output is appended to.
func (r *Relay) LogPath() string { return r.logPath }

// Done is closed when the relay has exited.
func (r *Relay) Done() <-chan struct{} { return r.proc.done }

// Exited reports whether the relay has exited.
func (r *Relay) Exited() bool { return r.proc.exited() }

// ExitCode waits for the relay to exit and returns its exit code (-1 when
// it was killed by a signal or could not be waited for).
func (r *Relay) ExitCode() int {
	<-r.proc.done
	var ee *exec.ExitError
	if errors.As(r.proc.err, &ee) {
		return ee.ExitCode()
	}
	if r.proc.err != nil {
		return -1
	}
	return 0
}

// Failure describes an unexpected exit, with the end of the relay's log.
func (r *Relay) Failure() error {
	return fmt.Errorf("outbox-relay run exited (code %d); end of its log %s:\n%s", r.ExitCode(), r.logPath, Tail(r.logPath))
}

// Kill sends SIGKILL (kill -9) and waits for the exit. Safe to repeat.
func (r *Relay) Kill() {
	if r.Exited() {
		return
	}
	_ = r.proc.cmd.Process.Kill()
	<-r.proc.done
}

// Stop sends SIGTERM (the relay's graceful stop) and waits; a relay that
// exits with a code other than 0 is an error, and after timeout it kills the
// relay and returns an error. Stop on an exited relay returns nil.
func (r *Relay) Stop(timeout time.Duration) error {
	if r.Exited() {
		return nil
	}
	if r.proc.signalAndWait(syscall.SIGTERM, timeout) {
		return fmt.Errorf("outbox-relay run did not stop within %s of SIGTERM; killed (log %s)", timeout, r.logPath)
	}
	if c := r.ExitCode(); c != 0 {
		return fmt.Errorf("outbox-relay run exited with code %d after SIGTERM (log %s)", c, r.logPath)
	}
	return nil
}
