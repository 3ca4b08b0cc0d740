package relay

import (
	"encoding/json"
	"fmt"
)

// DecodePayload decodes a payload's JSON text as encoding/json decodes into
// an any — objects as map[string]any, arrays as []any, numbers as float64 —
// and nil for a NULL payload. It is the filters' and the templates' decoder
// (docs/sinks.md, "Filters").
func DecodePayload(raw []byte) (any, error) {
	if raw == nil {
		return nil, nil
	}
	var out any
	if err := json.Unmarshal(raw, &out); err != nil {
		return nil, fmt.Errorf("payload is not JSON: %w", err)
	}
	return out, nil
}
