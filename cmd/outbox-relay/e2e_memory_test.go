package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestRelay_MemoryBoundedByBytes: the relay binary, with the Go runtime at
// its defaults (GOGC=100, no memory limit) and the default byte budget
// (delivery.max_inflight_bytes: 64MiB), hands 300 rows of 600 KiB over to
// a webhook — 180 MB of payloads, inserted before its slot exists — and its
// peak RSS (VmHWM) stays under 200 MB, the documented bound for the default
// budget (docs/performance.md, "Memory"). Before, one slice of the
// hand-over held every row's payload and the engine took them all.
func TestRelay_MemoryBoundedByBytes(t *testing.T) {
	const (
		rows  = 300
		size  = 600 << 10
		bound = 200 << 20
	)
	s := newSetup(t, pgtest.NewDatabase(t))
	ctx := context.Background()
	if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'order.placed', 'order', (g % 50)::text, 'large-' || g, jsonb_build_object('seq', g, 'pad', repeat('x', $2::int))
		  FROM generate_series(1, $1::int) AS g`, rows, size); err != nil {
		t.Fatal(err)
	}
	var got atomic.Int64
	var seen sync.Map
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		var env struct {
			EventKey string `json:"event_key"`
		}
		if err := json.NewDecoder(req.Body).Decode(&env); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		if _, dup := seen.LoadOrStore(env.EventKey, true); !dup {
			got.Add(1)
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(hook.Close)
	cfg := filepath.Join(s.dir, "relay.yaml")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, `database_url: %q
data_dir: %q
sinks:
  - {name: hook, type: webhook, url: %q}
cpu_scheduling: normal
http: {listen: "127.0.0.1:0"}
log: {level: info, format: json}
`, s.url, filepath.Join(s.dir, "data"), hook.URL), 0o600); err != nil {
		t.Fatal(err)
	}
	bin, err := relayBinary()
	if err != nil {
		t.Fatal(err)
	}
	var log syncBuffer
	cmd := exec.Command(bin, "run", "--config", cfg)
	cmd.Env = append(os.Environ(), "GOGC=100", "GOMEMLIMIT=off")
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	deadline := time.Now().Add(2 * time.Minute)
	for got.Load() < rows {
		select {
		case err := <-exited:
			t.Fatalf("the relay exited (%v) with %d of %d delivered:\n%s", err, got.Load(), rows, log.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d rows delivered after 2 minutes:\n%s", got.Load(), rows, log.String())
		}
	}
	hwm, err := vmHWM(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("peak RSS (VmHWM) %d MiB delivering %d rows of %d KiB through the hand-over", hwm>>20, rows, size>>10)
	if hwm >= bound {
		t.Errorf("peak RSS (VmHWM) %d MiB, want under %d MiB: the bytes in flight are not bounded", hwm>>20, bound>>20)
	}
}

// vmHWM reads the peak resident set size of process pid, in bytes.
func vmHWM(pid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("/proc/%d/status has no VmHWM", pid)
}
