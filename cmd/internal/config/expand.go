package config

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

const refPrefix = "__relay_ref_"

// refs holds the file's ${...} references while it is parsed. Each is
// replaced in the text by a token that is a plain YAML scalar in any
// context, because the references are expanded in parsed values: that keeps
// keys and comments unexpanded and an expanded value from becoming YAML
// structure. The text cannot simply be parsed as written, since the spec's
// own {type: jwt, secret: ${SECRET}} is not valid YAML: braces end a flow
// mapping.
type refs struct {
	prefix string   // token i is prefix + i + "__"
	text   []string // "${VAR:-default}"
}

// protectRefs returns data with each ${...} that closes on its line replaced
// by a token. "$$" is left for expansion, so "$${X}" stays literal.
func protectRefs(data []byte) ([]byte, *refs) {
	r := &refs{prefix: refPrefix}
	for bytes.Contains(data, []byte(r.prefix)) {
		r.prefix += "x"
	}
	var out bytes.Buffer
	for i := 0; i < len(data); {
		switch {
		case bytes.HasPrefix(data[i:], []byte("$$")):
			out.WriteString("$$")
			i += 2
		case bytes.HasPrefix(data[i:], []byte("${")):
			end := bytes.IndexAny(data[i:], "}\n")
			if end < 0 || data[i+end] != '}' {
				out.WriteString("${") // left for expansion to report if it is in a value
				i += 2
				continue
			}
			out.WriteString(r.token(len(r.text)))
			r.text = append(r.text, string(data[i:i+end+1]))
			i += end + 1
		default:
			out.WriteByte(data[i])
			i++
		}
	}
	return out.Bytes(), r
}

func (r *refs) token(i int) string { return r.prefix + strconv.Itoa(i) + "__" }

// restore puts the original references back into s, for keys.
func (r *refs) restore(s string) string {
	if !strings.Contains(s, r.prefix) {
		return s
	}
	for i := len(r.text) - 1; i >= 0; i-- { // token 1 is a prefix of token 10's text
		s = strings.ReplaceAll(s, r.token(i), r.text[i])
	}
	return s
}

// expandTree expands the references in the scalar values below n and
// restores them in keys, reporting each failure with its line and key path,
// except at the paths tolerate (when not nil) accepts: a value there that
// cannot be expanded is left at its default silently.
func (t *tree) expandTree(n *yaml.Node, path []string, lookup func(string) (string, bool), tolerate func([]string) bool) []error {
	var errs []error
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i]
			k.Value = t.refs.restore(k.Value)
			errs = append(errs, t.expandTree(n.Content[i+1], append(path[:len(path):len(path)], k.Value), lookup, tolerate)...)
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			errs = append(errs, t.expandTree(c, append(path[:len(path):len(path)], strconv.Itoa(i)), lookup, tolerate)...)
		}
	case yaml.ScalarNode:
		v, err := t.refs.expand(n.Value, lookup)
		if err != nil {
			// Left at its default, so the unexpanded text causes no
			// second error.
			n.Value, n.Tag, n.Style = "", "!!null", 0
			if tolerate != nil && tolerate(path) {
				return nil
			}
			return []error{fmt.Errorf("%s: %s: %w", t.label(n), displayPath(path), err)}
		}
		if v != n.Value {
			n.Value = v
			if n.Style == 0 {
				// Typed like a plain scalar written in place of the
				// reference, so that "${X:-}" leaves the default.
				n.Tag = ""
			}
		}
	}
	return errs
}

// expand replaces the reference tokens in s with their values and "$$" with
// "$", in one pass so that an expanded value is never expanded again.
func (r *refs) expand(s string, lookup func(string) (string, bool)) (string, error) {
	if !strings.Contains(s, "$") && !strings.Contains(s, r.prefix) {
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		switch {
		case strings.HasPrefix(s[i:], "$$"):
			b.WriteByte('$')
			i += 2
		case strings.HasPrefix(s[i:], "${"):
			return "", errors.New(`"${" without a closing "}" on its line (write $$ for a literal $)`)
		case strings.HasPrefix(s[i:], r.prefix):
			rest := s[i+len(r.prefix):]
			num, _, _ := strings.Cut(rest, "__")
			idx, _ := strconv.Atoi(num) // the token was written by protectRefs
			v, err := expandRef(r.text[idx], lookup)
			if err != nil {
				return "", err
			}
			b.WriteString(v)
			i += len(r.token(idx))
		default:
			b.WriteByte(s[i])
			i++
		}
	}
	return b.String(), nil
}

// expandRef expands one "${NAME}" or "${NAME:-default}". The default applies
// when NAME is unset or empty, as in the shell.
func expandRef(ref string, lookup func(string) (string, bool)) (string, error) {
	body := ref[2 : len(ref)-1]
	name, def, hasDef := strings.Cut(body, ":-")
	if !isVarName(name) {
		return "", fmt.Errorf("invalid variable reference %s: write ${NAME} or ${NAME:-default}", ref)
	}
	v, ok := lookup(name)
	switch {
	case hasDef && v == "":
		return def, nil
	case !ok:
		return "", fmt.Errorf("environment variable %s is not set (write ${%s:-} to allow that)", name, name)
	}
	return v, nil
}

func isVarName(s string) bool {
	if s == "" || s[0] >= '0' && s[0] <= '9' {
		return false
	}
	for _, r := range s {
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') {
			return false
		}
	}
	return true
}

// restoreErr puts the references back into a parse error's text, which may
// quote the line.
func (r *refs) restoreErr(err error) error {
	if msg := r.restore(err.Error()); msg != err.Error() {
		return errors.New(msg)
	}
	return err
}
