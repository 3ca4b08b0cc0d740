package config

import (
	"reflect"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Key is one configuration key that Load accepts: a single value, a list or
// a map, never a section.
type Key struct {
	// Path is the key as errors and the docs write it:
	// "source.poll_interval", and "sinks[].timeout" for a key of each sink.
	Path string
	// Type says what the value is: "string", "integer", "number", "boolean",
	// "duration" (1s, 5m), "size" (16MiB), "secret" (a string never
	// printed), the values of an enumeration ("auto | replication | poll"),
	// "list of durations" and the like, or "map of strings".
	Type string
	// Default is the value used when no layer sets the key, as YAML writes
	// it ("1s", "[400, 413, 415, 422]"); "" when an empty string, list or
	// map is the default.
	Default string
	// Sink is, for a key of sinks[], the sink type it is valid for; "" for
	// a key of every sink and for the other keys.
	Sink SinkType
}

// Keys lists every key Load accepts, in the order of the Config struct,
// with the defaults of Default and DefaultSink.
func Keys() []Key {
	return appendKeys(nil, reflect.ValueOf(Default()), "", "")
}

// appendKeys appends the keys of struct v, whose key path is path.
func appendKeys(keys []Key, v reflect.Value, path string, sink SinkType) []Key {
	for _, f := range fieldsOf(v.Type()) {
		p, fv := joinPath(path, f.name), v.FieldByIndex(f.index)
		if v.Type() == sinkType {
			sink = sinkPart(f)
			fv = reflect.ValueOf(DefaultSink(sink)).FieldByIndex(f.index)
		}
		switch {
		case f.typ.Kind() == reflect.Slice && f.typ.Elem() == sinkType:
			keys = appendKeys(keys, reflect.ValueOf(DefaultSink("")), p+"[]", "")
		case f.typ.Kind() == reflect.Struct && !isSingleValue(f.typ):
			keys = appendKeys(keys, fv, p, sink)
		default:
			keys = append(keys, Key{Path: p, Type: typeName(f.typ), Default: defaultText(fv), Sink: sink})
		}
	}
	return keys
}

// sinkPart returns the sink type whose settings hold field f of SinkConfig,
// or "" for a setting of every sink.
func sinkPart(f field) SinkType {
	if len(f.index) > 1 {
		switch sinkType.Field(f.index[0]).Type {
		case reflect.TypeFor[WebhookConfig]():
			return SinkWebhook
		case reflect.TypeFor[NATSConfig]():
			return SinkNATS
		}
	}
	return ""
}

// enum is a string type whose values are listed.
type enum interface{ choices() []string }

func typeName(t reflect.Type) string {
	if e, ok := reflect.Zero(t).Interface().(enum); ok {
		return strings.Join(e.choices(), " | ")
	}
	switch t {
	case reflect.TypeFor[Duration]():
		return "duration"
	case reflect.TypeFor[ByteSize]():
		return "size"
	case reflect.TypeFor[Secret]():
		return "secret"
	}
	switch t.Kind() {
	case reflect.Slice:
		return "list of " + typeName(t.Elem()) + "s"
	case reflect.Map:
		return "map of " + typeName(t.Elem()) + "s"
	case reflect.Bool:
		return "boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "integer"
	case reflect.Float64:
		return "number"
	}
	return "string"
}

// defaultText writes v as YAML on one line: lists in flow style.
func defaultText(v reflect.Value) string {
	if v.IsZero() && (v.Kind() == reflect.String || v.Kind() == reflect.Slice || v.Kind() == reflect.Map) {
		return ""
	}
	var n yaml.Node
	if err := n.Encode(v.Interface()); err != nil {
		panic("config: encode a default: " + err.Error()) // every default encodes
	}
	n.Style = yaml.FlowStyle
	out, err := yaml.Marshal(&n)
	if err != nil {
		panic("config: encode a default: " + err.Error())
	}
	return strings.TrimSuffix(string(out), "\n")
}
