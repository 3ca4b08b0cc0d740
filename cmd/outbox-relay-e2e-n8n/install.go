package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// n8nVersion is the n8n release the test runs: the newest that supports
// Node.js 20 (2.10 and later need Node 22.16 or newer; there is no 2.9).
const n8nVersion = "2.8.4"

// minNode is the oldest Node.js n8n 2.8.4 accepts (engines: >=20.19 <=24.x).
var minNode = [3]int{20, 19, 0}

// installPackageJSON pins n8n and overrides xlsx: n8n's own dependency on it
// points at a tarball outside the npm registry, which the install cannot
// fetch; the @e965/xlsx fork is the same code published on npm.
const installPackageJSON = `{
  "name": "outbox-relay-n8n-e2e",
  "private": true,
  "dependencies": {
    "n8n": "` + n8nVersion + `"
  },
  "overrides": {
    "xlsx": "npm:@e965/xlsx@0.20.2"
  }
}
`

// n8nInstall is an installed n8n.
type n8nInstall struct {
	Dir string // the install directory (holds node_modules)
	Bin string // the n8n command
	// Took is how long the npm install took; zero when the cached install
	// was reused.
	Took time.Duration
}

// ensureN8N returns the n8n installed in dir, installing it from the npm
// registry when dir does not hold a working one: n8n's bin must exist, the
// installed version must be n8nVersion, and the sqlite3 native module must
// load (it is compiled during the install and is what a broken install
// usually lacks). Repeating it on a good install is cheap and changes
// nothing. The install takes 6-8 minutes and about 2.3 GB; npm's output goes
// to dir/npm-install.log.
func ensureN8N(ctx context.Context, dir string, say func(string, ...any)) (*n8nInstall, error) {
	if err := checkNode(ctx); err != nil {
		return nil, err
	}
	inst := &n8nInstall{Dir: dir, Bin: filepath.Join(dir, "node_modules", ".bin", "n8n")}
	if why := inst.problem(ctx); why == "" {
		say("n8n %s: reusing the install in %s", n8nVersion, dir)
		return inst, nil
	} else if _, err := os.Stat(dir); err == nil {
		say("n8n %s in %s is not usable (%s): installing again", n8nVersion, dir, why)
	}

	if _, err := exec.LookPath("npm"); err != nil {
		return nil, fmt.Errorf("npm not found in PATH (install Node.js %d.%d or newer with npm): %w", minNode[0], minNode[1], err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create the n8n install directory: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "package.json"), []byte(installPackageJSON), 0o644); err != nil {
		return nil, fmt.Errorf("write package.json: %w", err)
	}
	logPath := filepath.Join(dir, "npm-install.log")
	log, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("create the install log: %w", err)
	}
	defer log.Close()

	say("installing n8n %s from the npm registry into %s (6-8 minutes: sqlite3 is compiled; log: %s)", n8nVersion, dir, logPath)
	start := time.Now()
	cmd := exec.CommandContext(ctx, "npm", "install", "--prefix", dir, "--omit=dev", "--no-audit", "--no-fund")
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = childSysProcAttr()
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 30 * time.Second
	done := make(chan error, 1)
	go func() { done <- cmd.Run() }()
	tick := time.NewTicker(time.Minute)
	defer tick.Stop()
	for waiting := true; waiting; {
		select {
		case err = <-done:
			waiting = false
		case <-tick.C:
			say("  still installing n8n (%s so far)", time.Since(start).Round(time.Second))
		}
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("n8n install interrupted (the next run resumes it): %w", ctx.Err())
	}
	if err != nil {
		tail, _ := os.ReadFile(logPath)
		return nil, fmt.Errorf("npm install n8n@%s failed: %w (it needs the npm registry, gcc, make and Node.js headers to compile sqlite3); end of %s:\n%s",
			n8nVersion, err, logPath, lastLines(string(tail), 25))
	}
	inst.Took = time.Since(start)
	if why := inst.problem(ctx); why != "" {
		return nil, fmt.Errorf("npm install n8n@%s finished but the install is not usable: %s (see %s)", n8nVersion, why, logPath)
	}
	say("n8n %s installed in %s", n8nVersion, inst.Took.Round(time.Second))
	return inst, nil
}

// problem says what is wrong with the install, or "" when it is usable.
func (i *n8nInstall) problem(ctx context.Context) string {
	if _, err := os.Stat(i.Bin); err != nil {
		return "no n8n command in node_modules/.bin"
	}
	raw, err := os.ReadFile(filepath.Join(i.Dir, "node_modules", "n8n", "package.json"))
	if err != nil {
		return "no node_modules/n8n/package.json"
	}
	var pkg struct {
		Version string `json:"version"`
	}
	if err := json.Unmarshal(raw, &pkg); err != nil || pkg.Version != n8nVersion {
		return fmt.Sprintf("installed version %q, want %s", pkg.Version, n8nVersion)
	}
	sqlite := filepath.Join(i.Dir, "node_modules", "sqlite3")
	out, err := exec.CommandContext(ctx, "node", "-e", "require("+strconv.Quote(sqlite)+")").CombinedOutput()
	if err != nil {
		return fmt.Sprintf("the sqlite3 module does not load: %v: %s", err, lastLines(string(out), 3))
	}
	return ""
}

// checkNode fails unless node is in PATH and at least minNode.
func checkNode(ctx context.Context) error {
	out, err := exec.CommandContext(ctx, "node", "--version").Output()
	if err != nil {
		return fmt.Errorf("node not found or not working (n8n %s needs Node.js %d.%d-24.x): %w", n8nVersion, minNode[0], minNode[1], err)
	}
	v := strings.TrimPrefix(strings.TrimSpace(string(out)), "v")
	var got [3]int
	for i, part := range strings.SplitN(v, ".", 3) {
		got[i], _ = strconv.Atoi(part)
	}
	if got[0] < minNode[0] || (got[0] == minNode[0] && got[1] < minNode[1]) || got[0] > 24 {
		return fmt.Errorf("node v%s: n8n %s needs Node.js %d.%d up to 24.x", v, n8nVersion, minNode[0], minNode[1])
	}
	return nil
}
