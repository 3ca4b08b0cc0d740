package nats

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"text/template"
	"text/template/parse"
	"unicode"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/celfilter"
)

// DefaultSubject is the subject template used when Config.Subject is empty.
const DefaultSubject = "outbox.{{.AggregateType}}.{{.EventType}}"

// maxSubjectLen bounds a rendered subject. The subject travels in the
// protocol's control line, which nats-server caps at max_control_line
// (4 KiB by default) and answers by closing the connection; a subject this
// long is refused as a permanent error so one bad row cannot take the
// connection down for every event behind it.
const maxSubjectLen = 3072

// SubjectFields is what a subject template sees: the event's type and
// aggregate columns and its key, each already sanitised into one valid
// subject token ("" and NULL become "_"). The payload reaches a subject
// only through a CEL action ({{ payload.region }}, docs/sinks.md, "Routing
// by field"), whose values, sanitised as well, are in exprs.
type SubjectFields struct {
	EventType     string
	AggregateType string
	AggregateID   string
	EventKey      string

	exprs []string // the values of subjectTemplate.exprs, in order
}

// subjectTemplate renders a Config.Subject for events.
type subjectTemplate struct {
	text string
	tmpl *template.Template
	// parts, when the template is only literal text and bare fields
	// ("outbox.{{.AggregateType}}.{{.EventType}}", the usual shape), renders
	// it by concatenation: text/template's reflection cost about 6% of the
	// relay's CPU per event. nil: execute the template.
	parts []subjectPart
	// exprs are the template's CEL actions, when it has any: then parts
	// renders it (text, bare fields and expressions only) and tmpl is nil.
	exprs []*celfilter.Value
}

// subjectPart is literal text, or (field set) one of SubjectFields.
type subjectPart struct {
	text  string
	field func(*SubjectFields) string
}

// exprPart is the part of the i-th CEL action of a template.
func exprPart(i int) subjectPart {
	return subjectPart{field: func(f *SubjectFields) string { return f.exprs[i] }}
}

// subjectFields are the fields a template may name bare.
var subjectFields = map[string]func(*SubjectFields) string{
	"EventType":     func(f *SubjectFields) string { return f.EventType },
	"AggregateType": func(f *SubjectFields) string { return f.AggregateType },
	"AggregateID":   func(f *SubjectFields) string { return f.AggregateID },
	"EventKey":      func(f *SubjectFields) string { return f.EventKey },
}

// simpleParts returns the parts of a template made only of text and bare
// {{.Field}} actions, or nil for any other template.
func simpleParts(tmpl *template.Template) []subjectPart {
	if tmpl.Tree == nil || tmpl.Tree.Root == nil {
		return nil
	}
	var parts []subjectPart
	for _, n := range tmpl.Tree.Root.Nodes {
		switch n := n.(type) {
		case *parse.TextNode:
			parts = append(parts, subjectPart{text: string(n.Text)})
		case *parse.ActionNode:
			if len(n.Pipe.Decl) > 0 || len(n.Pipe.Cmds) != 1 || len(n.Pipe.Cmds[0].Args) != 1 {
				return nil
			}
			f, ok := n.Pipe.Cmds[0].Args[0].(*parse.FieldNode)
			if !ok || len(f.Ident) != 1 || subjectFields[f.Ident[0]] == nil {
				return nil
			}
			parts = append(parts, subjectPart{field: subjectFields[f.Ident[0]]})
		default:
			return nil
		}
	}
	return parts
}

// wildcardProbe stands in for every field when the template's shape is
// computed: a control character, so it cannot come out of a sanitised value.
const wildcardProbe = "\x01"

// CheckSubject reports whether text is a usable subject template: it
// parses, its CEL actions compile, and a sample renders a valid subject.
func CheckSubject(text string) error {
	_, err := parseSubjectTemplate(text)
	return err
}

func parseSubjectTemplate(text string) (*subjectTemplate, error) {
	st, err := exprSubjectTemplate(text)
	if err != nil {
		return nil, err
	}
	if st == nil {
		tmpl, err := template.New("subject").Option("missingkey=error").Parse(text)
		if err != nil {
			return nil, fmt.Errorf("subject template %q: %w", text, err)
		}
		st = &subjectTemplate{text: text, tmpl: tmpl, parts: simpleParts(tmpl)}
	}
	// Render a sample so an unknown field ({{.Payload}}) or a literal part
	// that is not a valid subject fails at start, not per event.
	sample := SubjectFields{EventType: "type", AggregateType: "aggregate", AggregateID: "id", EventKey: "key", exprs: repeat("value", len(st.exprs))}
	subject, err := st.execute(sample)
	if err != nil {
		return nil, err
	}
	if err := validatePublishSubject(subject); err != nil {
		return nil, fmt.Errorf("subject template %q renders %q: %w", text, subject, err)
	}
	return st, nil
}

// exprSubjectTemplate returns the template of text when it holds CEL
// actions ({{ payload.region }}), nil when it holds none. Beside them it
// takes literal text and bare fields ({{.EventType}}) only.
func exprSubjectTemplate(text string) (*subjectTemplate, error) {
	segs, err := celfilter.Segments(text)
	if err != nil || !slices.ContainsFunc(segs, func(s celfilter.Segment) bool { return celfilter.IsExpr(s.Action) }) {
		return nil, nil // text/template reports a malformed one
	}
	st := &subjectTemplate{text: text}
	for _, s := range segs {
		switch {
		case s.Action == "":
			st.parts = append(st.parts, subjectPart{text: s.Text})
		case celfilter.IsExpr(s.Action):
			v, err := celfilter.CompileValue(s.Action)
			if err != nil {
				return nil, fmt.Errorf("subject template %q: %w", text, err)
			}
			st.parts = append(st.parts, exprPart(len(st.exprs)))
			st.exprs = append(st.exprs, v)
		case strings.HasPrefix(s.Action, ".") && subjectFields[s.Action[1:]] != nil:
			st.parts = append(st.parts, subjectPart{field: subjectFields[s.Action[1:]]})
		default:
			return nil, fmt.Errorf("subject template %q: {{ %s }}: beside expressions a subject holds only text and bare fields ({{.EventType}}, {{.AggregateType}}, {{.AggregateID}}, {{.EventKey}})", text, s.Action)
		}
	}
	return st, nil
}

func repeat(s string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = s
	}
	return out
}

func (st *subjectTemplate) execute(f SubjectFields) (string, error) {
	var b strings.Builder
	if st.parts != nil {
		n := 0
		for _, p := range st.parts {
			if p.field != nil {
				n += len(p.field(&f))
			} else {
				n += len(p.text)
			}
		}
		b.Grow(n)
		for _, p := range st.parts {
			if p.field != nil {
				b.WriteString(p.field(&f))
			} else {
				b.WriteString(p.text)
			}
		}
		return b.String(), nil
	}
	if err := st.tmpl.Execute(&b, f); err != nil {
		return "", fmt.Errorf("subject template %q: %w (fields: EventType, AggregateType, AggregateID, EventKey)", st.text, err)
	}
	return b.String(), nil
}

// render returns e's subject. The same event always gets the same subject.
// An expression that fails on e ({{ payload.region }} without the field)
// is an error naming it: the event's own.
func (st *subjectTemplate) render(e *relay.Event) (string, error) {
	var exprs []string
	for _, v := range st.exprs {
		s, err := v.Render(e)
		if err != nil {
			return "", err
		}
		exprs = append(exprs, sanitizeSubjectToken(s))
	}
	return st.execute(SubjectFields{
		EventType:     sanitizeSubjectToken(deref(e.EventType)),
		AggregateType: sanitizeSubjectToken(deref(e.AggregateType)),
		AggregateID:   sanitizeSubjectToken(deref(e.AggregateID)),
		EventKey:      sanitizeSubjectToken(e.EventKey),
		exprs:         exprs,
	})
}

// pattern returns the subjects the template can produce as a subject filter:
// every token that holds a field becomes "*" ("outbox.*.*"). A stream
// captures every rendered subject when one of its subjects covers it.
func (st *subjectTemplate) pattern() (string, error) {
	probe := SubjectFields{EventType: wildcardProbe, AggregateType: wildcardProbe, AggregateID: wildcardProbe, EventKey: wildcardProbe,
		exprs: repeat(wildcardProbe, len(st.exprs))}
	s, err := st.execute(probe)
	if err != nil {
		return "", err
	}
	tokens := strings.Split(s, ".")
	for i, t := range tokens {
		if strings.Contains(t, wildcardProbe) {
			tokens[i] = "*"
		}
	}
	return strings.Join(tokens, "."), nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// sanitizeSubjectToken makes s usable as one subject token, deterministically:
// every character NATS forbids or treats specially in a token — '.', '*',
// '>', space, tab, CR, LF and other control characters — becomes '_', as do
// invalid UTF-8 bytes and U+FFFD (which nats-server reads as corruption). An
// empty s becomes "_". Other Unicode is kept.
func sanitizeSubjectToken(s string) string {
	if s == "" {
		return "_"
	}
	clean := true
	for _, r := range s {
		if forbiddenInToken(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range s {
		if forbiddenInToken(r) {
			b.WriteByte('_')
		} else {
			b.WriteRune(r)
		}
	}
	return b.String()
}

// forbiddenInToken reports whether r may not appear in a sanitised token.
// Ranging over a string yields utf8.RuneError for each invalid byte.
func forbiddenInToken(r rune) bool {
	switch r {
	case '.', '*', '>', ' ', utf8.RuneError:
		return true
	}
	return unicode.IsControl(r)
}

// validatePublishSubject checks what nats-server requires of a subject a
// message is published to: non-empty tokens without whitespace, no wildcard
// tokens, and a length the control line can carry.
func validatePublishSubject(subject string) error {
	if subject == "" {
		return errors.New("empty subject")
	}
	if len(subject) > maxSubjectLen {
		return fmt.Errorf("subject is %d bytes, more than %d", len(subject), maxSubjectLen)
	}
	for t := range strings.SplitSeq(subject, ".") {
		switch {
		case t == "":
			return errors.New("empty token (leading, trailing or double '.')")
		case t == "*" || t == ">":
			return fmt.Errorf("wildcard token %q (a message is published to a literal subject)", t)
		case strings.ContainsFunc(t, unicode.IsControl), strings.ContainsRune(t, ' '):
			return fmt.Errorf("token %q contains whitespace or a control character", t)
		}
	}
	return nil
}

// subjectCovers reports whether every subject matching pattern (a filter
// whose wildcards are only "*" tokens) also matches filter.
func subjectCovers(filter, pattern string) bool {
	ft := strings.Split(filter, ".")
	pt := strings.Split(pattern, ".")
	for i, f := range ft {
		if f == ">" {
			return len(pt) > i
		}
		if i >= len(pt) {
			return false
		}
		switch {
		case f == "*":
		case pt[i] == "*" || pt[i] == ">":
			return false
		case f != pt[i]:
			return false
		}
	}
	return len(ft) == len(pt)
}

// literalPrefix returns the pattern's tokens before its first wildcard
// followed by ">", the subject a created stream listens on by default
// ("outbox.*.*" -> "outbox.>"); a pattern that starts with a wildcard is
// returned as is.
func literalPrefix(pattern string) string {
	tokens := strings.Split(pattern, ".")
	for i, t := range tokens {
		if t == "*" {
			if i == 0 {
				return pattern
			}
			return strings.Join(tokens[:i], ".") + ".>"
		}
	}
	return pattern
}
