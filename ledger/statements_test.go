package ledger

import (
	"strings"
	"testing"
	"testing/fstest"
)

func TestLoadStatements(t *testing.T) {
	fsys := fstest.MapFS{
		"sql/a.sql": {Data: []byte(`-- The file's header.

-- name: First
-- What it does.
SELECT * FROM {{.Outbox}} WHERE id = $1;

-- name: Second
SELECT 1{{if .PollMode}} -- poll{{end}}
`)},
		"sql/b.sql": {Data: []byte("-- name: Third\nDELETE FROM {{.Outbox}}\n")},
	}
	data := struct {
		Outbox   string
		PollMode bool
	}{`"public"."outbox"`, true}
	s, err := LoadStatements(fsys, "sql/*.sql", data)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.Get("First"); !strings.Contains(got, `FROM "public"."outbox" WHERE id = $1`) || !strings.HasPrefix(got, "-- What it does.") {
		t.Errorf("First = %q", got)
	}
	if got := s.Get("Second"); got != "SELECT 1 -- poll" {
		t.Errorf("Second = %q", got)
	}
	if got := s.Get("Third"); got != `DELETE FROM "public"."outbox"` {
		t.Errorf("Third = %q", got)
	}
	if len(s) != 3 {
		t.Errorf("%d statements, want 3", len(s))
	}
}

func TestLoadStatements_Errors(t *testing.T) {
	for name, tc := range map[string]struct{ file, want string }{
		"sql before a name": {"SELECT 1\n", "SQL before the first"},
		"empty statement":   {"-- name: A\n\n-- name: B\nSELECT 1\n", "statement A is empty"},
		"named twice":       {"-- name: A\nSELECT 1\n-- name: A\nSELECT 2\n", "named twice"},
		"missing key":       {"-- name: A\nSELECT * FROM {{.Nope}}\n", "Nope"},
		"two-word name":     {"-- name: A B\nSELECT 1\n", "one word"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := LoadStatements(fstest.MapFS{"x.sql": {Data: []byte(tc.file)}}, "*.sql", map[string]string{"Outbox": "o"})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to name %q", err, tc.want)
			}
		})
	}
	if _, err := LoadStatements(fstest.MapFS{}, "*.sql", nil); err == nil {
		t.Fatal("no files: want an error")
	}
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "Missing") {
			t.Fatalf("Get of an unknown name: recover() = %v", r)
		}
	}()
	Statements{}.Get("Missing")
}
