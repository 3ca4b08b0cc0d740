package ledger_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestRowStateIsReadOneWay counts the places in the relay's code (its Go
// and SQL, tests left out) that answer "is this row delivered, settled?"
// from anything but the outbox row's status (docs/schema.md, "A row's
// states"). The settlement writes the status in the transaction that
// writes the delivered ledger rows, so no reader needs the ledger, nor the
// routing, to tell a row's state: a rendering of the sinks' globs into SQL,
// or a reader that asks the ledger whether every routed sink has a row, is
// a second record of delivery that a new routing rule would have to be
// taught twice.
//
// The ledger is still read pair by pair, where the question is a pair's:
// whether to send an (event, sink) again, what dlq shows and clears per
// sink, how many deliveries a sink had. Those reads are counted per file
// below; a new one is either such a pair read (add it, saying why) or a
// reader re-deriving the row's state (read the status instead).
func TestRowStateIsReadOneWay(t *testing.T) {
	forbidden := []struct {
		re  *regexp.Regexp
		why string
	}{
		{regexp.MustCompile(`(?i)deliveredEverywhere`), "re-derives a row's state from the ledger: read the status"},
		{regexp.MustCompile(`globToRegex|newSinkFilter`), "renders routing into SQL: route in Go (relay.Route.Takes)"},
		{regexp.MustCompile(`every_type|~ s\.re|event_type\s*~`), "routes in SQL: route in Go (relay.Route.Takes)"},
		{regexp.MustCompile(`MarkDeliveredDone|markDoneLoop|PositionWanted`), "a second writer of the status: the settlement writes it"},
	}
	// The reads of a pair's delivered state, per file (a path under the
	// repository root), and why each is a pair's question.
	pairReads := map[string]int{
		// The ledger's own pair statements: the upsert of delivered
		// rows, the stream's and the claim path's (each writes the state
		// and leaves a delivered pair alone).
		"ledger/sql/ledger.sql": 4,
		// The stream's: insert-only delivered rows, an unknown outcome
		// never overwriting a delivery, the re-stream check of which sinks
		// have an event.
		"ledger/sql/stream.sql": 3,
		// dlq --sink: the events not delivered to that sink (the list and
		// its count); retry keeps the pairs delivered.
		"ledger/admin/sql/dlq.sql": 3,
		// status: deliveries per sink in the last hour.
		"ledger/admin/sql/status.sql": 1,
		// verify checks the record itself: each pair of a row against its
		// status (the row's ledger rows as bitmasks, delivered or not) and
		// a sink's copies against their pairs.
		"ledger/admin/sql/verify.sql": 3,
		// The query verify prints for the pairs missing at a sink.
		"ledger/admin/verify_sql.go": 1,
	}
	deliveredTest := regexp.MustCompile(`state\s*(=|<>|!=|IS DISTINCT FROM|IS NOT DISTINCT FROM)\s*'delivered'`)

	root := ".."
	got := map[string]int{}
	for _, dir := range []string{"relay", "ledger", "sink", "migrations", "cmd/outbox-relay", "cmd/internal"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && d.Name() == "testdata" {
				return filepath.SkipDir
			}
			if d.IsDir() || strings.HasSuffix(p, "_test.go") || !(strings.HasSuffix(p, ".go") || strings.HasSuffix(p, ".sql")) {
				return nil
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			rel := filepath.ToSlash(strings.TrimPrefix(p, root+"/"))
			text := string(b)
			for _, f := range forbidden {
				if loc := f.re.FindStringIndex(text); loc != nil {
					t.Errorf("%s:%d: %q %s", rel, 1+strings.Count(text[:loc[0]], "\n"), text[loc[0]:loc[1]], f.why)
				}
			}
			if n := len(deliveredTest.FindAllStringIndex(text, -1)); n > 0 {
				got[rel] = n
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for file, n := range got {
		if n != pairReads[file] {
			t.Errorf("%s tests a ledger pair's delivered state %d times, %d expected: a reader that asks the ledger whether a row is delivered re-derives the row's state (read the status); a pair's own question belongs in this test's list, with why", file, n, pairReads[file])
		}
	}
	for file, n := range pairReads {
		if got[file] == 0 {
			t.Errorf("%s: expected %d pair reads, found none: update the list", file, n)
		}
	}
}
