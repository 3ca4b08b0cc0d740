package config

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// layer is a source of values; a higher layer wins.
type layer int

const (
	layerFile layer = iota
	layerEnv
	layerOverride
)

// origin says where a node came from, for error messages and for deciding
// which of a secret and its *_file key a higher layer discards.
type origin struct {
	label string // "RELAY_SOURCE_MODE", "command line"
	layer layer
}

// tree is the configuration as YAML nodes, with every layer applied to it
// before decoding, so that the file and the overrides are decoded, checked
// for unknown keys and located by the same code.
type tree struct {
	root    *yaml.Node // a mapping
	file    string
	refs    *refs                 // the file's ${...} references
	origins map[*yaml.Node]origin // nodes that did not come from the file
}

// maxNodes bounds alias expansion: a few aliases can otherwise describe an
// exponentially large tree.
const maxNodes = 1 << 16

// readTree parses the file at path; an empty path gives an empty tree.
func readTree(path string) (*tree, error) {
	t := &tree{file: path, refs: &refs{prefix: refPrefix}, origins: map[*yaml.Node]origin{}}
	t.root = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map", Line: 1}
	if path == "" {
		t.origins[t.root] = origin{label: "defaults"}
		return t, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	data, t.refs = protectRefs(data)
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("%s: %w", path, t.refs.restoreErr(err))
	}
	if len(doc.Content) == 0 {
		return t, nil // empty or only comments
	}
	budget := maxNodes
	root, err := flatten(doc.Content[0], &budget)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	switch {
	case isNull(root):
	case root.Kind != yaml.MappingNode:
		return nil, fmt.Errorf("%s:%d: the top level must be a mapping of keys, not a %s", path, root.Line, kindName(root))
	default:
		t.root = root
	}
	return t, nil
}

// label names where n came from: "relay.yaml:12" or an origin's label.
func (t *tree) label(n *yaml.Node) string {
	if o, ok := t.origins[n]; ok {
		return o.label
	}
	return t.file + ":" + strconv.Itoa(n.Line)
}

// where is label for use inside a message already prefixed with a label:
// "line 12" for the file.
func (t *tree) where(n *yaml.Node) string {
	if _, ok := t.origins[n]; ok {
		return t.label(n)
	}
	return "line " + strconv.Itoa(n.Line)
}

func (t *tree) layerOf(n *yaml.Node) layer {
	if o, ok := t.origins[n]; ok {
		return o.layer
	}
	return layerFile
}

// mark records o as the origin of n and everything below it.
func (t *tree) mark(n *yaml.Node, o origin) {
	t.origins[n] = o
	for _, c := range n.Content {
		t.mark(c, o)
	}
}

// set replaces the value at segs (yaml names and list indexes, already
// checked against the schema) with val, creating the sections and list
// elements on the way. An index may be at most one past a list's end; a
// list the tree lacks starts as its default, so RELAY_DELIVERY_BACKOFF_1
// changes the second default delay.
func (t *tree) set(segs []string, val *yaml.Node, o origin) error {
	t.mark(val, o)
	node, typ := t.root, configType
	def := reflect.ValueOf(Default()) // the default at node's path
	for i, seg := range segs {
		last := i == len(segs)-1
		switch typ.Kind() {
		case reflect.Struct:
			if err := t.makeKind(node, yaml.MappingNode, segs[:i]); err != nil {
				return err
			}
			f, _ := fieldByName(typ, seg)
			def = def.FieldByIndex(f.index)
			k := findKey(node, seg)
			if last {
				if k >= 0 {
					node.Content[k+1] = val
				} else {
					node.Content = append(node.Content, t.newScalar(seg, o), val)
				}
				t.dropLowerPartner(node, typ, seg, o)
				return nil
			}
			if k < 0 {
				child, err := t.seed(def, o)
				if err != nil {
					return err
				}
				node.Content = append(node.Content, t.newScalar(seg, o), child)
				k = len(node.Content) - 2
			}
			node, typ = node.Content[k+1], f.typ
		case reflect.Slice:
			if err := t.makeKind(node, yaml.SequenceNode, segs[:i]); err != nil {
				return err
			}
			idx, _ := strconv.Atoi(seg)
			n := len(node.Content)
			switch {
			case idx > n:
				return fmt.Errorf("%s: index %d skips %s; the list has %d elements and indexes must be contiguous",
					displayPath(segs[:i+1]), idx, displayPath(append(segs[:i:i], strconv.Itoa(n))), n)
			case idx == n && last:
				node.Content = append(node.Content, val)
				return nil
			case idx == n:
				node.Content = append(node.Content, t.newNode(o))
			case last:
				node.Content[idx] = val
				return nil
			}
			switch elem := node.Content[idx]; {
			case typ.Elem() == sinkType:
				def = reflect.ValueOf(DefaultSink(peekSinkType(elem)))
			case idx < def.Len():
				def = def.Index(idx)
			default:
				def = reflect.Zero(typ.Elem())
			}
			node, typ = node.Content[idx], typ.Elem()
		default:
			panic("config: path descends into a single value: " + displayPath(segs))
		}
	}
	panic("config: empty path")
}

// seed returns a new node for a section or list the tree lacks: a non-empty
// default list as nodes, else an empty node that set gives its kind. Other
// defaults need no seeding, because decoding starts from them.
func (t *tree) seed(def reflect.Value, o origin) (*yaml.Node, error) {
	if def.Kind() != reflect.Slice || def.Len() == 0 {
		return t.newNode(o), nil
	}
	var n yaml.Node
	if err := n.Encode(def.Interface()); err != nil {
		return nil, fmt.Errorf("encode default: %w", err)
	}
	t.mark(&n, o)
	return &n, nil
}

// makeKind turns a newly created or null node into an empty mapping or
// sequence, and refuses to overwrite anything else: the lower layer's value
// would be lost without an error.
func (t *tree) makeKind(n *yaml.Node, kind yaml.Kind, segs []string) error {
	switch {
	case n.Kind == kind:
		return nil
	case n.Kind == 0 || isNull(n):
		n.Kind, n.Value, n.Style = kind, "", 0
		n.Tag = map[yaml.Kind]string{yaml.MappingNode: "!!map", yaml.SequenceNode: "!!seq"}[kind]
		return nil
	}
	return fmt.Errorf("%s: cannot set a key inside it: it is a %s at %s", displayPath(segs), kindName(n), t.label(n))
}

// dropLowerPartner removes the sibling of a secret and its *_file key when
// it comes from a lower layer, so that a higher layer can switch between a
// value and a file; within one layer, setting both remains an error.
func (t *tree) dropLowerPartner(m *yaml.Node, typ reflect.Type, key string, o origin) {
	partner := key + "_file"
	if base, ok := strings.CutSuffix(key, "_file"); ok {
		partner = base
	}
	if _, ok := fieldByName(typ, partner); !ok {
		return
	}
	if k := findKey(m, partner); k >= 0 && t.layerOf(m.Content[k+1]) < o.layer {
		m.Content = append(m.Content[:k], m.Content[k+2:]...)
	}
}

func (t *tree) newNode(o origin) *yaml.Node {
	n := &yaml.Node{}
	t.origins[n] = o
	return n
}

func (t *tree) newScalar(v string, o origin) *yaml.Node {
	n := &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: v}
	t.origins[n] = o
	return n
}

// findKey returns the index of key's key node in mapping m, or -1.
func findKey(m *yaml.Node, key string) int {
	for i := 0; i+1 < len(m.Content); i += 2 {
		if m.Content[i].Kind == yaml.ScalarNode && m.Content[i].Value == key {
			return i
		}
	}
	return -1
}

// flatten returns a copy of n with aliases replaced by copies of their
// anchors and merge keys (<<) applied, so that each node has one parent and
// an override edits exactly the value it names.
func flatten(n *yaml.Node, budget *int) (*yaml.Node, error) {
	if *budget--; *budget < 0 {
		return nil, errors.New("too many nodes after expanding aliases")
	}
	if n.Kind == yaml.AliasNode {
		return flatten(n.Alias, budget)
	}
	c := *n
	c.Anchor = ""
	if len(n.Content) == 0 {
		return &c, nil
	}
	c.Content = make([]*yaml.Node, 0, len(n.Content))
	if n.Kind != yaml.MappingNode {
		for _, child := range n.Content {
			fc, err := flatten(child, budget)
			if err != nil {
				return nil, err
			}
			c.Content = append(c.Content, fc)
		}
		return &c, nil
	}
	var merged []*yaml.Node
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.ShortTag() == "!!merge" {
			m, err := mergeSources(v, budget)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", k.Line, err)
			}
			merged = append(merged, m...)
			continue
		}
		fk, err := flatten(k, budget)
		if err != nil {
			return nil, err
		}
		fv, err := flatten(v, budget)
		if err != nil {
			return nil, err
		}
		c.Content = append(c.Content, fk, fv)
	}
	// A mapping's own keys beat merged ones; among merged mappings the
	// first listed wins (YAML merge key semantics).
	for i := 0; i+1 < len(merged); i += 2 {
		if findKey(&c, merged[i].Value) < 0 {
			c.Content = append(c.Content, merged[i], merged[i+1])
		}
	}
	return &c, nil
}

// mergeSources returns the flattened key/value pairs a merge key's value
// contributes: a mapping, or a list of mappings.
func mergeSources(v *yaml.Node, budget *int) ([]*yaml.Node, error) {
	fv, err := flatten(v, budget)
	if err != nil {
		return nil, err
	}
	switch fv.Kind {
	case yaml.MappingNode:
		return fv.Content, nil
	case yaml.SequenceNode:
		var pairs []*yaml.Node
		for _, m := range fv.Content {
			if m.Kind != yaml.MappingNode {
				return nil, errors.New("a merge key (<<) takes a mapping or a list of mappings")
			}
			pairs = append(pairs, m.Content...)
		}
		return pairs, nil
	}
	return nil, errors.New("a merge key (<<) takes a mapping or a list of mappings")
}

func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "mapping"
	case yaml.SequenceNode:
		return "list"
	case yaml.ScalarNode:
		return "single value"
	}
	return "node"
}

// displayPath joins path segments as errors show them: "sinks[0].auth.type".
func displayPath(segs []string) string {
	var b strings.Builder
	for _, s := range segs {
		switch {
		case isIndex(s):
			b.WriteString("[" + s + "]")
		case b.Len() > 0:
			b.WriteString("." + s)
		default:
			b.WriteString(s)
		}
	}
	return b.String()
}

// isIndex reports whether s is a list index: decimal digits without a
// leading zero, so that each element has exactly one name, and short enough
// that strconv.Atoi cannot fail on it.
func isIndex(s string) bool {
	if s == "" || len(s) > 6 || len(s) > 1 && s[0] == '0' {
		return false
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}
