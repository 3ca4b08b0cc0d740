package ledger

import (
	"fmt"
	"path"
	"strings"
	"unicode/utf8"
)

// sinkFilter is how the claim query routes a row to a sink in SQL: every
// type (incl. NULL), or event_type ~ regex. A nil regex matches nothing.
type sinkFilter struct {
	everyType bool
	regex     *string
}

// newSinkFilter translates a route's globs for the claim query.
func newSinkFilter(globs []string) (sinkFilter, error) {
	if len(globs) == 0 {
		return sinkFilter{everyType: true}, nil
	}
	var alternatives []string
	for _, g := range globs {
		if g == "*" {
			return sinkFilter{everyType: true}, nil
		}
		re, matchable, err := globToRegex(g)
		if err != nil {
			return sinkFilter{}, err
		}
		if matchable {
			alternatives = append(alternatives, strings.TrimSuffix(strings.TrimPrefix(re, "^"), "$"))
		}
	}
	if len(alternatives) == 0 {
		return sinkFilter{}, nil
	}
	re := "^(?:" + strings.Join(alternatives, "|") + ")$"
	return sinkFilter{regex: &re}, nil
}

// globToRegex translates a path.Match pattern into an anchored PostgreSQL
// advanced regular expression that matches the same strings, so the claim
// query can route rows in SQL exactly as the engine routes them in Go:
//
//	glob     regex
//	----     -----
//	*        [^/]*
//	?        [^/]
//	[a-z]    [a-z]     a class, escapes resolved; ranges with lo > hi,
//	[^a-z]   [^a-z]    which match nothing in Go, are dropped
//	\c, c    c         escaped when not an ASCII letter or digit
//	(all)    ^…$       anchored
//
// Two details make it exact. A negated class matches '/' in path.Match, and
// path.Match gives a chunk that follows '*' (and is not the last one) its
// leftmost match without backtracking; where such a chunk can match '/',
// that changes the result, so its star becomes the tempered form
// (?:(?!chunk)[^/])* , which stops at the chunk's first match. And a class
// whose ranges are all empty (such as [z-a]) matches nothing: then
// matchable is false and re is empty.
//
// The translation is over characters. path.Match skips bytes after a star,
// so for a name with multi-byte characters a '?' or a negated class after
// a star can match part of a character there ("*??" matches "中"); the
// regex does not. Event types are expected to be ASCII.
//
// It returns path.ErrBadPattern for a malformed pattern, and an error for a
// pattern that is not valid UTF-8 or contains NUL, which PostgreSQL text
// cannot hold.
func globToRegex(glob string) (re string, matchable bool, err error) {
	if _, err := path.Match(glob, ""); err != nil {
		return "", false, fmt.Errorf("event glob %q: %w", glob, err)
	}
	if !utf8.ValidString(glob) || strings.ContainsRune(glob, 0) {
		return "", false, fmt.Errorf("event glob %q: not valid UTF-8 text", glob)
	}
	var b strings.Builder
	b.WriteByte('^')
	for p := glob; len(p) > 0; {
		var star bool
		var chunk string
		star, chunk, p = scanChunk(p)
		if star && chunk == "" {
			// Only the pattern's end leaves an empty chunk after a star.
			b.WriteString("[^/]*")
			break
		}
		chunkRe, slash, ok := chunkToRegex(chunk)
		if !ok {
			return "", false, nil
		}
		if star {
			if len(p) > 0 && slash {
				b.WriteString("(?:(?!" + chunkRe + ")[^/])*")
			} else {
				b.WriteString("[^/]*")
			}
		}
		b.WriteString(chunkRe)
	}
	b.WriteByte('$')
	return b.String(), true, nil
}

// scanChunk is path.Match's: it splits off the leading stars (star reports
// any) and the chunk up to the next unescaped star outside a class.
func scanChunk(pattern string) (star bool, chunk, rest string) {
	for len(pattern) > 0 && pattern[0] == '*' {
		pattern = pattern[1:]
		star = true
	}
	inRange := false
	var i int
Scan:
	for i = 0; i < len(pattern); i++ {
		switch pattern[i] {
		case '\\':
			if i+1 < len(pattern) {
				i++
			}
		case '[':
			inRange = true
		case ']':
			inRange = false
		case '*':
			if !inRange {
				break Scan
			}
		}
	}
	return star, pattern[0:i], pattern[i:]
}

// chunkToRegex translates one star-free chunk of a valid pattern. slash
// reports whether a class in it can match '/'; ok is false when a class can
// match nothing, which makes the chunk unmatchable.
func chunkToRegex(chunk string) (re string, slash, ok bool) {
	var b strings.Builder
	for len(chunk) > 0 {
		switch chunk[0] {
		case '?':
			b.WriteString("[^/]")
			chunk = chunk[1:]
		case '[':
			chunk = chunk[1:]
			negated := len(chunk) > 0 && chunk[0] == '^'
			if negated {
				chunk = chunk[1:]
			}
			type span struct{ lo, hi rune }
			var spans []span
			coversSlash := false
			for n := 0; ; n++ {
				if chunk[0] == ']' && n > 0 {
					chunk = chunk[1:]
					break
				}
				var lo, hi rune
				lo, chunk = classChar(chunk)
				hi = lo
				if chunk[0] == '-' {
					hi, chunk = classChar(chunk[1:])
				}
				lo = max(lo, 1) // text never holds NUL
				if lo > hi {
					continue // matches nothing in path.Match either
				}
				spans = append(spans, span{lo, hi})
				coversSlash = coversSlash || lo <= '/' && '/' <= hi
			}
			switch {
			case len(spans) == 0 && !negated:
				return "", false, false
			case len(spans) == 0:
				b.WriteByte('.') // [^z-a]: any character
				slash = true
				continue
			}
			slash = slash || coversSlash != negated
			b.WriteByte('[')
			if negated {
				b.WriteByte('^')
			}
			for _, s := range spans {
				writeLiteral(&b, s.lo)
				if s.hi != s.lo {
					b.WriteByte('-')
					writeLiteral(&b, s.hi)
				}
			}
			b.WriteByte(']')
		default:
			if chunk[0] == '\\' {
				chunk = chunk[1:]
			}
			r, n := utf8.DecodeRuneInString(chunk)
			chunk = chunk[n:]
			writeLiteral(&b, r)
		}
	}
	return b.String(), slash, true
}

// classChar reads one possibly escaped character of a class.
func classChar(chunk string) (rune, string) {
	if chunk[0] == '\\' {
		chunk = chunk[1:]
	}
	r, n := utf8.DecodeRuneInString(chunk)
	return r, chunk[n:]
}

// writeLiteral writes r so that it matches itself, inside or outside a
// bracket expression: in an ARE, a backslash before any character other
// than an ASCII letter or digit makes it literal.
func writeLiteral(b *strings.Builder, r rune) {
	if r < utf8.RuneSelf && !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9') {
		b.WriteByte('\\')
	}
	b.WriteRune(r)
}
