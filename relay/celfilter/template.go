package celfilter

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/google/cel-go/cel"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Routing by field (docs/sinks.md, "Routing by field"): a NATS subject or a
// webhook URL may hold {{ expr }} actions, each a CEL expression over the
// same variables as a filter, rendered per event. The sinks own what a
// rendered value may hold (sanitised, escaped, bounded).

// Segment is a piece of a template: literal Text, or an Action, the
// trimmed text between "{{" and "}}".
type Segment struct {
	Text   string
	Action string
}

// Segments splits text into literal text and {{ … }} actions. It returns
// an error for an action without its "}}" or an empty one.
func Segments(text string) ([]Segment, error) {
	var out []Segment
	for text != "" {
		i := strings.Index(text, "{{")
		if i < 0 {
			out = append(out, Segment{Text: text})
			break
		}
		if i > 0 {
			out = append(out, Segment{Text: text[:i]})
		}
		j := strings.Index(text[i:], "}}")
		if j < 0 {
			return nil, fmt.Errorf("%q has a {{ without its }}", text)
		}
		action := strings.TrimSpace(text[i+2 : i+j])
		if action == "" {
			return nil, errors.New("empty {{ }}")
		}
		out = append(out, Segment{Action: action})
		text = text[i+j+2:]
	}
	return out, nil
}

// exprStart matches an action that starts with one of the variables: a CEL
// expression, never a Go template action ({{.EventType}}).
var exprStart = regexp.MustCompile(`^(payload|event_type|event_key|aggregate_type|aggregate_id|id)\b`)

// IsExpr reports whether action (a Segment's) is a CEL expression.
func IsExpr(action string) bool { return exprStart.MatchString(action) }

// Value is a compiled expression whose value is rendered as text.
type Value struct {
	src  string
	prog cel.Program
}

// CompileValue compiles expr, whose value must be a string, a number or a
// bool (or dyn: checked on each event).
func CompileValue(expr string) (*Value, error) {
	prog, err := compile(expr, nil)
	if err != nil {
		return nil, fmt.Errorf("{{ %s }}: %w", expr, err)
	}
	return &Value{src: expr, prog: prog}, nil
}

// Render returns v's value on ev as text: a string as is, a number or bool
// in its usual form. Any other value (null, a list, a map) or an
// evaluation error is an error naming the expression: the event's own.
func (v *Value) Render(ev *relay.Event) (string, error) {
	val, err := eval(v.prog, &activation{ev: ev})
	if err != nil {
		return "", fmt.Errorf("{{ %s }}: %w", v.src, err)
	}
	switch x := val.Value().(type) {
	case string:
		return x, nil
	case bool:
		return strconv.FormatBool(x), nil
	case int64:
		return strconv.FormatInt(x, 10), nil
	case uint64:
		return strconv.FormatUint(x, 10), nil
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64), nil
	}
	return "", fmt.Errorf("{{ %s }} gave %s, not a string, number or bool", v.src, val.Type().TypeName())
}
