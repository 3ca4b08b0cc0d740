package ledger

import (
	"bufio"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strings"
	"text/template"
)

// Statements are SQL statements by name, read from embedded .sql files
// (docs/architecture.md, "SQL as named statements"). A file holds one or
// more statements, each starting at a line
//
//	-- name: ClaimRuns
//
// and running to the next such line. Comments above a statement's first
// line of SQL belong to it and stay in the text PostgreSQL sees, which is
// harmless; values always travel as parameters ($1, $2, …).
//
// A statement is a text/template: Go renders only what a parameter cannot
// carry — table names, each quoted once by the caller (relay.QualifiedName
// Quoted), and the few switches that choose an index or a column list
// ({{if .PollMode}}). Execution uses missingkey=error, so a name the data
// lacks fails the load, not a query.
type Statements map[string]string

// LoadStatements reads every file of fsys matching pattern and renders each
// statement with data.
func LoadStatements(fsys fs.FS, pattern string, data any) (Statements, error) {
	files, err := fs.Glob(fsys, pattern)
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no SQL files match %s", pattern)
	}
	sort.Strings(files)
	out := Statements{}
	for _, file := range files {
		b, err := fs.ReadFile(fsys, file)
		if err != nil {
			return nil, err
		}
		named, err := splitStatements(path.Base(file), string(b))
		if err != nil {
			return nil, err
		}
		for _, st := range named {
			if _, dup := out[st.name]; dup {
				return nil, fmt.Errorf("%s: statement %s is named twice", file, st.name)
			}
			t, err := template.New(st.name).Option("missingkey=error").Parse(st.text)
			if err != nil {
				return nil, fmt.Errorf("%s: statement %s: %w", file, st.name, err)
			}
			var sb strings.Builder
			if err := t.Execute(&sb, data); err != nil {
				return nil, fmt.Errorf("%s: statement %s: %w", file, st.name, err)
			}
			out[st.name] = strings.TrimSpace(sb.String())
		}
	}
	return out, nil
}

// MustLoadStatements is LoadStatements for the package's own embedded
// files, whose failure is a build defect the tests catch.
func MustLoadStatements(fsys fs.FS, pattern string, data any) Statements {
	s, err := LoadStatements(fsys, pattern, data)
	if err != nil {
		panic(err)
	}
	return s
}

// Get returns the statement named name; an unknown name is a defect of
// the caller, so it panics, naming it.
func (s Statements) Get(name string) string {
	q, ok := s[name]
	if !ok {
		panic(fmt.Sprintf("no SQL statement named %q", name))
	}
	return q
}

type namedStatement struct{ name, text string }

const namePrefix = "-- name:"

func splitStatements(file, text string) ([]namedStatement, error) {
	var (
		out  []namedStatement
		cur  *namedStatement
		body strings.Builder
		line int
	)
	flush := func() {
		if cur != nil {
			cur.text = body.String()
			out = append(out, *cur)
		}
		body.Reset()
	}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line++
		l := sc.Text()
		if rest, ok := strings.CutPrefix(strings.TrimSpace(l), namePrefix); ok {
			flush()
			name := strings.TrimSpace(rest)
			if name == "" || strings.ContainsAny(name, " \t") {
				return nil, fmt.Errorf("%s:%d: a statement name is one word: %q", file, line, l)
			}
			cur = &namedStatement{name: name}
			continue
		}
		if cur == nil {
			if strings.TrimSpace(l) == "" || strings.HasPrefix(strings.TrimSpace(l), "--") {
				continue // the file's own header comment
			}
			return nil, fmt.Errorf("%s:%d: SQL before the first %q line", file, line, namePrefix)
		}
		body.WriteString(l)
		body.WriteByte('\n')
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	flush()
	for _, st := range out {
		if strings.TrimSpace(st.text) == "" {
			return nil, fmt.Errorf("%s: statement %s is empty", file, st.name)
		}
	}
	return out, nil
}
