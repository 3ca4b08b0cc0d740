package relay

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// DecodePayload decodes a payload's JSON text as encoding/json decodes
// into an any — objects as map[string]any, arrays as []any, numbers as
// float64 — and nil for a NULL payload. It is the filters' decoder
// (docs/sinks.md, "Filters"): encoding/json's reflection took most of a
// filter's cost per event, so the common shapes (jsonb's normalised text)
// are read here directly; a string with escapes is handed to
// encoding/json, and any text this reader refuses is decoded by
// encoding/json, whose answer (or error) is returned.
func DecodePayload(raw []byte) (any, error) {
	if raw == nil {
		return nil, nil
	}
	d := payloadReader{s: raw}
	v, err := d.value(0)
	if err == nil {
		d.space()
		if d.i == len(d.s) {
			return v, nil
		}
	}
	var out any
	if err := json.Unmarshal(raw, &out); err != nil {
		return nil, fmt.Errorf("payload is not JSON: %w", err)
	}
	return out, nil
}

// maxPayloadDepth bounds the nesting payloadReader follows (encoding/json
// allows 10,000; deeper, it gives up and encoding/json decides).
const maxPayloadDepth = 1000

var errPayloadShape = errors.New("not read directly")

// payloadReader reads one JSON value from s at i.
type payloadReader struct {
	s []byte
	i int
}

func (d *payloadReader) space() {
	for d.i < len(d.s) {
		switch d.s[d.i] {
		case ' ', '\t', '\n', '\r':
			d.i++
		default:
			return
		}
	}
}

func (d *payloadReader) value(depth int) (any, error) {
	if depth > maxPayloadDepth {
		return nil, errPayloadShape
	}
	d.space()
	if d.i >= len(d.s) {
		return nil, errPayloadShape
	}
	switch c := d.s[d.i]; {
	case c == '{':
		d.i++
		m := map[string]any{}
		d.space()
		if d.i < len(d.s) && d.s[d.i] == '}' {
			d.i++
			return m, nil
		}
		for {
			d.space()
			k, err := d.str()
			if err != nil {
				return nil, err
			}
			d.space()
			if d.i >= len(d.s) || d.s[d.i] != ':' {
				return nil, errPayloadShape
			}
			d.i++
			v, err := d.value(depth + 1)
			if err != nil {
				return nil, err
			}
			m[k] = v
			d.space()
			if d.i >= len(d.s) {
				return nil, errPayloadShape
			}
			if d.s[d.i] == '}' {
				d.i++
				return m, nil
			}
			if d.s[d.i] != ',' {
				return nil, errPayloadShape
			}
			d.i++
		}
	case c == '[':
		d.i++
		a := []any{}
		d.space()
		if d.i < len(d.s) && d.s[d.i] == ']' {
			d.i++
			return a, nil
		}
		for {
			v, err := d.value(depth + 1)
			if err != nil {
				return nil, err
			}
			a = append(a, v)
			d.space()
			if d.i >= len(d.s) {
				return nil, errPayloadShape
			}
			if d.s[d.i] == ']' {
				d.i++
				return a, nil
			}
			if d.s[d.i] != ',' {
				return nil, errPayloadShape
			}
			d.i++
		}
	case c == '"':
		return d.str()
	case c == 't':
		return true, d.literal("true")
	case c == 'f':
		return false, d.literal("false")
	case c == 'n':
		return nil, d.literal("null")
	case c == '-' || c >= '0' && c <= '9':
		start := d.i
		for d.i < len(d.s) {
			switch b := d.s[d.i]; {
			case b >= '0' && b <= '9', b == '-', b == '+', b == '.', b == 'e', b == 'E':
				d.i++
				continue
			}
			break
		}
		text := d.s[start:d.i]
		if !validNumber(text) {
			return nil, errPayloadShape
		}
		f, err := strconv.ParseFloat(string(text), 64)
		if err != nil {
			return nil, errPayloadShape
		}
		return f, nil
	}
	return nil, errPayloadShape
}

func (d *payloadReader) literal(word string) error {
	if len(d.s)-d.i < len(word) || string(d.s[d.i:d.i+len(word)]) != word {
		return errPayloadShape
	}
	d.i += len(word)
	return nil
}

// str reads a string; one with an escape or a byte encoding/json would
// change (a control character, invalid UTF-8) is decoded by encoding/json.
func (d *payloadReader) str() (string, error) {
	if d.i >= len(d.s) || d.s[d.i] != '"' {
		return "", errPayloadShape
	}
	start := d.i
	d.i++
	plain := true
	for d.i < len(d.s) {
		switch b := d.s[d.i]; {
		case b == '"':
			d.i++
			if plain {
				return string(d.s[start+1 : d.i-1]), nil
			}
			var s string
			if err := json.Unmarshal(d.s[start:d.i], &s); err != nil {
				return "", errPayloadShape
			}
			return s, nil
		case b == '\\':
			plain = false
			d.i += 2
			continue
		case b < 0x20 || b >= 0x80:
			plain = false
		}
		d.i++
	}
	return "", errPayloadShape
}

// validNumber reports whether b is a JSON number:
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func validNumber(b []byte) bool {
	i := 0
	if i < len(b) && b[i] == '-' {
		i++
	}
	digits := func() int {
		n := 0
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
			n++
		}
		return n
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case digits() == 0:
		return false
	}
	if i < len(b) && b[i] == '.' {
		i++
		if digits() == 0 {
			return false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if digits() == 0 {
			return false
		}
	}
	return i == len(b)
}
