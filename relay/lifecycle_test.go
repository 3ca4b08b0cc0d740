package relay_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// daemonDirs are the relay's own packages, relative to this one: their
// goroutines follow the one lifecycle contract. Test tools (relay/netfault,
// relay/sinktest, sink/nats/natstest, cmd/internal/harness) and the other
// binaries are not the daemon.
var daemonDirs = []string{".", "../ledger", "../sink", "../cmd/outbox-relay", "../cmd/internal/config"}

var notDaemon = []string{"netfault", "sinktest", "natstest"}

// TestEveryGoroutineStartsThroughAGroup: outside relay.Group, the daemon's
// code starts no goroutine (a go statement), holds no sync.WaitGroup and
// detaches no context but through relay.Detached (docs/architecture.md,
// "Goroutines and their owners"). A sync.WaitGroup that counts calls, not
// goroutines, is named here with why.
func TestEveryGoroutineStartsThroughAGroup(t *testing.T) {
	allowed := map[string]string{
		"relay/group.go: go":                    "the contract itself",
		"relay/group.go: sync.WaitGroup":        "the contract itself",
		"relay/group.go: context.WithoutCancel": "Detached",
		"sink/nats/nats.go: sync.WaitGroup":     "it counts the Sends past the closed check, which run on their callers' goroutines",
	}
	fix := map[string]string{
		"go":                    "start it through a relay.Group (relay/group.go)",
		"sync.WaitGroup":        "start the goroutines it counts through a relay.Group (relay/group.go)",
		"context.WithoutCancel": "detach through relay.Detached, saying why",
	}
	fset := token.NewFileSet()
	files := 0
	for _, dir := range daemonDirs {
		err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() {
				for _, skip := range notDaemon {
					if d.Name() == skip {
						return filepath.SkipDir
					}
				}
				return nil
			}
			if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return nil
			}
			f, err := parser.ParseFile(fset, path, nil, 0)
			if err != nil {
				return err
			}
			files++
			file := filepath.ToSlash(filepath.Join("relay", path)) // from the repository's root
			report := func(n ast.Node, what string) {
				if _, ok := allowed[file+": "+what]; !ok {
					pos := fset.Position(n.Pos())
					t.Errorf("%s:%d: %s: %s", file, pos.Line, what, fix[what])
				}
			}
			ast.Inspect(f, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.GoStmt:
					report(n, "go")
				case *ast.SelectorExpr:
					if x, ok := n.X.(*ast.Ident); ok {
						switch x.Name + "." + n.Sel.Name {
						case "sync.WaitGroup":
							report(n, "sync.WaitGroup")
						case "context.WithoutCancel":
							report(n, "context.WithoutCancel")
						}
					}
				}
				return true
			})
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if files < 100 {
		t.Fatalf("read %d files of the daemon, expected its packages", files)
	}
}
