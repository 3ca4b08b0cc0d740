package relay

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// maxIdentifierLen is PostgreSQL's NAMEDATALEN-1: longer identifiers are
// silently truncated by the server, so they are refused here instead.
const maxIdentifierLen = 63

// QualifiedName is a PostgreSQL object name, optionally schema-qualified, as
// written in the configuration ("integration_outbox", "app.outbox").
// Both parts are kept verbatim; Quoted renders them as quoted identifiers, so
// a name is never interpreted as SQL.
type QualifiedName struct {
	Schema string // empty: resolved through the search_path
	Name   string
}

// ParseQualifiedName parses "name" or "schema.name". Each part must be 1–63
// bytes of printable UTF-8; a part may contain any other character (quotes,
// spaces, semicolons) because it is always quoted. A name with more than one
// dot is refused: PostgreSQL would read it as database.schema.name.
func ParseQualifiedName(s string) (QualifiedName, error) {
	parts := strings.Split(s, ".")
	switch len(parts) {
	case 1:
		if err := ValidateIdentifier(parts[0]); err != nil {
			return QualifiedName{}, err
		}
		return QualifiedName{Name: parts[0]}, nil
	case 2:
		for _, p := range parts {
			if err := ValidateIdentifier(p); err != nil {
				return QualifiedName{}, err
			}
		}
		return QualifiedName{Schema: parts[0], Name: parts[1]}, nil
	default:
		return QualifiedName{}, fmt.Errorf("%q: at most one dot (schema.name) is allowed", s)
	}
}

// MustParseQualifiedName is ParseQualifiedName for names known to be valid; it
// panics otherwise.
func MustParseQualifiedName(s string) QualifiedName {
	n, err := ParseQualifiedName(s)
	if err != nil {
		panic(err)
	}
	return n
}

// ValidateIdentifier reports whether s can be used as one identifier part.
func ValidateIdentifier(s string) error {
	switch {
	case s == "":
		return errors.New("empty identifier")
	case len(s) > maxIdentifierLen:
		return fmt.Errorf("%q is longer than %d bytes", s, maxIdentifierLen)
	case !utf8.ValidString(s):
		return fmt.Errorf("%q is not valid UTF-8", s)
	}
	for _, r := range s {
		if !unicode.IsPrint(r) && r != ' ' {
			return fmt.Errorf("%q contains a control character", s)
		}
	}
	return nil
}

// String returns the name as configured ("schema.name" or "name").
func (n QualifiedName) String() string {
	if n.Schema == "" {
		return n.Name
	}
	return n.Schema + "." + n.Name
}

// Quoted returns the name as SQL, each part a quoted identifier.
func (n QualifiedName) Quoted() string {
	if n.Schema == "" {
		return QuoteIdentifier(n.Name)
	}
	return QuoteIdentifier(n.Schema) + "." + QuoteIdentifier(n.Name)
}

// Sibling returns a name in the same schema as n.
func (n QualifiedName) Sibling(name string) QualifiedName {
	return QualifiedName{Schema: n.Schema, Name: name}
}

// QuoteIdentifier quotes s as one SQL identifier, doubling embedded quotes.
func QuoteIdentifier(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// QuoteLiteral quotes s as an SQL string literal, for the few statements that
// take no parameters (replication commands, DDL).
func QuoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

// ValidateSlotName checks a replication slot name against PostgreSQL's own
// rule: lower-case letters, digits and underscores, at most 63 bytes.
func ValidateSlotName(s string) error {
	if s == "" {
		return errors.New("empty slot name")
	}
	if len(s) > maxIdentifierLen {
		return fmt.Errorf("slot name %q is longer than %d bytes", s, maxIdentifierLen)
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_') {
			return fmt.Errorf("slot name %q may contain only lower-case letters, digits and underscores", s)
		}
	}
	return nil
}
