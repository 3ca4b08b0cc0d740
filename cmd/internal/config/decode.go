package config

import (
	"encoding"
	"encoding/base64"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// decoder fills a Config from a tree, walking the schema itself rather than
// using yaml.Node.Decode so that every error carries the full key path and
// its origin, all errors are collected, and each sink starts from its type's
// defaults.
type decoder struct {
	tree    *tree
	origins map[string]string // key path → origin label
	errs    []error
}

func (d *decoder) fail(n *yaml.Node, path, format string, args ...any) {
	d.errs = append(d.errs, fmt.Errorf("%s: %s: %s", d.tree.label(n), path, fmt.Sprintf(format, args...)))
}

// decode sets v from n. A null value (an empty "key:" or "~") leaves v as
// it is, which is the default.
func (d *decoder) decode(n *yaml.Node, v reflect.Value, path string) {
	if path != "" {
		d.origins[path] = d.tree.label(n)
	}
	if isNull(n) {
		return
	}
	t := v.Type()
	if isSingleValue(t) && n.Kind != yaml.ScalarNode {
		d.fail(n, path, "expected a single value, got a %s", kindName(n))
		return
	}
	if reflect.PointerTo(t).Implements(textUnmarshalerType) {
		if err := v.Addr().Interface().(encoding.TextUnmarshaler).UnmarshalText([]byte(n.Value)); err != nil {
			d.fail(n, path, "%v", err)
		}
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		d.decodeStruct(n, v, path)
	case reflect.Slice:
		d.decodeSlice(n, v, path)
	case reflect.Map:
		d.decodeMap(n, v, path)
	case reflect.String:
		s := n.Value
		if n.ShortTag() == "!!binary" {
			// How YAML writes a string that is not UTF-8, and Redacted
			// prints one from a RELAY_ variable.
			b, err := base64.StdEncoding.DecodeString(s)
			if err != nil {
				d.fail(n, path, "invalid !!binary value (want base64)")
				return
			}
			s = string(b)
		}
		v.SetString(s)
	case reflect.Bool:
		b, err := strconv.ParseBool(n.Value)
		if err != nil {
			d.fail(n, path, "expected true or false, got %q", n.Value)
			return
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		i, err := strconv.ParseInt(n.Value, 10, t.Bits())
		if err != nil {
			d.fail(n, path, "expected an integer, got %q", n.Value)
			return
		}
		v.SetInt(i)
	default:
		panic("config: unsupported field type " + t.String())
	}
}

func (d *decoder) decodeStruct(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		d.fail(n, path, "expected a mapping of keys, got a %s", kindName(n))
		return
	}
	fields := fieldsOf(v.Type())
	seen := map[string]*yaml.Node{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		if k.Kind != yaml.ScalarNode {
			d.fail(k, path, "keys must be single values, got a %s", kindName(k))
			continue
		}
		key := joinPath(path, k.Value)
		f, ok := findField(fields, k.Value)
		if !ok {
			d.unknownKey(k, path, fields)
			continue
		}
		if first, dup := seen[k.Value]; dup {
			d.fail(k, key, "set twice (first at %s)", d.tree.where(first))
			continue
		}
		seen[k.Value] = k
		d.decode(val, v.FieldByIndex(f.index), key)
	}
}

func (d *decoder) unknownKey(k *yaml.Node, parent string, fields []field) {
	msg := fmt.Sprintf("%s: unknown key %s", d.tree.label(k), joinPath(parent, k.Value))
	best, bestDist := "", 3
	for _, f := range fields {
		if dist := editDistance(strings.ToLower(k.Value), f.name); dist < bestDist {
			best, bestDist = f.name, dist
		}
	}
	if best != "" {
		msg += fmt.Sprintf(" (did you mean %s?)", joinPath(parent, best))
	}
	d.errs = append(d.errs, errors.New(msg))
}

func (d *decoder) decodeSlice(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.SequenceNode {
		d.fail(n, path, "expected a list, got a %s", kindName(n))
		return
	}
	elem := v.Type().Elem()
	out := reflect.MakeSlice(v.Type(), 0, len(n.Content))
	for i, en := range n.Content {
		ev := reflect.New(elem).Elem()
		if elem == sinkType {
			// Defaults depend on the type, so they are applied per
			// element before its keys are read.
			ev.Set(reflect.ValueOf(DefaultSink(peekSinkType(en))))
		}
		d.decode(en, ev, fmt.Sprintf("%s[%d]", path, i))
		out = reflect.Append(out, ev)
	}
	v.Set(out)
}

func (d *decoder) decodeMap(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		d.fail(n, path, "expected a mapping, got a %s", kindName(n))
		return
	}
	m := reflect.MakeMapWithSize(v.Type(), len(n.Content)/2)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		key := joinPath(path, k.Value)
		if k.Kind != yaml.ScalarNode {
			d.fail(k, path, "keys must be single values, got a %s", kindName(k))
			continue
		}
		if m.MapIndex(reflect.ValueOf(k.Value)).IsValid() {
			d.fail(k, key, "set twice")
			continue
		}
		ev := reflect.New(v.Type().Elem()).Elem()
		d.decode(val, ev, key)
		m.SetMapIndex(reflect.ValueOf(k.Value), ev)
	}
	v.Set(m)
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

func findField(fields []field, name string) (field, bool) {
	for _, f := range fields {
		if f.name == name {
			return f, true
		}
	}
	return field{}, false
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
