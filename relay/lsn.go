package relay

import (
	"database/sql/driver"
	"fmt"
	"strconv"
	"strings"
)

// LSN is a PostgreSQL write-ahead log position.
type LSN uint64

// ParseLSN parses the textual form "16/B374D848".
func ParseLSN(s string) (LSN, error) {
	hi, lo, ok := strings.Cut(s, "/")
	if !ok {
		return 0, fmt.Errorf("invalid LSN %q: want X/Y", s)
	}
	h, err := strconv.ParseUint(hi, 16, 32)
	if err != nil {
		return 0, fmt.Errorf("invalid LSN %q: %w", s, err)
	}
	l, err := strconv.ParseUint(lo, 16, 32)
	if err != nil {
		return 0, fmt.Errorf("invalid LSN %q: %w", s, err)
	}
	return LSN(h<<32 | l), nil
}

// String returns the textual form PostgreSQL uses, "16/B374D848".
func (l LSN) String() string {
	return fmt.Sprintf("%X/%X", uint64(l)>>32, uint32(l))
}

// Scan reads a pg_lsn (as text) or NULL (as 0).
func (l *LSN) Scan(src any) error {
	switch v := src.(type) {
	case nil:
		*l = 0
		return nil
	case string:
		p, err := ParseLSN(v)
		*l = p
		return err
	case []byte:
		p, err := ParseLSN(string(v))
		*l = p
		return err
	default:
		return fmt.Errorf("scan LSN from %T", src)
	}
}

// Value writes the LSN as text, which PostgreSQL casts to pg_lsn.
func (l LSN) Value() (driver.Value, error) { return l.String(), nil }
