// Package harness runs the relay binary against real servers for the
// repository's tools (cmd/outbox-relay-bench, cmd/outbox-relay-chaos): an
// external nats-server process with JetStream that can be killed and started
// again on the same port and store, `outbox-relay run` subprocesses with
// their output in a log file, an HTTP receiver on a loopback port, and the
// small helpers they share (a free port, the end of a log, the relay's
// migrate command, "is the slot streaming?").
//
// PostgreSQL comes from migrations/pgtest. Every process started here gets the
// Linux parent-death signal SIGKILL, so a tool that crashes leaves nothing
// behind.
package harness

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/jackc/pgx/v5"
)

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// tailBytes is how much of a log Tail returns.
const tailBytes = 3000

// Tail returns the last lines (about 3,000 bytes) of a log file, for error
// messages; a file that cannot be read gives the error in parentheses.
func Tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	if len(b) > tailBytes {
		b = b[len(b)-tailBytes:]
	}
	return string(bytes.TrimSpace(b))
}

// Migrate applies the relay's migrations to the database at url with
// `relayBin migrate`. It is safe to repeat (migrate is idempotent).
func Migrate(ctx context.Context, relayBin, url string) error {
	cmd := exec.CommandContext(ctx, relayBin, "migrate", "--database-url", url)
	cmd.Env = append(os.Environ(), "RELAY_LOG_FORMAT=json")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("outbox-relay migrate: %w\n%s", err, bytes.TrimSpace(out))
	}
	return nil
}

// Querier is what SlotStreaming needs: a pgx connection or pool.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// SlotStreaming reports whether a walsender streams from slot. A slot is
// also active while CREATE_REPLICATION_SLOT builds it (and gone if the
// walsender exits then), so this waits for START_REPLICATION: the walsender
// in state catchup or streaming.
func SlotStreaming(ctx context.Context, q Querier, slot string) (bool, error) {
	var active bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots s
		JOIN pg_stat_replication r ON r.pid = s.active_pid
		WHERE s.slot_name = $1 AND r.state IN ('catchup', 'streaming'))`, slot).Scan(&active)
	return active, err
}

// Thousands formats n with comma separators: 1234567 → "1,234,567".
func Thousands(n int) string {
	s := fmt.Sprint(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// RelayVersion asks the relay binary for its version and adds the git
// revision of the working tree ("with local changes" when it has some);
// "unknown" when the binary does not answer.
func RelayVersion(bin string) string {
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		return "unknown"
	}
	v := strings.TrimSpace(string(out))
	if rev, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output(); err == nil {
		v += " at " + strings.TrimSpace(string(rev))
		if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
			v += " (with local changes)"
		}
	}
	return v
}

// RelayBinary resolves the --relay flag of a tool: path (bin/outbox-relay
// when empty) made absolute, and an error telling how to build it when it
// does not exist.
func RelayBinary(path string) (string, error) {
	if path == "" {
		path = filepath.Join("bin", "outbox-relay")
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(abs); err != nil {
		return "", fmt.Errorf("relay binary: %w (run make build, or pass --relay)", err)
	}
	return abs, nil
}
