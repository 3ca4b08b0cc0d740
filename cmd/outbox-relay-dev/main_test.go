package main

import (
	"bytes"
	"context"
	"fmt"
	"github.com/outbox-relay/outbox-relay/migrations"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// syncBuffer is written by the relay subprocess and the receiver at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestMakeRun is what `make run` does on a fresh machine, with --once: a
// private cluster, migrate, the relay with the embedded NATS default and a
// webhook receiver, sample events arriving, and a clean SIGTERM stop.
func TestMakeRun(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "outbox-relay")
	build := exec.Command("go", "build", "-o", bin, "../outbox-relay")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the relay: %v\n%s", err, out)
	}
	t.Setenv("DATABASE_URL", "")
	os.Unsetenv("DATABASE_URL")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out syncBuffer
	if err := run(ctx, bin, true, &out); err != nil {
		t.Fatalf("make run: %v\noutput:\n%s", err, out.String())
	}
	got := out.String()
	for _, want := range []string{fmt.Sprintf("migrated integration_outbox from version 0 to %d", migrations.Latest()), "embedded NATS server",
		"webhook received", "lead.qualified", "all 3 sample events arrived", "relay stopped"} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("output:\n%s", got)
	}
}
