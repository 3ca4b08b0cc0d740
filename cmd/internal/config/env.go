package config

import (
	"encoding"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

const envPrefix = "RELAY_"

// assignment is one value from the environment or the command line.
type assignment struct {
	segs  []string
	value string
	from  origin
}

// envAssignments resolves the RELAY_ variables in environ against the
// schema; variables that name no key are errors.
func envAssignments(environ []string) ([]assignment, []error) {
	vars := map[string]string{}
	for _, kv := range environ {
		k, v, ok := strings.Cut(kv, "=")
		if ok && strings.HasPrefix(k, envPrefix) && k != EnvConfigFile {
			vars[k] = v // the last of duplicates wins, as in os.Getenv
		}
	}
	var (
		out  []assignment
		errs []error
	)
	for _, k := range slices.Sorted(maps.Keys(vars)) {
		segs, ok := matchEnv(configType, strings.Split(strings.TrimPrefix(k, envPrefix), "_"))
		if !ok {
			errs = append(errs, fmt.Errorf("%s: names no configuration key (see docs/configuration.md for RELAY_ variables)", k))
			continue
		}
		if vars[k] == "" {
			continue
		}
		out = append(out, assignment{segs: segs, value: vars[k], from: origin{label: k, layer: layerEnv}})
	}
	return out, errs
}

// matchEnv maps the "_"-separated parts of a variable name to a key path.
// Key names contain "_" themselves, so each field whose upper-cased name is
// a prefix of parts is tried, longest first, backtracking when the rest does
// not match.
func matchEnv(t reflect.Type, parts []string) ([]string, bool) {
	if len(parts) == 0 {
		return nil, true
	}
	switch {
	case isSingleValue(t) || t.Kind() == reflect.Map:
		return nil, false
	case t.Kind() == reflect.Slice:
		if !isIndex(parts[0]) {
			return nil, false
		}
		rest, ok := matchEnv(t.Elem(), parts[1:])
		if !ok {
			return nil, false
		}
		return append([]string{parts[0]}, rest...), true
	case t.Kind() == reflect.Struct:
		fields := fieldsOf(t)
		slices.SortStableFunc(fields, func(a, b field) int { return len(b.name) - len(a.name) })
		for _, f := range fields {
			toks := strings.Split(strings.ToUpper(f.name), "_")
			if len(toks) > len(parts) || !slices.Equal(toks, parts[:len(toks)]) {
				continue
			}
			if rest, ok := matchEnv(f.typ, parts[len(toks):]); ok {
				return append([]string{f.name}, rest...), true
			}
		}
	}
	return nil, false
}

// overrideAssignments resolves Options.Overrides keys, written as in error
// messages ("sinks[0].url"; "sinks.0.url" is accepted too).
func overrideAssignments(overrides map[string]string) ([]assignment, []error) {
	var (
		out  []assignment
		errs []error
	)
	from := origin{label: "command line", layer: layerOverride}
	for _, k := range slices.Sorted(maps.Keys(overrides)) {
		segs := strings.Split(strings.NewReplacer("[", ".", "]", "").Replace(k), ".")
		if !matchPath(configType, segs) {
			errs = append(errs, fmt.Errorf("%s: unknown key %s", from.label, k))
			continue
		}
		if overrides[k] == "" {
			continue // like an empty RELAY_ variable: a flag left unset
		}
		out = append(out, assignment{segs: segs, value: overrides[k], from: from})
	}
	return out, errs
}

// matchPath reports whether segs names a key of t.
func matchPath(t reflect.Type, segs []string) bool {
	for _, s := range segs {
		switch {
		case t.Kind() == reflect.Slice && !isSingleValue(t):
			if !isIndex(s) {
				return false
			}
			t = t.Elem()
		case t.Kind() == reflect.Struct && !isSingleValue(t):
			f, ok := fieldByName(t, s)
			if !ok {
				return false
			}
			t = f.typ
		default:
			return false
		}
	}
	return len(segs) > 0
}

// apply sets each assignment in the tree, parents before children and list
// elements in index order, so that "RELAY_SINKS" then "RELAY_SINKS_0_URL",
// and "RELAY_SINKS_2_..." then "RELAY_SINKS_3_..." compose.
func (t *tree) apply(as []assignment) []error {
	slices.SortStableFunc(as, func(a, b assignment) int { return comparePaths(a.segs, b.segs) })
	var errs []error
	for _, a := range as {
		val, err := valueNode(typeAt(a.segs), a.value)
		if err == nil {
			err = t.set(a.segs, val, a.from)
		} else {
			err = fmt.Errorf("%s: %w", displayPath(a.segs), err)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", a.from.label, err))
		}
	}
	return errs
}

func comparePaths(a, b []string) int {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] == b[i] {
			continue
		}
		if isIndex(a[i]) && isIndex(b[i]) {
			x, _ := strconv.Atoi(a[i])
			y, _ := strconv.Atoi(b[i])
			return x - y
		}
		return strings.Compare(a[i], b[i])
	}
	return len(a) - len(b)
}

// valueNode turns a variable's text into the node for a key of type typ:
// verbatim for a single value, split on commas or parsed as a YAML flow
// sequence for a list of single values, parsed as YAML otherwise.
func valueNode(typ reflect.Type, v string) (*yaml.Node, error) {
	str := func(s string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: s} }
	switch {
	case isSingleValue(typ):
		return str(v), nil
	case typ.Kind() == reflect.Slice && isSingleValue(typ.Elem()) && !strings.HasPrefix(strings.TrimSpace(v), "["):
		seq := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
		for _, p := range strings.Split(v, ",") {
			seq.Content = append(seq.Content, str(strings.TrimSpace(p)))
		}
		return seq, nil
	}
	var doc yaml.Node
	if err := yaml.Unmarshal([]byte(v), &doc); err != nil {
		return nil, fmt.Errorf("invalid YAML value: %w", err)
	}
	if len(doc.Content) == 0 {
		return nil, errors.New("the value is empty after removing YAML comments")
	}
	budget := maxNodes
	return flatten(doc.Content[0], &budget)
}

// Schema helpers: the Config struct's yaml tags are the schema.

var (
	configType          = reflect.TypeFor[Config]()
	sinkType            = reflect.TypeFor[SinkConfig]()
	textUnmarshalerType = reflect.TypeFor[encoding.TextUnmarshaler]()
)

type field struct {
	name  string
	index []int // for reflect.Value.FieldByIndex, through inline structs
	typ   reflect.Type
}

// fieldsOf lists the keys of struct type t, with inline structs flattened.
func fieldsOf(t reflect.Type) []field {
	var out []field
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "-" {
			continue
		}
		if slices.Contains(strings.Split(opts, ","), "inline") {
			for _, sub := range fieldsOf(f.Type) {
				sub.index = append([]int{i}, sub.index...)
				out = append(out, sub)
			}
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		out = append(out, field{name: name, index: []int{i}, typ: f.Type})
	}
	return out
}

func fieldByName(t reflect.Type, name string) (field, bool) {
	for _, f := range fieldsOf(t) {
		if f.name == name {
			return f, true
		}
	}
	return field{}, false
}

// typeAt returns the type of the key at segs, which matchEnv or matchPath
// has checked.
func typeAt(segs []string) reflect.Type {
	t := configType
	for _, s := range segs {
		if t.Kind() == reflect.Slice {
			t = t.Elem()
			continue
		}
		f, _ := fieldByName(t, s)
		t = f.typ
	}
	return t
}

// isSingleValue reports whether t is written as one scalar.
func isSingleValue(t reflect.Type) bool {
	if reflect.PointerTo(t).Implements(textUnmarshalerType) {
		return true
	}
	switch t.Kind() {
	case reflect.String, reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Float64:
		return true
	}
	return false
}
