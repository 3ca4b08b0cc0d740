package admin_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// TestStatements checks that every statement the Go code names is in
// sql/*.sql and every statement there is named by the code, so a typo
// fails here rather than as a panic on a path a test may not take.
func TestStatements(t *testing.T) {
	n := hostileNames()
	loaded := admin.StatementsForTest(admin.Tables{Outbox: n.Outbox, Ledger: n.Ledger, Checkpoint: n.Checkpoint})
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	use := regexp.MustCompile(`(?:\.sql|catalogSQL)\("(\w+)"\)|outboxSQL\([^,()]+, "(\w+)"\)`)
	used := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range use.FindAllStringSubmatch(string(b), -1) {
			name := m[1] + m[2]
			used[name] = true
			if _, ok := loaded[name]; !ok {
				t.Errorf("%s names statement %s, which sql/*.sql lacks", f, name)
			}
		}
	}
	for name, text := range loaded {
		if !used[name] {
			t.Errorf("statement %s is not used", name)
		}
		if strings.Contains(text, "<no value>") {
			t.Errorf("statement %s renders a missing value: %s", name, text)
		}
	}
	if !strings.Contains(loaded["StatusCountRows"], n.Outbox.Quoted()) {
		t.Errorf("StatusCountRows does not name the outbox %s: %s", n.Outbox.Quoted(), loaded["StatusCountRows"])
	}
}
