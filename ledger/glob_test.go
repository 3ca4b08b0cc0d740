package ledger_test

import (
	"context"
	"errors"
	"path"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// globPatterns and globNames are crossed in the table test; the patterns
// cover every path.Match construct and its corner cases.
var globPatterns = []string{
	"", "*", "**", "?", "??", "order.*", "order.?", "*.created", "order.*.v?", "*order*",
	"a*b*c", "a*b", "*a*b", "a/*", "*/b", "a/b", "*/*", "a*/b*", "*x*/y",
	"[abc]", "[a-c]x", "[^a-c]x", "[^a]", "[!]", "[\\]]", "[\\-]", "[a\\-z]", "[]a]", "[-]",
	"[z-a]", "[z-a]x", "[^z-a]", "[^z-a]*", "[a-a]", "[^/]", "[/]", "[.-0]", "[^.-0]*",
	"\\*", "\\?", "\\[", "\\\\", "a\\*b", "\\a\\b", "*[^x]*y", "*[^x]y*", "*[/]*", "*?*",
	"*[^x]", "x*[^x]*[^y]*z", "é*", "[é-ü]", "[^é]", "中*", "*\\.*", "order.(x)", "a+b", "a|b", "$^",
	"[a-", "[", "\\", "a[", "[^", "[a-]", "[]", "[^]",
}

var globNames = []string{
	"", "a", "b", "x", "/", "ab", "abc", "acb", "aXbYc", "a/b", "a/bc", "ab/c", "xa/ab", "x/y", "a/y", "x/ay",
	"order", "order.", "order.created", "order.created.v2", "order.created.v22", "order/created", "user.created",
	"orderx", "*", "?", "[", "]", "\\", "-", ".", "0", "/", "a*b", "a\\b", "ab*", "é", "ü", "éa", "中", "中文",
	"order.(x)", "a+b", "aab", "a|b", "$^", "axbyz", "xxbz", "z", "x\ny", "a\nb", "\n",
}

// pgRegexMatch evaluates name ~ regex in PostgreSQL for every pair, in one
// query.
func pgRegexMatch(tb testing.TB, conn *pgx.Conn, regexes, names []string) []bool {
	tb.Helper()
	rows, err := conn.Query(context.Background(),
		`SELECT t.n ~ t.r FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(r, n, i) ORDER BY t.i`, regexes, names)
	if err != nil {
		tb.Fatalf("match: %v", err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[bool])
	if err != nil {
		tb.Fatalf("match: %v", err)
	}
	return got
}

func mustConn(tb testing.TB) *pgx.Conn {
	tb.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pgtest.NewDatabase(tb))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// Every pattern × name: the regex, run by PostgreSQL, agrees with
// path.Match, and a malformed pattern is an error.
func TestGlobToRegex(t *testing.T) {
	conn := mustConn(t)
	var regexes, names, patterns []string
	var want []bool
	for _, p := range globPatterns {
		re, matchable, err := ledger.GlobToRegex(p)
		if _, badErr := path.Match(p, ""); badErr != nil {
			if !errors.Is(err, path.ErrBadPattern) {
				t.Errorf("GlobToRegex(%q) = %q, %v; want ErrBadPattern", p, re, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("GlobToRegex(%q): %v", p, err)
			continue
		}
		for _, n := range globNames {
			ok, _ := path.Match(p, n)
			if !matchable {
				if ok {
					t.Errorf("GlobToRegex(%q) says nothing matches, but path.Match matches %q", p, n)
				}
				continue
			}
			regexes, names, patterns, want = append(regexes, re), append(names, n), append(patterns, p), append(want, ok)
		}
	}
	got := pgRegexMatch(t, conn, regexes, names)
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("%q ~ %q (glob %q) = %v, path.Match says %v", names[i], regexes[i], patterns[i], got[i], want[i])
		}
	}
	t.Logf("%d pattern × name pairs agree", len(got))

	for _, tc := range []struct{ glob, re string }{
		{"order.*", `^order\.[^/]*$`},
		{"*.created", `^[^/]*\.created$`},
		{"order.?", `^order\.[^/]$`},
		{"[^a-c]x", `^[^a-c]x$`},
		{"*[^x]*y", `^(?:(?![^x])[^/])*[^x][^/]*y$`},
	} {
		if re, _, _ := ledger.GlobToRegex(tc.glob); re != tc.re {
			t.Errorf("GlobToRegex(%q) = %q, want %q", tc.glob, re, tc.re)
		}
	}
}

// A sink's globs become one regex; "*" or no globs take every type
// (including NULL), a sink whose globs match nothing gets no regex.
func TestSinkFilter(t *testing.T) {
	for _, tc := range []struct {
		globs []string
		every bool
		re    string
	}{
		{nil, true, ""},
		{[]string{"*"}, true, ""},
		{[]string{"order.*", "*"}, true, ""},
		{[]string{"order.*", "user.?"}, false, `^(?:order\.[^/]*|user\.[^/])$`},
		{[]string{"[z-a]"}, false, ""},
	} {
		every, re, err := ledger.SinkFilter(tc.globs)
		if err != nil || every != tc.every || (re == nil) != (tc.re == "") || re != nil && *re != tc.re {
			t.Errorf("SinkFilter(%q) = %v, %s, %v; want %v, %q", tc.globs, every, deref(re), err, tc.every, tc.re)
		}
	}
	if _, _, err := ledger.SinkFilter([]string{"ok.*", "bad["}); err == nil {
		t.Error("SinkFilter accepted a malformed glob")
	}
}

// FuzzGlobToRegex compares the regex, run by PostgreSQL, with path.Match on
// valid UTF-8 without NUL (what text holds). Names with multi-byte
// characters are compared only for patterns where path.Match's byte-wise
// star cannot split a character (no '?' or class after a '*'); see
// GlobToRegex.
func FuzzGlobToRegex(f *testing.F) {
	for _, p := range globPatterns {
		for _, n := range []string{"order.created", "a/b", "xa/ab", "é", "中", ""} {
			f.Add(p, n)
		}
	}
	f.Add("*[^x]*y", "a/y")
	f.Add("*??", "中")
	f.Add("a*[/]b*c", "ax/b/bc")
	f.Add("*[!-0]*[!-0]", "a.b/c")
	conn := mustConn(f)
	f.Fuzz(func(t *testing.T, pattern, name string) {
		if !utf8.ValidString(pattern) || !utf8.ValidString(name) || strings.ContainsRune(pattern, 0) || strings.ContainsRune(name, 0) {
			return // not text: event types and globs are strings of text
		}
		want, badErr := path.Match(pattern, name)
		re, matchable, err := ledger.GlobToRegex(pattern)
		if badErr != nil {
			if !errors.Is(err, path.ErrBadPattern) {
				t.Fatalf("GlobToRegex(%q) = %q, %v; want ErrBadPattern", pattern, re, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("GlobToRegex(%q): %v", pattern, err)
		}
		if !isASCII(name) && strings.Contains(pattern, "*") && strings.ContainsAny(pattern, "?[") {
			return // path.Match's star skips bytes, the regex characters (documented)
		}
		got := false
		if matchable {
			got = pgRegexMatch(t, conn, []string{re}, []string{name})[0]
		}
		if got != want {
			t.Fatalf("%q ~ %q (glob %q, matchable %v) = %v, path.Match says %v", name, re, pattern, matchable, got, want)
		}
	})
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}
