package main

// The manual's checks: the README and docs/ say only what is true of this
// build. Each test reads the Markdown files of the repository and fails
// with the file and line of what no longer holds.

import (
	"bufio"
	"context"
	"fmt"
	goast "go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/yuin/goldmark"
	"github.com/yuin/goldmark/ast"
	"github.com/yuin/goldmark/extension"
	"github.com/yuin/goldmark/text"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/relay"
)

// repoRoot is the repository root relative to this package's directory.
const repoRoot = "../.."

// markdownFiles returns the manual's files, relative to the root: the
// README, docs/*.md and every Markdown file under deploy/.
func markdownFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md"}
	docs, err := filepath.Glob(filepath.Join(repoRoot, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		files = append(files, filepath.ToSlash(strings.TrimPrefix(d, repoRoot+"/")))
	}
	err = filepath.WalkDir(filepath.Join(repoRoot, "deploy"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			files = append(files, filepath.ToSlash(strings.TrimPrefix(p, repoRoot+"/")))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// mdDoc is a parsed Markdown file.
type mdDoc struct {
	path string // relative to the root
	src  []byte
	root ast.Node
}

var markdown = goldmark.New(goldmark.WithExtensions(extension.GFM))

func readDoc(t *testing.T, path string) *mdDoc {
	t.Helper()
	src, err := os.ReadFile(filepath.Join(repoRoot, path))
	if err != nil {
		t.Fatal(err)
	}
	return &mdDoc{path: path, src: src, root: markdown.Parser().Parse(text.NewReader(src))}
}

// line returns the line of byte offset off.
func (d *mdDoc) line(off int) int {
	return 1 + strings.Count(string(d.src[:min(off, len(d.src))]), "\n")
}

// lineOf returns the line of n: its own first line, or its nearest block
// ancestor's (inline nodes have no position of their own).
func (d *mdDoc) lineOf(n ast.Node) int {
	for ; n != nil; n = n.Parent() {
		if n.Type() == ast.TypeBlock && n.Lines().Len() > 0 {
			return d.line(n.Lines().At(0).Start)
		}
		if t, ok := n.(*ast.Text); ok {
			return d.line(t.Segment.Start)
		}
	}
	return 0
}

// plainText is the text a heading shows: text, code spans and link texts,
// without the Markdown around them.
func plainText(n ast.Node, src []byte) string {
	var b strings.Builder
	for c := n.FirstChild(); c != nil; c = c.NextSibling() {
		switch c := c.(type) {
		case *ast.Text:
			b.Write(c.Segment.Value(src))
			if c.SoftLineBreak() {
				b.WriteByte(' ')
			}
		case *ast.String:
			b.Write(c.Value)
		default:
			b.WriteString(plainText(c, src))
		}
	}
	return b.String()
}

// slug is GitHub's anchor for a heading: lower case, every character that
// is not a letter, a digit, '-', '_' or a space dropped, spaces to '-'.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.Is(unicode.Mn, r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

var htmlAnchor = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)

// headings returns the heading texts of d.
func (d *mdDoc) headings() []string {
	var out []string
	_ = ast.Walk(d.root, func(n ast.Node, entering bool) (ast.WalkStatus, error) {
		if h, ok := n.(*ast.Heading); ok && entering {
			out = append(out, plainText(h, d.src))
			return ast.WalkSkipChildren, nil
		}
		return ast.WalkContinue, nil
	})
	return out
}

// anchors returns the anchors d defines: its headings' slugs (a repeated
// one gets -1, -2, …, as on GitHub) and explicit <a id> / <a name>.
func (d *mdDoc) anchors() map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, h := range d.headings() {
		s := slug(h)
		if n := seen[s]; n > 0 {
			out[fmt.Sprintf("%s-%d", s, n)] = true
		} else {
			out[s] = true
		}
		seen[s]++
	}
	for _, m := range htmlAnchor.FindAllSubmatch(d.src, -1) {
		out[string(m[1])] = true
	}
	return out
}

func TestSlug(t *testing.T) {
	tests := map[string]string{
		"What the relay writes back":                          "what-the-relay-writes-back",
		"Fault injection: `make chaos`":                       "fault-injection-make-chaos",
		"2. At most one delivery recorded per event and sink": "2-at-most-one-delivery-recorded-per-event-and-sink",
		"`outbox-relay replay --since TIME`":                  "outbox-relay-replay---since-time",
		"NULL status and NULL available_at":                   "null-status-and-null-available_at",
		"Dead letters: dlq list | retry | discard":            "dead-letters-dlq-list--retry--discard",
	}
	for in, want := range tests {
		if got := slug(in); got != want {
			t.Errorf("slug(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestDocs_Links resolves every relative link of the manual: the file or
// directory exists, and an #anchor names a heading (GitHub's slug) or an
// <a id> of the target.
func TestDocs_Links(t *testing.T) {
	docs := map[string]*mdDoc{}
	load := func(p string) *mdDoc {
		if d, ok := docs[p]; ok {
			return d
		}
		docs[p] = readDoc(t, p)
		return docs[p]
	}
	for _, p := range markdownFiles(t) {
		d := load(p)
		_ = ast.Walk(d.root, func(n ast.Node, entering bool) (ast.WalkStatus, error) {
			if !entering {
				return ast.WalkContinue, nil
			}
			var dest string
			switch n := n.(type) {
			case *ast.Link:
				dest = string(n.Destination)
			case *ast.Image:
				dest = string(n.Destination)
			default:
				return ast.WalkContinue, nil
			}
			where := fmt.Sprintf("%s:%d: link %q", p, d.lineOf(n), dest)
			u, err := url.Parse(dest)
			if err != nil {
				t.Errorf("%s: %v", where, err)
				return ast.WalkContinue, nil
			}
			if u.Scheme != "" || u.Host != "" {
				return ast.WalkContinue, nil // not ours to check
			}
			target := p
			if u.Path != "" {
				target = filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(p), u.Path)))
				if strings.HasPrefix(target, "../") {
					t.Errorf("%s: leaves the repository", where)
					return ast.WalkContinue, nil
				}
				if _, err := os.Stat(filepath.Join(repoRoot, target)); err != nil {
					t.Errorf("%s: %s does not exist", where, target)
					return ast.WalkContinue, nil
				}
			}
			if u.Fragment != "" {
				if !strings.HasSuffix(target, ".md") {
					t.Errorf("%s: an anchor into %s, which is not Markdown", where, target)
				} else if !load(target).anchors()[u.Fragment] {
					t.Errorf("%s: %s has no heading with the anchor #%s", where, target, u.Fragment)
				}
			}
			return ast.WalkContinue, nil
		})
	}
}

// keyRow is one row of a key table in docs/configuration.md.
type keyRow struct {
	line                   int
	key, sinkFor, typ, def string
}

// splitRow splits a Markdown table row into its cells; "\|" is a literal |.
func splitRow(line string) []string {
	line = strings.TrimSpace(line)
	line = strings.TrimPrefix(strings.TrimSuffix(line, "|"), "|")
	var cells []string
	var b strings.Builder
	for i := 0; i < len(line); i++ {
		switch {
		case line[i] == '\\' && i+1 < len(line) && line[i+1] == '|':
			b.WriteByte('|')
			i++
		case line[i] == '|':
			cells = append(cells, strings.TrimSpace(b.String()))
			b.Reset()
		default:
			b.WriteByte(line[i])
		}
	}
	return append(cells, strings.TrimSpace(b.String()))
}

// configurationKeys reads the key tables of docs/configuration.md: tables
// whose header starts with "key", with the columns type and default (and
// for, in the sinks table).
func configurationKeys(t *testing.T) []keyRow {
	t.Helper()
	f, err := os.Open(filepath.Join(repoRoot, "docs", "configuration.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []keyRow
	var cols map[string]int
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if !strings.HasPrefix(line, "|") {
			cols = nil
			continue
		}
		cells := splitRow(line)
		switch {
		case cols == nil && len(cells) > 0 && cells[0] == "key":
			cols = map[string]int{}
			for i, c := range cells {
				cols[c] = i
			}
			if _, ok := cols["type"]; !ok {
				t.Fatalf("docs/configuration.md:%d: a key table without a type column", n)
			}
			if _, ok := cols["default"]; !ok {
				t.Fatalf("docs/configuration.md:%d: a key table without a default column", n)
			}
		case cols == nil || strings.HasPrefix(cells[0], "---"):
		default:
			if len(cells) < len(cols) {
				t.Errorf("docs/configuration.md:%d: %d cells, want %d", n, len(cells), len(cols))
				continue
			}
			r := keyRow{line: n, key: strings.Trim(cells[0], "`"), typ: cells[cols["type"]], def: cells[cols["default"]]}
			if i, ok := cols["for"]; ok {
				r.sinkFor = cells[i]
			}
			rows = append(rows, r)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return rows
}

// TestDocs_ConfigurationReference holds docs/configuration.md to the
// loader: every key Load accepts is documented once, with its type, its
// default and (for sinks) the sink type it is for, and the page documents
// no other key.
func TestDocs_ConfigurationReference(t *testing.T) {
	rows := configurationKeys(t)
	if len(rows) == 0 {
		t.Fatal("docs/configuration.md: no key tables found")
	}
	documented := map[string]keyRow{}
	for _, r := range rows {
		if prev, ok := documented[r.key]; ok {
			t.Errorf("docs/configuration.md:%d: %s is documented twice (also line %d)", r.line, r.key, prev.line)
		}
		documented[r.key] = r
	}
	for _, k := range config.Keys() {
		r, ok := documented[k.Path]
		if !ok {
			t.Errorf("docs/configuration.md: key %s (%s, default %q) is not documented", k.Path, k.Type, k.Default)
			continue
		}
		delete(documented, k.Path)
		where := fmt.Sprintf("docs/configuration.md:%d: %s", r.line, k.Path)
		if r.typ != k.Type {
			t.Errorf("%s: type %q, the loader says %q", where, r.typ, k.Type)
		}
		if k.Default == "" {
			if !strings.HasPrefix(r.def, "—") {
				t.Errorf("%s: default %q, want — (no default)", where, r.def)
			}
		} else if r.def != "`"+k.Default+"`" {
			t.Errorf("%s: default %s, the loader says `%s`", where, r.def, k.Default)
		}
		if strings.HasPrefix(k.Path, "sinks[].") {
			want := string(k.Sink)
			if want == "" {
				want = "every sink"
			}
			if r.sinkFor != want {
				t.Errorf("%s: for %q, the loader says %q", where, r.sinkFor, want)
			}
		}
	}
	for key, r := range documented {
		t.Errorf("docs/configuration.md:%d: %s is documented, but the loader accepts no such key", r.line, key)
	}
}

// commandLine is one `outbox-relay …` line of a fenced code block.
type commandLine struct {
	where string
	args  []string
}

// shellWords splits a command line as sh would for the simple lines the
// manual shows: quotes, backslash escapes, a comment, and the end of the
// command at an unquoted |, ;, &, < or >.
func shellWords(line string) ([]string, error) {
	var words []string
	var b strings.Builder
	inWord := false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case c == '\'':
			j := strings.IndexByte(line[i+1:], '\'')
			if j < 0 {
				return nil, fmt.Errorf("unterminated ' in %q", line)
			}
			b.WriteString(line[i+1 : i+1+j])
			i += j + 1
			inWord = true
		case c == '"':
			i++
			for ; i < len(line) && line[i] != '"'; i++ {
				if line[i] == '\\' && i+1 < len(line) && strings.IndexByte(`"\$`+"`", line[i+1]) >= 0 {
					i++
				}
				b.WriteByte(line[i])
			}
			if i >= len(line) {
				return nil, fmt.Errorf("unterminated \" in %q", line)
			}
			inWord = true
		case c == '\\' && i+1 < len(line):
			i++
			b.WriteByte(line[i])
			inWord = true
		case c == ' ' || c == '\t':
			if inWord {
				words = append(words, b.String())
				b.Reset()
				inWord = false
			}
		case c == '#' && !inWord:
			return words, nil
		case strings.IndexByte("|;&<>", c) >= 0:
			if inWord {
				words = append(words, b.String())
			}
			return words, nil
		default:
			b.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, b.String())
	}
	return words, nil
}

// commandLines returns every line of a fenced code block in d that runs
// outbox-relay ("outbox-relay …" or "$ outbox-relay …"), with its
// continuation lines.
func commandLines(t *testing.T, d *mdDoc) []commandLine {
	var out []commandLine
	_ = ast.Walk(d.root, func(n ast.Node, entering bool) (ast.WalkStatus, error) {
		fb, ok := n.(*ast.FencedCodeBlock)
		if !entering || !ok {
			return ast.WalkContinue, nil
		}
		lines := fb.Lines()
		for i := 0; i < lines.Len(); i++ {
			seg := lines.At(i)
			start := d.line(seg.Start)
			line := strings.TrimRight(string(seg.Value(d.src)), "\n")
			for strings.HasSuffix(line, `\`) && i+1 < lines.Len() {
				i++
				next := lines.At(i)
				line = strings.TrimSuffix(line, `\`) + " " + strings.TrimRight(string(next.Value(d.src)), "\n")
			}
			line = strings.TrimPrefix(strings.TrimSpace(line), "$ ")
			if !strings.HasPrefix(line, "outbox-relay ") && line != "outbox-relay" {
				continue
			}
			where := fmt.Sprintf("%s:%d: %s", d.path, start, line)
			words, err := shellWords(line)
			if err != nil {
				t.Errorf("%s: %v", where, err)
				continue
			}
			out = append(out, commandLine{where: where, args: words[1:]})
		}
		return ast.WalkSkipChildren, nil
	})
	return out
}

// parseCommandLine parses args with the real command tree, without running
// anything: the command exists, its flags exist and their values parse,
// and its positional arguments are valid.
func parseCommandLine(args []string) error {
	root := newRootCommand(io.Discard, io.Discard)
	cmd, rest, err := root.Find(args)
	if err != nil {
		return err
	}
	if err := cmd.ParseFlags(rest); err != nil {
		return fmt.Errorf("%s: %w", cmd.CommandPath(), err)
	}
	positional := cmd.Flags().Args()
	if cmd.HasSubCommands() && len(positional) > 0 {
		return fmt.Errorf("%s has no subcommand %q", cmd.CommandPath(), positional[0])
	}
	if err := cmd.ValidateArgs(positional); err != nil {
		return fmt.Errorf("%s: %w", cmd.CommandPath(), err)
	}
	if err := cmd.ValidateRequiredFlags(); err != nil {
		return fmt.Errorf("%s: %w", cmd.CommandPath(), err)
	}
	return cmd.ValidateFlagGroups()
}

func TestParseCommandLine(t *testing.T) {
	for _, ok := range [][]string{{"status", "--json"}, {"dlq", "retry", "--ids", "1,2", "--yes"}, {"reconcile", "--older-than", "10m"}, {"--config", "r.yaml", "run"}} {
		if err := parseCommandLine(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range [][]string{{"stauts"}, {"dlq", "lst"}, {"status", "--jsn"}, {"reconcile", "--older-than", "D"}, {"run", "extra"}} {
		if err := parseCommandLine(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
	words, err := shellWords(`outbox-relay migrate --database-url 'postgres://owner@db/app' # as the owner`)
	if err != nil || !slices.Equal(words, []string{"outbox-relay", "migrate", "--database-url", "postgres://owner@db/app"}) {
		t.Errorf("shellWords: %q, %v", words, err)
	}
}

// TestDocs_CommandLines parses every outbox-relay command line shown in a
// fenced code block of the manual with the real command tree.
func TestDocs_CommandLines(t *testing.T) {
	n := 0
	for _, p := range markdownFiles(t) {
		for _, c := range commandLines(t, readDoc(t, p)) {
			n++
			if err := parseCommandLine(c.args); err != nil {
				t.Errorf("%s: %v", c.where, err)
			}
		}
	}
	if n == 0 {
		t.Error("no outbox-relay command line found in the manual")
	}
	t.Logf("%d outbox-relay command lines parsed", n)
}

// goFiles returns the repository's Go files, its embedded SQL files and its
// Makefile (whose comments cite docs pages too), relative to the root.
func goFiles(t *testing.T) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(repoRoot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".") && p != repoRoot) {
			return filepath.SkipDir
		}
		if strings.HasSuffix(p, ".go") || strings.HasSuffix(p, ".sql") || p == filepath.Join(repoRoot, "Makefile") {
			out = append(out, filepath.ToSlash(strings.TrimPrefix(p, repoRoot+"/")))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

var (
	// commentBreak is where a comment (Go's // or SQL's --) continues on
	// the next line.
	commentBreak = regexp.MustCompile(`\n[ \t]*(?://|--)[ \t]?`)
	// docsCitation is "docs/<page>.md", optionally followed by
	// `, "section"` (a heading's text, or part of it); both may wrap to
	// the comment's next line.
	docsCitation = regexp.MustCompile(`docs/([a-z0-9-]+\.md)(?:,(?:[ \t]|\n[ \t]*(?://|--))*"((?:[^"\n]|\n[ \t]*(?://|--)[ \t]?)+)")?`)
)

// TestDocs_CodeCitations: every docs page the code cites exists, and a
// cited section is part of one of its headings; no code cites the
// contract by section number ("SPEC" and the section sign).
func TestDocs_CodeCitations(t *testing.T) {
	headings := map[string][]string{}
	for _, p := range goFiles(t) {
		b, err := os.ReadFile(filepath.Join(repoRoot, p))
		if err != nil {
			t.Fatal(err)
		}
		src := string(b)
		if i := strings.Index(src, "SPEC \u00a7"); i >= 0 {
			t.Errorf("%s:%d: cites SPEC \u00a7; cite the docs page that states it", p, 1+strings.Count(src[:i], "\n"))
		}
		for _, m := range docsCitation.FindAllStringSubmatchIndex(src, -1) {
			page := src[m[2]:m[3]]
			line := 1 + strings.Count(src[:m[0]], "\n")
			where := fmt.Sprintf("%s:%d: docs/%s", p, line, page)
			hs, ok := headings[page]
			if !ok {
				if _, err := os.Stat(filepath.Join(repoRoot, "docs", page)); err != nil {
					t.Errorf("%s: no such page", where)
					headings[page] = nil
					continue
				}
				hs = readDoc(t, "docs/"+page).headings()
				headings[page] = hs
			}
			if m[4] < 0 || hs == nil {
				continue
			}
			section := commentBreak.ReplaceAllString(src[m[4]:m[5]], " ")
			if !slices.ContainsFunc(hs, func(h string) bool { return strings.Contains(strings.ToLower(h), strings.ToLower(section)) }) {
				t.Errorf("%s: no heading of docs/%s contains %q", where, page, section)
			}
		}
	}
}

// testName is a test or fuzz function named in the manual; a trailing *
// names every test with that prefix.
var testName = regexp.MustCompile(`\b((?:Test|Fuzz)[A-Z][A-Za-z0-9_]*)(\*?)`)

// TestDocs_TestNames: every test and fuzz target the manual cites as
// evidence exists.
func TestDocs_TestNames(t *testing.T) {
	funcs := map[string]bool{}
	decl := regexp.MustCompile(`(?m)^func ((?:Test|Fuzz)\w+)\(`)
	for _, p := range goFiles(t) {
		if !strings.HasSuffix(p, "_test.go") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(repoRoot, p))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range decl.FindAllSubmatch(b, -1) {
			funcs[string(m[1])] = true
		}
	}
	for _, p := range markdownFiles(t) {
		d := readDoc(t, p)
		for _, m := range testName.FindAllSubmatchIndex(d.src, -1) {
			name, prefix := string(d.src[m[2]:m[3]]), m[5] > m[4]
			found := funcs[name]
			if prefix {
				for f := range funcs {
					found = found || strings.HasPrefix(f, name)
				}
			}
			if !found {
				t.Errorf("%s:%d: %s names no test of the repository", p, d.line(m[0]), name)
			}
		}
	}
}

// TestDocs_AlertsListed: every alert rule in deploy/prometheus/alerts.yml
// has its row in docs/operations.md's alert table.
func TestDocs_AlertsListed(t *testing.T) {
	rules, err := os.ReadFile(filepath.Join(repoRoot, "deploy/prometheus/alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile(filepath.Join(repoRoot, "docs/operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	names := regexp.MustCompile(`(?m)^\s*- alert:\s*(\S+)`).FindAllSubmatch(rules, -1)
	if len(names) == 0 {
		t.Fatal("no alert rules found in deploy/prometheus/alerts.yml")
	}
	for _, m := range names {
		name := string(m[1])
		// A row may name a pair as "`OutboxRelayRetainedWALHigh`, `…Critical`".
		short := "…" + strings.TrimPrefix(name, "OutboxRelayRetainedWAL")
		if !strings.Contains(string(page), "`"+name+"`") && !strings.Contains(string(page), "`"+short+"`") {
			t.Errorf("alert %s has no row in docs/operations.md's alert table", name)
		}
	}
}

// exportedMetrics returns the names of the metrics the relay registers:
// every Namespace "outbox_relay" collector in the code the relay binary is
// built from (relay/, ledger/, sink/, cmd/outbox-relay), by its source.
// The names are checked against the default registry too, so that a metric
// declared some other way fails this test rather than hiding from it.
func exportedMetrics(t *testing.T) map[string]string {
	t.Helper()
	decl := regexp.MustCompile(`Namespace:\s*"outbox_relay",\s*Name:\s*"(\w+)"`)
	out := map[string]string{}
	for _, p := range goFiles(t) {
		if strings.HasSuffix(p, "_test.go") || !strings.HasSuffix(p, ".go") ||
			!(strings.HasPrefix(p, "relay/") || strings.HasPrefix(p, "ledger/") || strings.HasPrefix(p, "sink/") || strings.HasPrefix(p, "cmd/outbox-relay/")) {
			continue
		}
		b, err := os.ReadFile(filepath.Join(repoRoot, p))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range decl.FindAllSubmatch(b, -1) {
			out["outbox_relay_"+string(m[1])] = p
		}
	}
	if len(out) == 0 {
		t.Fatal("no outbox_relay metric found in the code")
	}
	// Series exist for every per-sink label once a route is known.
	relay.InitMetrics([]relay.Route{{Sink: docsSink{}}})
	fams, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if name := f.GetName(); strings.HasPrefix(name, "outbox_relay_") && out[name] == "" {
			t.Errorf("metric %s is registered, but not as Namespace: \"outbox_relay\", Name: \"…\" where this test looks", name)
		}
	}
	return out
}

// docsSink is a sink for InitMetrics: it is never sent to.
type docsSink struct{}

func (docsSink) Name() string                                       { return "docs" }
func (docsSink) Send(context.Context, *relay.Delivery, func(error)) {}
func (docsSink) Close(context.Context) error                        { return nil }

// TestDocs_MetricsListed: every metric the relay exports has its row in
// docs/operations.md's metric table, and every row names one it exports.
func TestDocs_MetricsListed(t *testing.T) {
	exported := exportedMetrics(t)
	page := readDoc(t, "docs/operations.md")
	rows := map[string]int{}
	for i, line := range strings.Split(string(page.src), "\n") {
		if !strings.HasPrefix(line, "| `outbox_relay_") {
			continue
		}
		rows[strings.Trim(splitRow(line)[0], "`")] = i + 1
	}
	for name, file := range exported {
		if _, ok := rows[name]; !ok {
			t.Errorf("metric %s (%s) has no row in docs/operations.md's metric table", name, file)
		}
	}
	for name, line := range rows {
		if _, ok := exported[name]; !ok {
			t.Errorf("docs/operations.md:%d: %s is documented, but the relay exports no such metric", line, name)
		}
	}
}

// TestDocs_DoctorStatuses: every status a doctor check can have (the
// CheckStatus constants of ledger/admin) is named in doctor's help and in
// docs/operations.md's doctor section.
func TestDocs_DoctorStatuses(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(repoRoot, "ledger", "admin", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var statuses []string
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			gd, ok := d.(*goast.GenDecl)
			if !ok || gd.Tok != token.CONST {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*goast.ValueSpec)
				if id, ok := vs.Type.(*goast.Ident); !ok || id.Name != "CheckStatus" {
					continue
				}
				for _, v := range vs.Values {
					if lit, ok := v.(*goast.BasicLit); ok {
						s, _ := strconv.Unquote(lit.Value)
						statuses = append(statuses, s)
					}
				}
			}
		}
	}
	if len(statuses) < 4 {
		t.Fatalf("found the doctor statuses %q in ledger/admin; want at least ok, warn, FAIL, skip", statuses)
	}
	root := newRootCommand(io.Discard, io.Discard)
	doctor, _, err := root.Find([]string{"doctor"})
	if err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile(filepath.Join(repoRoot, "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(page), "\n## doctor\n")
	section, _, _ = strings.Cut(section, "\n## ")
	for _, s := range statuses {
		if !regexp.MustCompile(`\b` + regexp.QuoteMeta(s) + `\b`).MatchString(doctor.Long) {
			t.Errorf("doctor's help does not name the status %q", s)
		}
		if !strings.Contains(section, "`"+s+"`") {
			t.Errorf("docs/operations.md's doctor section does not name the status `%s`", s)
		}
	}
}

// TestSinkFlagHelp: each command's --sink says what it does there; replay's
// is not dlq's.
func TestSinkFlagHelp(t *testing.T) {
	root := newRootCommand(io.Discard, io.Discard)
	usage := map[string]string{}
	for _, path := range [][]string{{"dlq", "list"}, {"dlq", "retry"}, {"dlq", "discard"}, {"replay"}} {
		cmd, _, err := root.Find(path)
		if err != nil {
			t.Fatal(err)
		}
		usage[strings.Join(path, " ")] = cmd.Flags().Lookup("sink").Usage
	}
	if !strings.Contains(usage["replay"], "deliver again to this sink only") {
		t.Errorf("replay --sink: %q", usage["replay"])
	}
	seen := map[string]string{}
	for cmd, u := range usage {
		if other, ok := seen[u]; ok && (cmd == "replay" || other == "replay") {
			t.Errorf("%s and %s share the --sink help %q", cmd, other, u)
		}
		seen[u] = cmd
	}
}

var (
	// codePointer is a source file the manual names, with the names it
	// points at in that file: `relay/lane.go` (`enqueue`, `complete`).
	codePointer = regexp.MustCompile("`((?:relay|ledger|sink|cmd|migrations)/[\\w/.-]+\\.(?:go|sql))`(?: \\(([^)]*)\\))?")
	// pointedName is a Go or SQL name in a pointer's parentheses; a
	// qualified name (`handOver.read`) is checked by its last part.
	pointedName = regexp.MustCompile("`([A-Za-z_][A-Za-z0-9_]*(?:\\.[A-Za-z_][A-Za-z0-9_]*)*)`")
)

// TestDocs_CodePointers: every source file the manual names exists, and
// every name it points at in that file is in it, so a file split or a
// rename that leaves the manual behind fails here.
func TestDocs_CodePointers(t *testing.T) {
	sources := map[string]string{}
	for _, p := range markdownFiles(t) {
		d := readDoc(t, p)
		src := string(d.src)
		for _, m := range codePointer.FindAllStringSubmatchIndex(src, -1) {
			file := src[m[2]:m[3]]
			where := fmt.Sprintf("%s:%d: %s", p, 1+strings.Count(src[:m[0]], "\n"), file)
			code, ok := sources[file]
			if !ok {
				b, err := os.ReadFile(filepath.Join(repoRoot, file))
				if err != nil {
					t.Errorf("%s: no such file", where)
				}
				code = string(b)
				sources[file] = code
			}
			if m[4] < 0 || code == "" {
				continue
			}
			for _, n := range pointedName.FindAllStringSubmatch(src[m[4]:m[5]], -1) {
				parts := strings.Split(n[1], ".")
				last := parts[len(parts)-1]
				if !regexp.MustCompile(`\b` + regexp.QuoteMeta(last) + `\b`).MatchString(code) {
					t.Errorf("%s: points at %s, which the file does not have", where, n[1])
				}
			}
		}
	}
}
