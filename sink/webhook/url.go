package webhook

import (
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/celfilter"
)

// MaxURLBytes bounds a URL rendered from a template: longer, the event is
// dead-lettered for the sink rather than sent (many servers refuse a
// request line past 8 KiB; 2 KiB is what every proxy passes).
const MaxURLBytes = 2048

// urlTemplate is a url holding CEL actions ({{ payload.region }},
// docs/sinks.md, "Routing by field"), rendered per event: each value is
// path-escaped, so it stays inside its path segment or query value, and
// the actions come after the host, which an event can never choose.
type urlTemplate struct {
	parts []urlPart
}

// urlPart is literal text, or (value set) an action.
type urlPart struct {
	text  string
	value *celfilter.Value
}

// CheckURL reports whether text is a usable webhook url: absolute http or
// https, and, when it holds {{ }} actions, actions that compile and come
// after the host. The error never prints the URL (it may hold a password).
func CheckURL(text string) error {
	if _, err := parseURLTemplate(text); err != nil {
		return err
	}
	if !strings.Contains(text, "{{") {
		return checkAbsolute(text)
	}
	return nil
}

// checkAbsolute checks that text is an absolute http:// or https:// URL.
func checkAbsolute(text string) error {
	u, err := url.Parse(text)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		// Not err's text: it would print the URL's password.
		return errors.New("url is not an absolute http:// or https:// URL")
	}
	return nil
}

// parseURLTemplate returns text's template, nil when it holds no "{{".
func parseURLTemplate(text string) (*urlTemplate, error) {
	if !strings.Contains(text, "{{") {
		return nil, nil
	}
	segs, err := celfilter.Segments(text)
	if err != nil {
		return nil, fmt.Errorf("url: %w", err)
	}
	t := &urlTemplate{}
	for _, s := range segs {
		if s.Action == "" {
			t.parts = append(t.parts, urlPart{text: s.Text})
			continue
		}
		if !celfilter.IsExpr(s.Action) {
			return nil, fmt.Errorf("url: {{ %s }}: an action is a CEL expression over payload, event_type, event_key, aggregate_type, aggregate_id or id", s.Action)
		}
		v, err := celfilter.CompileValue(s.Action)
		if err != nil {
			return nil, fmt.Errorf("url: %w", err)
		}
		t.parts = append(t.parts, urlPart{value: v})
	}
	// The host is literal: the text before the first action holds the
	// scheme, the host and the "/" that ends it.
	head := t.parts[0].text
	if err := checkAbsolute(head); err != nil {
		return nil, fmt.Errorf("url: the text before the first {{ }} must hold the scheme and host: %w", err)
	}
	if _, rest, _ := strings.Cut(head, "://"); !strings.Contains(rest, "/") {
		return nil, errors.New("url: {{ }} may appear only after the host and the \"/\" that ends it")
	}
	sample := t.execute(func(*celfilter.Value) (string, error) { return "value", nil })
	if err := checkAbsolute(sample); err != nil {
		return nil, err
	}
	return t, nil
}

// render returns ev's URL. An action that fails on ev, or a URL longer
// than MaxURLBytes, is an error naming it: the event's own.
func (t *urlTemplate) render(ev *relay.Event) (string, error) {
	var failed error
	u := t.execute(func(v *celfilter.Value) (string, error) {
		s, err := v.Render(ev)
		if err != nil && failed == nil {
			failed = err
		}
		return s, err
	})
	if failed != nil {
		return "", failed
	}
	if len(u) > MaxURLBytes {
		return "", fmt.Errorf("url is %d bytes, more than %d", len(u), MaxURLBytes)
	}
	return u, nil
}

// execute renders t with value giving each action's text, path-escaped.
func (t *urlTemplate) execute(value func(*celfilter.Value) (string, error)) string {
	var b strings.Builder
	for _, p := range t.parts {
		if p.value == nil {
			b.WriteString(p.text)
			continue
		}
		s, err := value(p.value)
		if err != nil {
			return ""
		}
		b.WriteString(url.PathEscape(s))
	}
	return b.String()
}
