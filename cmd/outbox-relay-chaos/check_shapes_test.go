package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// withK4 adds a third event of aggregate a, k4 (seq 3), delivered last at
// both sinks: the aggregate then has a middle event, k2, to delete.
func withK4(f *runFacts) {
	f.Events = append(f.Events, event{Key: "k4", Agg: "a", Seq: 3, Status: "done"})
	f.Written = append(f.Written, "k4")
	for i := range f.Sinks {
		s := &f.Sinks[i]
		s.Arrivals = append(s.Arrivals, delivery{Index: len(s.Arrivals), At: 5 * time.Second, Key: "k4", ID: "k4", Body: `{"id":1,"event_key":"k4"}`, OK: true})
	}
	f.Ledger = append(f.Ledger, ledgerRow{"k4", "nats", "delivered"}, ledgerRow{"k4", "hook", "delivered"})
	f.SideEffects["k4"] = 1
}

// deleteK2 makes k2 a row handover-delete deleted at 2.5 s before any
// sink got it: it never arrives, has no ledger row, no side effect, and its
// kept copy is still pending.
func deleteK2(f *runFacts) {
	for i := range f.Sinks {
		s := &f.Sinks[i]
		var kept []delivery
		for _, d := range s.Arrivals {
			if d.Key != "k2" {
				d.Index = len(kept)
				kept = append(kept, d)
			}
		}
		s.Arrivals, s.Extra = kept, nil
	}
	var ledger []ledgerRow
	for _, r := range f.Ledger {
		if r.Key != "k2" {
			ledger = append(ledger, r)
		}
	}
	f.Ledger = ledger
	delete(f.SideEffects, "k2")
	f.Events[1].Status = "pending"
	f.Deleted = map[string]time.Duration{"k2": 2500 * time.Millisecond}
}

// TestCheck_DeletedRows: a row deleted during a hand-over need reach no
// sink and holds nothing back, but where it arrives it is judged like any
// other: in order, its side effect at most once; the events around it
// still keep their order.
func TestCheck_DeletedRows(t *testing.T) {
	f := goodRun()
	withK4(&f)
	deleteK2(&f)
	if got := failures(f); len(got) != 0 {
		t.Fatalf("a run with a deleted row never delivered fails: %v", got)
	}
	var missing invariant
	for _, iv := range check(f) {
		if iv.Name == "no event missing at any sink" {
			missing = iv
		}
	}
	if !strings.Contains(missing.Checked, "webhook 0 missing (and 1 deleted: 0 delivered before their deletion, 0 after, 1 never)") {
		t.Errorf("missing: checked %q", missing.Checked)
	}

	for _, c := range []struct {
		name      string
		breakIt   func(f *runFacts)
		invariant string
		mention   string
	}{
		{"delivered after its deletion, after its successor", func(f *runFacts) {
			w := &f.Sinks[1]
			w.Arrivals = append(w.Arrivals, delivery{Index: len(w.Arrivals), At: 6 * time.Second, Key: "k2", ID: "k2", Body: `{"id":1,"event_key":"k2"}`, OK: true})
		}, "per-aggregate order", "webhook: aggregate a: seq 3 (k4) arrived (#3) before seq 2 (k2) was delivered (#4)"},
		{"its successor before the event before it", func(f *runFacts) {
			n := &f.Sinks[0]
			// k4 stored before k1: k2's deletion does not excuse it.
			for i := range n.Arrivals {
				switch n.Arrivals[i].Key {
				case "k1":
					n.Arrivals[i].Index = 2
				case "k4":
					n.Arrivals[i].Index = 1
				}
			}
		}, "per-aggregate order", "nats: aggregate a: seq 3 (k4) arrived (#1) before seq 1 (k1) was delivered (#2)"},
		{"its side effect twice", func(f *runFacts) {
			f.SideEffects["k2"] = 2
		}, "webhook side effect applied exactly once per event (dedup by webhook-id)", "k2: deleted, its side effect applied 2 times"},
		{"two ledger rows", func(f *runFacts) {
			f.Ledger = append(f.Ledger, ledgerRow{"k2", "hook", "delivered"}, ledgerRow{"k2", "hook", "delivered"})
		}, "each (event_key, action) has one delivered ledger row; delivered rows are done", "(k2, hook): deleted, ledger rows [delivered delivered], want at most one"},
		{"delivered before its deletion, in order", func(f *runFacts) {
			w := &f.Sinks[1]
			// k2 answered 2xx at 2 s (before the deletion at 2.5 s), k4 after.
			w.Arrivals = []delivery{w.Arrivals[0], w.Arrivals[1], {Key: "k2", At: 2 * time.Second, ID: "k2", Body: `{"id":1,"event_key":"k2"}`, OK: true}, w.Arrivals[2], w.Arrivals[3]}
			for i := range w.Arrivals {
				w.Arrivals[i].Index = i
			}
			f.Ledger = append(f.Ledger, ledgerRow{"k2", "hook", "delivered"})
			f.SideEffects["k2"] = 1
		}, "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := goodRun()
			withK4(&f)
			deleteK2(&f)
			c.breakIt(&f)
			got := failures(f)
			if c.invariant == "" {
				if len(got) != 0 {
					t.Fatalf("failures %v, want none", got)
				}
				return
			}
			vs, ok := got[c.invariant]
			if !ok {
				t.Fatalf("%q not reported; failures: %v", c.invariant, got)
			}
			if !strings.Contains(strings.Join(vs, "\n"), c.mention) {
				t.Fatalf("%q: violations %q do not mention %q", c.invariant, vs, c.mention)
			}
		})
	}
}

// longKey is a key of n bytes.
func longKey(n int) string { return "lk-c1-2-" + strings.Repeat("x", n-len("lk-c1-2-")) }

// withLongKey adds an over-long key to aggregate a, between k1 and k2 (as
// long-keys writes it: k1 and k2 beside it), dead-lettered unsent as the
// relay does.
func withLongKey(f *runFacts, key string) {
	f.Events = append(f.Events, event{Key: key, Agg: "a", Seq: 2, Status: "failed",
		LastError: fmt.Sprintf("event_key is %d bytes; the ledger holds at most %d (docs/schema.md, \"Key lengths\")", len(key), relay.MaxEventKeyBytes)})
	f.Events[1].Seq = 3 // k2 after it
	f.Written = append(f.Written, key)
	f.LongKeys = map[string]bool{key: true}
	f.Beside = []string{"k1", "k2"}
	for i := range f.Sinks {
		if f.Sinks[i].Refused == nil {
			f.Sinks[i].Refused = map[string]bool{}
		}
		f.Sinks[i].Refused[key] = true
	}
}

// TestCheck_LongKeys: an over-long key must end failed naming the limit,
// reach no sink in any attempt and have no ledger row; the rows beside it
// must be delivered; it holds its aggregate's next event back no more than
// any dead letter does.
func TestCheck_LongKeys(t *testing.T) {
	key := longKey(relay.MaxEventKeyBytes + 1)
	f := goodRun()
	withLongKey(&f, key)
	if got := failures(f); len(got) != 0 {
		t.Fatalf("a run whose over-long key was dead-lettered unsent fails: %v", got)
	}
	const name = "over-long event_keys dead-lettered unsent, naming the limit; the rows beside them delivered"
	for _, c := range []struct {
		name     string
		breakIt  func(f *runFacts)
		mentions []string
	}{
		{"a reason without the limit", func(f *runFacts) {
			f.Events[3].LastError = "sink hook: permanent: 400"
		}, []string{"2049-byte key lk-c1-2-", `names no limit (want "at most 2048")`}},
		{"left pending", func(f *runFacts) {
			f.Events[3].Status, f.Events[3].LastError = "pending", ""
		}, []string{`row status "pending", want failed`}},
		{"published, though the stream dropped it", func(f *runFacts) {
			n := &f.Sinks[0]
			n.Extra = append(n.Extra, delivery{Index: len(n.Extra), Key: key, ID: key, Body: fmt.Sprintf(`{"id":1,"event_key":%q}`, key)})
		}, []string{"sent to nats"}},
		{"a ledger row", func(f *runFacts) {
			f.Ledger = append(f.Ledger, ledgerRow{key, "nats", "sending"})
		}, []string{"1 ledger rows, want none"}},
		{"a row beside it never delivered", func(f *runFacts) {
			w := &f.Sinks[1]
			var kept []delivery
			for _, d := range w.Arrivals {
				if d.Key != "k2" {
					kept = append(kept, d)
				}
			}
			w.Arrivals = kept
		}, []string{"k2, written beside over-long keys: at 1 of 2 sinks"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := goodRun()
			withLongKey(&f, key)
			c.breakIt(&f)
			vs := strings.Join(failures(f)[name], "\n")
			for _, m := range c.mentions {
				if !strings.Contains(vs, m) {
					t.Errorf("violations %q do not mention %q", vs, m)
				}
			}
		})
	}
}

// TestCheck_Shapes: a row with a NULL status and a large payload are
// judged like any other event, and a large payload must arrive whole.
func TestCheck_Shapes(t *testing.T) {
	run := func() runFacts {
		f := goodRun()
		f.NullStatus = map[string]bool{"k1": true}
		f.Large = map[string]int{"k2": 12}
		body := `{"id":1,"event_key":"k2","payload":{"seq":2,"pad":"xxxxxxxxxxxx"}}`
		for i := range f.Sinks {
			for _, group := range [][]delivery{f.Sinks[i].Arrivals, f.Sinks[i].Extra} {
				for j := range group {
					if group[j].Key == "k2" {
						group[j].Body = body
					}
				}
			}
		}
		return f
	}
	const name = "rows with a NULL status and large payloads delivered like any other"
	f := run()
	if got := failures(f); len(got) != 0 {
		t.Fatalf("a good run with the shapes fails: %v", got)
	}
	for _, iv := range check(f) {
		if iv.Name == name && !strings.Contains(iv.Checked, "1 of 1 rows with a NULL status at every sink and done; 1 of 1 large payloads") {
			t.Errorf("checked %q", iv.Checked)
		}
	}

	cut := run()
	w := &cut.Sinks[1]
	for i := range w.Arrivals {
		if w.Arrivals[i].Key == "k2" {
			w.Arrivals[i].Body = `{"id":1,"event_key":"k2","payload":{"seq":2,"pad":"xxxxxxxxxxx"}}`
		}
	}
	if vs := strings.Join(failures(cut)[name], "\n"); !strings.Contains(vs, "large payload k2: no whole copy delivered to webhook") {
		t.Errorf("a cut payload: violations %q", vs)
	}
	pending := run()
	pending.Events[0].Status = ""
	if vs := strings.Join(failures(pending)[name], "\n"); !strings.Contains(vs, `row with a NULL status k1: row status "" at the end, want done`) {
		t.Errorf("a NULL status left: violations %q", vs)
	}
}

// TestCheck_RSSEachRelay: each relay's peak is held to the bound and
// named.
func TestCheck_RSSEachRelay(t *testing.T) {
	f := goodRun()
	f.RSSBound = 300 << 20
	f.PeakRSS = map[string]int64{"relay-a": 80 << 20, "relay-b": 120 << 20}
	f.Large = map[string]int{"k1": 300 << 10, "k2": 900 << 10}
	iv := checkRSS(f)
	if !iv.ok() || iv.Checked != "peak RSS (VmHWM) relay-a 80.0 MB, relay-b 120.0 MB, each ≤ 300.0 MB, with 2 large payloads of 300–900 KiB among the load" {
		t.Errorf("under the bound: %+v", iv)
	}
	f.PeakRSS["relay-b"] = 301 << 20
	if iv := checkRSS(f); len(iv.Violations) != 1 || !strings.Contains(iv.Violations[0], "relay-b reached a peak of 301.0 MB") {
		t.Errorf("over the bound: %q", iv.Violations)
	}
}

// TestCheckVerify_DeletedRowsGaps: verify rightly reports a ledger row or
// a stored message of a row the application deleted (orphaned,
// unrecorded); those of the rows handover-delete deleted are counted, not
// violations — any other gap, or another kind of gap of a deleted row, is.
func TestCheckVerify_DeletedRowsGaps(t *testing.T) {
	out := `{"clean": false, "rows": 3, "gaps": [
		{"kind": "orphaned", "sink": "hook", "count": 2, "first": [{"event_key": "w1-0000007", "detail": "no outbox row with this key"}, {"event_key": "w2-0000001", "detail": "no outbox row with this key"}]},
		{"kind": "unrecorded", "sink": "nats", "count": 1, "first": [{"event_key": "w1-0000007", "detail": "in the stream; no outbox row, no delivered ledger row"}]},
		{"kind": "missing", "sink": "nats", "count": 1, "first": [{"id": 9, "event_key": "w1-0000007", "detail": "done, no delivered ledger row"}]}]}`
	iv := checkVerify([]byte(out), 1, "", map[string]bool{"w1-0000007": true})
	want := []string{"orphaned at hook: row 0 (w2-0000001): no outbox row with this key", "missing at nats: row 9 (w1-0000007): done, no delivered ledger row"}
	if fmt.Sprint(iv.Violations) != fmt.Sprint(want) {
		t.Errorf("violations %q, want %q", iv.Violations, want)
	}
	if !strings.Contains(iv.Checked, "2 gaps of rows handover-delete deleted") {
		t.Errorf("checked %q", iv.Checked)
	}
	only := `{"clean": false, "rows": 3, "gaps": [{"kind": "orphaned", "sink": "hook", "count": 1, "first": [{"event_key": "w1-0000007", "detail": "x"}]}]}`
	if iv := checkVerify([]byte(only), 1, "", map[string]bool{"w1-0000007": true}); !iv.ok() {
		t.Errorf("only a deleted row's gap: %q", iv.Violations)
	}
}
