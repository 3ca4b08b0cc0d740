package main

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	"github.com/outbox-relay/outbox-relay/relay"
)

// checkShapes: the rows written with a NULL status and those with a large
// payload are events like any other: each reached both sinks and ended
// done (docs/guarantees.md, "NULL status and NULL available_at", "Memory
// bounded by bytes"), and a large payload arrived whole at each sink.
func checkShapes(f runFacts) invariant {
	var v violations
	byKey := make(map[string]event, len(f.Events))
	for _, e := range f.Events {
		byKey[e.Key] = e
	}
	// whole[sink][key]: the sink has a delivered copy of key whose
	// payload's padding has the bytes written (true for a row without
	// one).
	whole := make([]map[string]bool, len(f.Sinks))
	for i, s := range f.Sinks {
		whole[i] = map[string]bool{}
		for _, d := range s.Arrivals {
			if !d.OK {
				continue
			}
			if n, large := f.Large[d.Key]; !large || padBytes(d.Body) == n {
				whole[i][d.Key] = true
			}
		}
	}
	judge := func(what string, keys []string) (ok int) {
		for _, k := range keys {
			if exempt(f, k) {
				continue
			}
			e, held := byKey[k]
			good := held && e.Status == "done"
			if !held {
				v.add("%s %s: not in the table", what, k)
			} else if e.Status != "done" {
				v.add("%s %s: row status %q at the end, want done", what, k, e.Status)
			}
			for i, s := range f.Sinks {
				if !whole[i][k] {
					good = false
					v.add("%s %s: no whole copy delivered to %s", what, k, s.Name)
				}
			}
			if good {
				ok++
			}
		}
		return ok
	}
	nullKeys := sortedKeys(f.NullStatus)
	largeKeys := make([]string, 0, len(f.Large))
	for k := range f.Large {
		largeKeys = append(largeKeys, k)
	}
	sort.Strings(largeKeys)
	nullOK := judge("row with a NULL status", nullKeys)
	largeOK := judge("large payload", largeKeys)
	lo, hi := largeSpan(f.Large)
	return invariant{Name: "rows with a NULL status and large payloads delivered like any other",
		Checked: fmt.Sprintf("%d of %d rows with a NULL status at every sink and done; %d of %d large payloads (%d–%d KiB) at every sink whole and done",
			nullOK, len(nullKeys)-exemptAmong(f, nullKeys), largeOK, len(largeKeys)-exemptAmong(f, largeKeys), lo>>10, hi>>10),
		Violations: v.result()}
}

// checkLongKeys: an event_key longer than the ledger holds is dead-lettered
// unsent — failed, with a last_error naming the limit, at no sink in any
// attempt, with no ledger row — and the rows written beside it are
// delivered (docs/guarantees.md, "Bad input never stops the stream").
func checkLongKeys(f runFacts) invariant {
	var v violations
	byKey := make(map[string]event, len(f.Events))
	for _, e := range f.Events {
		byKey[e.Key] = e
	}
	limit := fmt.Sprintf("at most %d", relay.MaxEventKeyBytes)
	sent := map[string]string{}
	for _, s := range f.Sinks {
		for _, group := range [][]delivery{s.Arrivals, s.Extra} {
			for _, d := range group {
				if f.LongKeys[d.Key] {
					sent[d.Key] = s.Name
				}
			}
		}
	}
	ledger := map[string]int{}
	for _, r := range f.Ledger {
		if f.LongKeys[r.Key] {
			ledger[r.Key]++
		}
	}
	refused, example := 0, ""
	for _, k := range sortedKeys(f.LongKeys) {
		e, held := byKey[k]
		switch {
		case !held:
			v.add("%d-byte key %.40s…: not in the table", len(k), k)
			continue
		case e.Status != "failed":
			v.add("%d-byte key %.40s…: row status %q, want failed", len(k), k, e.Status)
		case !strings.Contains(e.LastError, limit):
			v.add("%d-byte key %.40s…: last_error %q names no limit (want %q)", len(k), k, e.LastError, limit)
		case sent[k] != "":
			v.add("%d-byte key %.40s…: sent to %s", len(k), k, sent[k])
		case ledger[k] > 0:
			v.add("%d-byte key %.40s…: %d ledger rows, want none", len(k), k, ledger[k])
		default:
			refused++
			if example == "" {
				example = e.LastError
			}
		}
	}
	beside, besideExempt := 0, 0
	for _, k := range f.Beside {
		if exempt(f, k) {
			besideExempt++
			continue
		}
		e, held := byKey[k]
		at := 0
		for _, s := range f.Sinks {
			for _, d := range s.Arrivals {
				if d.Key == k && d.OK {
					at++
					break
				}
			}
		}
		if held && e.Status == "done" && at == len(f.Sinks) {
			beside++
			continue
		}
		v.add("%s, written beside over-long keys: at %d of %d sinks, row status %q", k, at, len(f.Sinks), e.Status)
	}
	checked := fmt.Sprintf("%d of %d over-long keys dead-lettered unsent; %d of %d rows beside them at every sink and done", refused, len(f.LongKeys), beside, len(f.Beside)-besideExempt)
	if example != "" {
		checked += fmt.Sprintf(", e.g. last_error %q", example)
	}
	return invariant{Name: "over-long event_keys dead-lettered unsent, naming the limit; the rows beside them delivered",
		Checked: checked, Violations: v.result()}
}

// padBytes is the length of the padding in an envelope's payload, -1 when
// the body does not decode.
func padBytes(body string) int {
	var env struct {
		Payload struct {
			Pad *string `json:"pad"`
		} `json:"payload"`
	}
	if json.Unmarshal([]byte(body), &env) != nil || env.Payload.Pad == nil {
		return -1
	}
	return len(*env.Payload.Pad)
}

// largeSpan is the smallest and largest large payload's padding, in bytes.
func largeSpan(large map[string]int) (lo, hi int) {
	for _, n := range large {
		if lo == 0 || n < lo {
			lo = n
		}
		hi = max(hi, n)
	}
	return lo, hi
}

// exempt reports whether key is judged elsewhere: deleted (need reach no
// sink) or refused for good by a sink (to be dead-lettered: checkMissing).
func exempt(f runFacts, key string) bool {
	if _, gone := f.Deleted[key]; gone {
		return true
	}
	for _, s := range f.Sinks {
		if s.Refused[key] {
			return true
		}
	}
	return false
}

// exemptAmong counts the keys judged elsewhere.
func exemptAmong(f runFacts, keys []string) int {
	n := 0
	for _, k := range keys {
		if exempt(f, k) {
			n++
		}
	}
	return n
}

func sortedKeys(m map[string]bool) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
