package relay_test

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
)

// FuzzDecodePayload: DecodePayload answers as encoding/json does, value
// for value, error for error.
func FuzzDecodePayload(f *testing.F) {
	for _, s := range []string{
		`{"amount": 150, "currency": "EUR", "customer": {"id": "c-1", "region": "eu"}, "lines": [{"sku": "a", "qty": 1}]}`,
		`{}`, `[]`, `null`, `true`, `false`, `0`, `-0.5e+10`, `1e400`, `01`, `1.`, `.5`, `-`, `"a\"b\u00e9\ud83d\ude00"`,
		`"é"`, "\"\xff\"", "\"a\x01\"", `{"a":1,"a":2}`, `{"a" 1}`, `{"a":1,}`, `[1,]`, `[1 2]`, ` {"a" : [ true , null ] } `,
		`{"a":1} x`, `nul`, `"unterminated`, `{"\u0061":"\n"}`, `[[[[[[[[[[1]]]]]]]]]]`, `1E5`, `-01`, `2e-3`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := relay.DecodePayload(raw)
		var want any
		wantErr := json.Unmarshal(raw, &want)
		if (err != nil) != (wantErr != nil) {
			t.Fatalf("%q: error %v, encoding/json's %v", raw, err, wantErr)
		}
		if err == nil && !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: %#v, encoding/json gives %#v", raw, got, want)
		}
	})
}

var benchPayload = []byte(`{"amount": 150, "currency": "EUR", "customer": {"id": "c-1", "region": "eu"}, "pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}`)

func BenchmarkDecodePayload(b *testing.B) {
	b.Run("DecodePayload", func(b *testing.B) {
		for b.Loop() {
			if _, err := relay.DecodePayload(benchPayload); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding/json", func(b *testing.B) {
		for b.Loop() {
			var v any
			if err := json.Unmarshal(benchPayload, &v); err != nil {
				b.Fatal(err)
			}
		}
	})
}
