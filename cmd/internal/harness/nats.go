package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
)

// NATSServerBinary returns the nats-server binary to run: explicit when it
// is set; else one built with `go build` (the GO environment variable, else
// go) from the nats-server module pinned in go.mod into dir — preferred to
// whatever the machine has installed; else the nats-server in PATH. note
// says why a fallback was taken ("" when it was not).
func NATSServerBinary(ctx context.Context, explicit, dir string) (bin, note string, err error) {
	if explicit != "" {
		return explicit, "", nil
	}
	bin = filepath.Join(dir, "nats-server")
	goCmd := os.Getenv("GO")
	if goCmd == "" {
		goCmd = "go"
	}
	cmd := exec.CommandContext(ctx, goCmd, "build", "-o", bin, "github.com/nats-io/nats-server/v2")
	out, err := cmd.CombinedOutput()
	if err == nil {
		return bin, "", nil
	}
	if p, lerr := exec.LookPath("nats-server"); lerr == nil {
		return p, fmt.Sprintf("could not build nats-server from go.mod (%v: %s); using %s", err, bytes.TrimSpace(out), p), nil
	}
	return "", "", fmt.Errorf("build nats-server: %v: %s (and none in PATH)", err, bytes.TrimSpace(out))
}

// NATSVersion is what `bin --version` prints, or "" when it fails.
func NATSVersion(bin string) string {
	v, err := exec.Command(bin, "--version").Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(v))
}

// NATSServer is a nats-server process with JetStream on a loopback port,
// storing under its directory. It can be killed or stopped and started
// again on the same port and store, as a server restart would. Its methods
// are safe for concurrent use; they are serialized.
type NATSServer struct {
	bin     string
	port    int
	store   string
	logPath string

	mu   sync.Mutex
	proc *process // nil while stopped
}

// process is a started child; the goroutine started with it waits for it
// and closes done.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error // exit error, valid once done is closed
}

func startProcess(cmd *exec.Cmd) (*process, error) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// exited reports whether the process has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// signalAndWait sends sig and waits for the exit; after timeout it sends
// SIGKILL and reports that it had to.
func (p *process) signalAndWait(sig syscall.Signal, timeout time.Duration) (killed bool) {
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
		return false
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.done
		return true
	}
}

// StartNATS starts bin with JetStream on a free loopback port, storing under
// dir/nats-store and appending its output to dir/nats-server.log. It returns
// once the process has started; Connect waits until it accepts connections.
// The caller owns the server and must Stop it.
func StartNATS(bin, dir string) (*NATSServer, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	s := &NATSServer{bin: bin, port: port, store: filepath.Join(dir, "nats-store"), logPath: filepath.Join(dir, "nats-server.log")}
	if err := s.Start(); err != nil {
		return nil, err
	}
	return s, nil
}

// URL is the server's client URL.
func (s *NATSServer) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", s.port) }

// LogPath is the file the server's output is appended to.
func (s *NATSServer) LogPath() string { return s.logPath }

// Pid is the running server's process id, or 0 while it is stopped.
func (s *NATSServer) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return 0
	}
	return s.proc.cmd.Process.Pid
}

// Start starts the server on its port and store. It fails if the server is
// running. A server restarted after Kill finds the JetStream store as the
// killed process left it.
func (s *NATSServer) Start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil && !s.proc.exited() {
		return errors.New("start nats-server: already running")
	}
	log, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(s.bin, "--addr", "127.0.0.1", "--port", strconv.Itoa(s.port), "--jetstream", "--store_dir", s.store)
	cmd.Stdout, cmd.Stderr = log, log
	p, err := startProcess(cmd)
	if err != nil {
		return fmt.Errorf("start nats-server: %w", err)
	}
	s.proc = p
	return nil
}

// Kill sends SIGKILL, as a crash would, and waits for the exit. It does
// nothing on a stopped server.
func (s *NATSServer) Kill() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return nil
	}
	_ = s.proc.cmd.Process.Kill()
	<-s.proc.done
	s.proc = nil
	return nil
}

// Stop sends SIGTERM (nats-server's graceful stop) and waits; after timeout
// it kills the server and returns an error saying so. It does nothing on a
// stopped server.
func (s *NATSServer) Stop(timeout time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return nil
	}
	killed := s.proc.signalAndWait(syscall.SIGTERM, timeout)
	s.proc = nil
	if killed {
		return fmt.Errorf("nats-server did not stop within %s of SIGTERM; killed", timeout)
	}
	return nil
}

// Connect connects to the server, retrying until it accepts connections or
// timeout passes; the error then quotes the end of the server's log.
func (s *NATSServer) Connect(ctx context.Context, timeout time.Duration, opts ...nats.Option) (*nats.Conn, error) {
	deadline := time.Now().Add(timeout)
	for {
		nc, err := nats.Connect(s.URL(), opts...)
		if err == nil {
			return nc, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("nats-server did not accept connections: %w (log: %s)", err, Tail(s.logPath))
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
