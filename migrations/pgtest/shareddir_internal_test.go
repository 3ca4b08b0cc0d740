package pgtest

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

// TestSharedDirRemovedByMain: what Main does after the tests removes every
// directory SharedDir made, with its contents.
func TestSharedDirRemovedByMain(t *testing.T) {
	dir, err := SharedDir("pgtest-shared-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "binary"), []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := removeSharedDirs(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("%s after the tests: %v, want it gone", dir, err)
	}
}
