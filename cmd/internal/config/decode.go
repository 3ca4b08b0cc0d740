package config

import (
	"cmp"
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"reflect"
	"regexp"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// decode fills cfg, which holds the defaults, from the tree with every layer
// applied. yaml.v3 decodes the values (yaml.Node.Decode); before it, a walk
// along the schema applies the rules that are this product's and numbers the
// nodes, so that each error the library reports as "line N" leads back to
// the key path and origin of node N. The walk also checks the keys, because
// the library's KnownFields exists only for a Decoder reading text, not for
// Node.Decode (go-yaml/yaml#460), and the layers are merged as nodes. It
// returns where each key path's value came from, for Validate.
func (t *tree) decode(cfg *Config) (origins map[string]string, errs []error) {
	d := decoder{tree: t, origins: map[string]string{}}
	d.walk(t.root, configType, "")
	err := t.root.Decode(cfg)
	var te *yaml.TypeError
	switch {
	case errors.As(err, &te):
		for _, msg := range te.Errors {
			d.errs = append(d.errs, d.located(msg))
		}
	case err != nil: // the walk leaves nothing that fails this way
		d.errs = append(d.errs, fmt.Errorf("%s: %w", t.file, err))
	}
	return d.origins, d.errs
}

// decoder holds what the walk learns about each node.
type decoder struct {
	tree    *tree
	origins map[string]string // key path → origin label
	nodes   []node            // nodes[i] is the node numbered i+1
	errs    []error
}

// node is one numbered node: where it came from, its key path and the type
// it decodes into.
type node struct {
	n     *yaml.Node
	label string
	path  string
	typ   reflect.Type
}

func (d *decoder) fail(n *yaml.Node, path, format string, args ...any) {
	d.errs = append(d.errs, fmt.Errorf("%s: %s: %s", d.tree.label(n), path, fmt.Sprintf(format, args...)))
}

// walk prepares the value n of type typ at path for decoding. It reports
// unknown keys, keys that are not single values and keys set twice, and
// removes them, so that the library never sees them; it removes null values
// of lists and maps, which the library would set to nil, because a null
// value ("key:", "~", an empty ${X:-}) leaves a key at its default; and it
// gives scalars the tag their type reads them with (see scalar). It numbers
// n last, so that its errors still name n's line.
func (d *decoder) walk(n *yaml.Node, typ reflect.Type, path string) {
	label := d.tree.label(n)
	if path != "" {
		d.origins[path] = label
	}
	d.nodes = append(d.nodes, node{n: n, label: label, path: path, typ: typ})
	defer func(id int) { n.Line = id }(len(d.nodes))
	switch {
	case n.Kind == yaml.ScalarNode:
		scalar(n, typ, func(format string, args ...any) { d.fail(n, path, format, args...) })
	case n.Kind == yaml.SequenceNode && typ.Kind() == reflect.Slice:
		for i, c := range n.Content {
			d.walk(c, typ.Elem(), fmt.Sprintf("%s[%d]", path, i))
		}
	case n.Kind == yaml.MappingNode && (typ.Kind() == reflect.Struct || typ.Kind() == reflect.Map):
		d.mapping(n, typ, path)
	}
}

func (d *decoder) mapping(m *yaml.Node, typ reflect.Type, path string) {
	pairs := m.Content
	m.Content = nil
	seen := map[string]*yaml.Node{}
	for i := 0; i+1 < len(pairs); i += 2 {
		k, v := pairs[i], pairs[i+1]
		if k.Kind != yaml.ScalarNode {
			d.fail(k, path, "keys must be single values, got a %s", kindName(k))
			continue
		}
		key := joinPath(path, k.Value)
		var valueType reflect.Type
		if typ.Kind() == reflect.Map {
			valueType = typ.Elem()
		} else if f, ok := fieldByName(typ, k.Value); ok {
			valueType = f.typ
		} else {
			d.unknownKey(k, path, typ)
			continue
		}
		if first, dup := seen[k.Value]; dup {
			d.fail(k, key, "set twice (first at %s)", d.tree.where(first))
			continue
		}
		seen[k.Value] = k
		k.Tag = "!!str"
		d.walk(v, valueType, key)
		if isNull(v) && (valueType.Kind() == reflect.Slice || valueType.Kind() == reflect.Map) {
			continue
		}
		m.Content = append(m.Content, k, v)
	}
}

// scalar tags n so that the library reads it as a value of typ is read
// from an environment variable: strings verbatim whatever YAML would make of
// them (unless !!binary), integers in decimal only and booleans as
// strconv.ParseBool reads them; the library would truncate 1.5 to 1 and
// read "yes" as true. A value that is neither is reported and made null, so
// that the library leaves the key at its default. Duration and ByteSize
// read n.Value.
func scalar(n *yaml.Node, typ reflect.Type, fail func(format string, args ...any)) {
	var err error
	switch {
	case isNull(n) || reflect.PointerTo(typ).Implements(textUnmarshalerType):
	case typ.Kind() == reflect.String && n.ShortTag() == "!!binary":
		// How YAML writes a string that is not UTF-8, and Redacted prints
		// one from a RELAY_ variable. The library would stop decoding at
		// bad base64.
		if _, err = base64.StdEncoding.DecodeString(n.Value); err != nil {
			fail("invalid !!binary value (want base64)")
		}
	case typ.Kind() == reflect.Bool:
		var b bool
		if b, err = strconv.ParseBool(n.Value); err != nil {
			fail("expected true or false, got %q", n.Value)
		}
		n.Tag, n.Value = "!!bool", strconv.FormatBool(b)
	case typ.Kind() >= reflect.Int && typ.Kind() <= reflect.Int64:
		var i int64
		if i, err = strconv.ParseInt(n.Value, 10, typ.Bits()); err != nil {
			fail("expected an integer, got %q", n.Value)
		}
		n.Tag, n.Value = "!!int", strconv.FormatInt(i, 10)
	case typ.Kind() == reflect.Float64:
		var f float64
		if f, err = strconv.ParseFloat(n.Value, 64); err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			err = cmp.Or(err, errors.New("not finite"))
			fail("expected a number, got %q", n.Value)
		}
		n.Tag, n.Value = "!!float", strconv.FormatFloat(f, 'g', -1, 64)
	default:
		n.Tag = "!!str"
	}
	if err != nil {
		n.Tag, n.Value, n.Style = "!!null", "", 0
	}
}

// errLine matches the errors yaml.v3 collects in a *yaml.TypeError.
var errLine = regexp.MustCompile(`(?s)^line (\d+): (.*)$`)

// located turns an error of the library about node N into one naming the
// node's origin and key path.
func (d *decoder) located(msg string) error {
	m := errLine.FindStringSubmatch(msg)
	i := 0
	if m != nil {
		i, _ = strconv.Atoi(m[1])
	}
	if i < 1 || i > len(d.nodes) { // not from the library's decoder
		return fmt.Errorf("%s: %s", d.tree.file, msg)
	}
	at := d.nodes[i-1]
	if strings.HasPrefix(m[2], "cannot unmarshal ") {
		m[2] = typeProblem(at.n, at.typ)
	}
	return fmt.Errorf("%s: %s: %s", at.label, at.path, m[2])
}

// typeProblem says why the library could not decode n into a value of type
// t.
func typeProblem(n *yaml.Node, t reflect.Type) string {
	switch {
	case t.Kind() == reflect.Slice:
		return "expected a list, got a " + kindName(n)
	case t.Kind() == reflect.Map:
		return "expected a mapping, got a " + kindName(n)
	case t.Kind() == reflect.Struct:
		return "expected a mapping of keys, got a " + kindName(n)
	}
	return "expected a single value, got a " + kindName(n)
}

// unmarshalScalar is UnmarshalYAML for a type read from a single value by
// parse. Its errors are a *yaml.TypeError, which the library collects
// instead of stopping.
func unmarshalScalar(n *yaml.Node, parse func([]byte) error) error {
	if n.Kind != yaml.ScalarNode {
		return typeError(n, "expected a single value, got a "+kindName(n))
	}
	if err := parse([]byte(n.Value)); err != nil {
		return typeError(n, err.Error())
	}
	return nil
}

func typeError(n *yaml.Node, msg string) error {
	return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: %s", n.Line, msg)}}
}

// UnmarshalYAML starts the sink from the defaults of its type, which the
// library cannot know when it makes a list element.
func (s *SinkConfig) UnmarshalYAML(n *yaml.Node) error {
	*s = DefaultSink(peekSinkType(n))
	type plain SinkConfig // without this method
	return n.Decode((*plain)(s))
}

func (d *decoder) unknownKey(k *yaml.Node, parent string, typ reflect.Type) {
	msg := fmt.Sprintf("%s: unknown key %s", d.tree.label(k), joinPath(parent, k.Value))
	best, bestDist := "", 3
	for _, f := range fieldsOf(typ) {
		if dist := editDistance(strings.ToLower(k.Value), f.name); dist < bestDist {
			best, bestDist = f.name, dist
		}
	}
	if best != "" {
		msg += fmt.Sprintf(" (did you mean %s?)", joinPath(parent, best))
	}
	d.errs = append(d.errs, errors.New(msg))
}

// peekSinkType returns the value of a sink mapping's type key, or "".
func peekSinkType(n *yaml.Node) SinkType {
	if n.Kind != yaml.MappingNode {
		return ""
	}
	if k := findKey(n, "type"); k >= 0 && n.Content[k+1].Kind == yaml.ScalarNode && !isNull(n.Content[k+1]) {
		return SinkType(n.Content[k+1].Value)
	}
	return ""
}

func joinPath(parent, key string) string {
	if parent == "" {
		return key
	}
	return parent + "." + key
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
