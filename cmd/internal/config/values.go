package config

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

const redacted = "[redacted]"

// Secret is a string that must not reach logs or printed configuration.
// String, GoString, MarshalText, MarshalJSON and MarshalYAML all return
// "[redacted]" for a non-empty secret and "" for an empty one, so fmt verbs
// and encoders cannot leak it by accident; Reveal is the only way to read it.
type Secret string

// Reveal returns the secret's value, for the code that authenticates with it.
func (s Secret) Reveal() string { return string(s) }

// String returns "[redacted]", or "" when the secret is empty.
func (s Secret) String() string {
	if s == "" {
		return ""
	}
	return redacted
}

// GoString keeps %#v from printing the value.
func (s Secret) GoString() string { return strconv.Quote(s.String()) }

// MarshalText returns the redacted form, for encoders other than YAML and JSON.
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// MarshalJSON returns the redacted form as a JSON string.
func (s Secret) MarshalJSON() ([]byte, error) { return json.Marshal(s.String()) }

// MarshalYAML returns the redacted form.
func (s Secret) MarshalYAML() (any, error) { return s.String(), nil }

// Duration is a time.Duration written as a Go duration string ("1s", "5m",
// "1h30m"); a bare number is refused because its unit would be a guess.
// Convert with time.Duration(d).
type Duration time.Duration

// String formats d like time.Duration but without zero trailing units
// ("5m", not "5m0s").
func (d Duration) String() string {
	s := time.Duration(d).String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

// MarshalText returns d.String().
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText parses a Go duration string.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("invalid duration %q (write a number with a unit: 500ms, 30s, 5m, 1h)", b)
	}
	*d = Duration(v)
	return nil
}

// ByteSize is a size in bytes, written as a plain integer or with a unit:
// KiB, MiB, GiB, TiB (powers of 1024) or B, KB, MB, GB, TB (powers of 1000).
// Units are matched case-insensitively and may follow a space ("16 MiB").
type ByteSize int64

// Common sizes.
const (
	KiB ByteSize = 1 << (10 * (iota + 1))
	MiB
	GiB
	TiB
)

var byteUnits = []struct {
	suffix string
	size   ByteSize
}{
	{"TiB", TiB}, {"GiB", GiB}, {"MiB", MiB}, {"KiB", KiB},
	{"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3},
	{"B", 1},
}

// String formats b with the largest unit that divides it exactly, preferring
// binary units ("16MiB", "1MB", "1000B"); zero is "0".
func (b ByteSize) String() string {
	if b == 0 {
		return "0"
	}
	for _, u := range byteUnits {
		if b%u.size == 0 {
			return strconv.FormatInt(int64(b/u.size), 10) + u.suffix
		}
	}
	panic("unreachable: every size is a multiple of 1B")
}

// MarshalText returns b.String().
func (b ByteSize) MarshalText() ([]byte, error) { return []byte(b.String()), nil }

// MarshalYAML returns b.String(), or the integer 0, which YAML would
// otherwise quote.
func (b ByteSize) MarshalYAML() (any, error) {
	if b == 0 {
		return 0, nil
	}
	return b.String(), nil
}

// UnmarshalText parses a non-negative integer with an optional unit.
func (b *ByteSize) UnmarshalText(text []byte) error {
	s := strings.TrimSpace(string(text))
	digits := strings.IndexFunc(s, func(r rune) bool { return r < '0' || r > '9' })
	if digits < 0 {
		digits = len(s)
	}
	num, unit := s[:digits], strings.TrimSpace(s[digits:])
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil {
		return fmt.Errorf("invalid size %q (write bytes or a number with a unit: 512KiB, 16MiB, 1GiB, 1MB)", s)
	}
	mult := ByteSize(1)
	if unit != "" {
		mult = 0
		for _, u := range byteUnits {
			if strings.EqualFold(unit, u.suffix) {
				mult = u.size
				break
			}
		}
		if mult == 0 {
			return fmt.Errorf("invalid size %q: unknown unit %q (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)", s, unit)
		}
	}
	if n > math.MaxInt64/int64(mult) {
		return fmt.Errorf("invalid size %q: too large", s)
	}
	*b = ByteSize(n) * mult
	return nil
}

// UnmarshalYAML reads a single value as UnmarshalText does.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error { return unmarshalScalar(n, d.UnmarshalText) }

// UnmarshalYAML reads a single value as UnmarshalText does.
func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error { return unmarshalScalar(n, b.UnmarshalText) }
