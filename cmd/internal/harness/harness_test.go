package harness_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

func TestThousands(t *testing.T) {
	for n, want := range map[int]string{0: "0", 999: "999", 1000: "1,000", 1234567: "1,234,567", -4500: "-4,500"} {
		if got := harness.Thousands(n); got != want {
			t.Errorf("Thousands(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestTail(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	if err := os.WriteFile(path, []byte(strings.Repeat("a", 5000)+"the end\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	got := harness.Tail(path)
	if len(got) > 3000 || !strings.HasSuffix(got, "the end") {
		t.Errorf("Tail: %d bytes ending %q", len(got), got[max(len(got)-10, 0):])
	}
	if got := harness.Tail(filepath.Join(t.TempDir(), "missing")); !strings.HasPrefix(got, "(") {
		t.Errorf("Tail of a missing file = %q, want the error in parentheses", got)
	}
}

// fakeRelay writes a script that stands in for the relay binary: it logs
// its arguments and exits with code on SIGTERM. The trap is set before the
// arguments are logged: the tests send SIGTERM as soon as they see that
// line, and a signal before the trap would kill the shell (exit code -1).
func fakeRelay(t *testing.T, code string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fake-relay")
	script := "#!/bin/sh\ntrap 'echo stopping; exit " + code + "' TERM\necho \"args: $*\"\nwhile :; do sleep 0.05; done\n"
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestRelay_StopKillAndExitCodes(t *testing.T) {
	dir := t.TempDir()
	logPath := filepath.Join(dir, "relay.log")

	r, err := harness.StartRelay(fakeRelay(t, "0"), "cfg.yaml", logPath)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return strings.Contains(harness.Tail(logPath), "args: run --config cfg.yaml") })
	if err := r.Stop(10 * time.Second); err != nil {
		t.Fatalf("Stop of a relay that exits 0: %v", err)
	}
	if !r.Exited() || r.ExitCode() != 0 {
		t.Fatalf("exited %v, code %d", r.Exited(), r.ExitCode())
	}

	// A second relay appends to the same log; exit code 3 on SIGTERM is an
	// error that names the log.
	r, err = harness.StartRelay(fakeRelay(t, "3"), "cfg.yaml", logPath)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return strings.Count(harness.Tail(logPath), "args:") == 2 })
	if err := r.Stop(10 * time.Second); err == nil || !strings.Contains(err.Error(), "code 3") || !strings.Contains(err.Error(), logPath) {
		t.Fatalf("Stop: %v, want exit code 3 and the log path", err)
	}

	r, err = harness.StartRelay(fakeRelay(t, "0"), "cfg.yaml", logPath)
	if err != nil {
		t.Fatal(err)
	}
	r.Kill()
	r.Kill() // safe to repeat
	if r.ExitCode() != -1 {
		t.Fatalf("exit code after kill -9: %d, want -1", r.ExitCode())
	}
	if err := r.Failure(); !strings.Contains(err.Error(), "stopping") {
		t.Fatalf("Failure does not quote the log: %v", err)
	}
}

// TestNATSServer_KillAndStartKeepStoreAndPort: a message stored before a
// kill -9 is still in the stream after the server starts again on the same
// port and store, and the stream still drops a repeat of its Msg-Id.
func TestNATSServer_KillAndStartKeepStoreAndPort(t *testing.T) {
	if testing.Short() {
		t.Skip("builds nats-server: skipped with -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := t.TempDir()
	bin, _, err := harness.NATSServerBinary(ctx, "", dir)
	if err != nil {
		// go.mod pins the module, so this only fails without a Go
		// toolchain and a nats-server in PATH: under CI that is a failure.
		if os.Getenv("CI") != "" {
			t.Fatalf("no nats-server under CI: %v", err)
		}
		t.Skipf("no nats-server (under CI this fails): %v", err)
	}
	s, err := harness.StartNATS(bin, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop(10 * time.Second) })
	publish := func(id string) *jetstream.PubAck {
		t.Helper()
		nc, err := s.Connect(ctx, 15*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}, Storage: jetstream.FileStorage}); err != nil {
			t.Fatal(err)
		}
		ack, err := js.Publish(ctx, "t.x", []byte("hello"), jetstream.WithMsgID(id))
		if err != nil {
			t.Fatal(err)
		}
		return ack
	}
	if ack := publish("m1"); ack.Duplicate {
		t.Fatal("first publish acknowledged as a duplicate")
	}
	url, pid := s.URL(), s.Pid()
	if err := s.Kill(); err != nil {
		t.Fatal(err)
	}
	if s.Pid() != 0 {
		t.Fatal("Pid after Kill is not 0")
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err == nil {
		t.Fatal("Start of a running server did not fail")
	}
	if s.URL() != url || s.Pid() == pid || s.Pid() == 0 {
		t.Fatalf("after the restart: url %s (was %s), pid %d (was %d)", s.URL(), url, s.Pid(), pid)
	}
	if ack := publish("m1"); !ack.Duplicate || ack.Sequence != 1 {
		t.Fatalf("after kill -9 and start: %+v, want a duplicate of sequence 1", ack)
	}
	if err := s.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Connect(ctx, 200*time.Millisecond); err == nil || !strings.Contains(err.Error(), "log:") {
		t.Fatalf("Connect to a stopped server: %v, want an error quoting the log", err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
