package main

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// goodRun is a run every invariant accepts: two aggregates, three events,
// each delivered once to both sinks in order, one webhook repeat with the
// same id and body after a failed attempt, and one after a crash.
func goodRun() runFacts {
	events := []event{
		{Key: "k1", Agg: "a", Seq: 1, Status: "done"},
		{Key: "k2", Agg: "a", Seq: 2, Status: "done"},
		{Key: "k3", Agg: "b", Seq: 1, Status: "done"},
	}
	body := func(k string) string { return fmt.Sprintf(`{"id":1,"event_key":%q}`, k) }
	deliver := func(keys ...string) []delivery {
		var ds []delivery
		for i, k := range keys {
			ok := !strings.HasSuffix(k, "?")
			k = strings.TrimSuffix(k, "?")
			ds = append(ds, delivery{Index: i, At: time.Duration(i) * time.Second, Key: k, ID: k, Body: body(k), OK: ok})
		}
		return ds
	}
	var ledger []ledgerRow
	for _, e := range events {
		ledger = append(ledger, ledgerRow{e.Key, "nats", "delivered"}, ledgerRow{e.Key, "hook", "delivered"})
	}
	return runFacts{
		Events:  events,
		Written: []string{"k1", "k2", "k3"},
		Sinks: []sinkRecord{
			{Name: "nats", Action: "nats", Arrivals: deliver("k3", "k1", "k2"), Extra: deliver("k3", "k1", "k1", "k2")},
			{Name: "webhook", Action: "hook", Arrivals: deliver("k1?", "k1", "k3", "k2", "k2"), AckedRepeatsNeedCrash: true},
		},
		Crashes:     []time.Duration{3500 * time.Millisecond}, // between k2's 2xx (3 s) and its repeat (4 s)
		Ledger:      ledger,
		SideEffects: map[string]int{"k1": 1, "k2": 1, "k3": 1},
		MaxRetained: 10 << 20,
		WALBound:    256 << 20,
		WantID:      func(k string) string { return k },
	}
}

// failures returns the violations per invariant name.
func failures(f runFacts) map[string][]string {
	out := map[string][]string{}
	for _, iv := range check(f) {
		if !iv.ok() {
			out[iv.Name] = iv.Violations
		}
	}
	return out
}

func TestCheck_GoodRunPasses(t *testing.T) {
	if got := failures(goodRun()); len(got) != 0 {
		t.Fatalf("a good run fails: %v", got)
	}
}

// refuseK3 makes k3 an event the webhook refused for good (unstorable-reply)
// and the relay dead-lettered: every webhook attempt answered 400, no hook
// ledger row, no side effect, status failed with a reason.
func refuseK3(f *runFacts) {
	w := &f.Sinks[1]
	w.Refused = map[string]bool{"k3": true}
	for i := range w.Arrivals {
		if w.Arrivals[i].Key == "k3" {
			w.Arrivals[i].OK = false
		}
	}
	var ledger []ledgerRow
	for _, r := range f.Ledger {
		if r.Key != "k3" || r.Action != "hook" {
			ledger = append(ledger, r)
		}
	}
	f.Ledger = ledger
	delete(f.SideEffects, "k3")
	f.Events[2].Status, f.Events[2].LastError = "failed", "hook: permanent status 400: ..."
}

// TestCheck_RefusedEventsDeadLetteredPass: events a sink refused for good
// are expected failed, not missing, and hold nothing back.
func TestCheck_RefusedEventsDeadLetteredPass(t *testing.T) {
	f := goodRun()
	refuseK3(&f)
	if got := failures(f); len(got) != 0 {
		t.Fatalf("a run whose refused event was dead-lettered fails: %v", got)
	}
}

// TestCheck_ReportsEachViolation: each kind of broken run is reported by
// the invariant that guards against it, with the event named.
func TestCheck_ReportsEachViolation(t *testing.T) {
	webhook := func(f *runFacts) *sinkRecord { return &f.Sinks[1] }
	nats := func(f *runFacts) *sinkRecord { return &f.Sinks[0] }
	for _, c := range []struct {
		name      string
		breakIt   func(f *runFacts)
		invariant string
		mention   string
	}{
		{"missing at the webhook", func(f *runFacts) {
			w := webhook(f)
			w.Arrivals = w.Arrivals[:3] // k2 never arrives
		}, "no event missing at any sink", "webhook: k2 never delivered"},
		{"missing at NATS: only a failed attempt", func(f *runFacts) {
			n := nats(f)
			n.Arrivals[0].OK = false
		}, "no event missing at any sink", "nats: k3 never delivered"},
		{"repeat with a different id", func(f *runFacts) {
			w := webhook(f)
			w.Arrivals[4].ID = "k2-retry"
		}, "every repeat carries the same idempotency id and body", `carries id "k2-retry"`},
		{"first copy with the wrong id", func(f *runFacts) {
			nats(f).Arrivals[0].ID = "k1"
		}, "every repeat carries the same idempotency id and body", `k3 sent with id "k1"`},
		{"repeat with another body", func(f *runFacts) {
			nats(f).Extra[2].Body = `{"id":1,"event_key":"k1","x":2}`
		}, "every repeat carries the same idempotency id and body", "a repeat of k1 has another body"},
		{"a body naming an unknown event", func(f *runFacts) {
			w := webhook(f)
			w.Arrivals = append(w.Arrivals, delivery{Index: 5, Key: "k9", ID: "k9", Body: `{"event_key":"k9"}`, OK: true})
		}, "every repeat carries the same idempotency id and body", `event_key "k9"`},
		{"out of order at NATS", func(f *runFacts) {
			n := nats(f)
			n.Arrivals[1].Index, n.Arrivals[2].Index = 2, 1 // k2 stored before k1
		}, "per-aggregate order", "nats: aggregate a: seq 2 (k2) arrived (#1) before seq 1 (k1) was delivered (#2)"},
		{"sent while its predecessor was being retried", func(f *runFacts) {
			w := webhook(f)
			// k2 attempted between k1's failed attempt and its delivery.
			w.Arrivals = []delivery{w.Arrivals[0], {Index: 1, Key: "k2", ID: "k2", Body: w.Arrivals[3].Body}, w.Arrivals[1], w.Arrivals[2], w.Arrivals[3]}
			w.Arrivals[2].Index, w.Arrivals[3].Index, w.Arrivals[4].Index = 2, 3, 4
		}, "per-aggregate order", "webhook: aggregate a: seq 2 (k2) arrived (#1) before seq 1 (k1) was delivered (#2)"},
		{"repeat after a 2xx without a crash", func(f *runFacts) {
			f.Crashes = []time.Duration{1500 * time.Millisecond, 4500 * time.Millisecond} // before the 2xx, after the repeat
		}, "a repeat after a 2xx only follows a crash", "k2 arrived again at 4.00 s after its 2xx at 3.00 s"},
		{"two ledger rows' worth: one unknown", func(f *runFacts) {
			f.Ledger[3].State = "unknown"
		}, "each (event_key, action) has one delivered ledger row; delivered rows are done", "(k2, hook): ledger rows [unknown]"},
		{"no ledger row", func(f *runFacts) {
			f.Ledger = f.Ledger[1:]
		}, "each (event_key, action) has one delivered ledger row; delivered rows are done", "(k1, nats): no ledger row"},
		{"delivered, row left pending", func(f *runFacts) {
			f.Events[1].Status = "pending"
		}, "each (event_key, action) has one delivered ledger row; delivered rows are done", "k2: delivered to every sink, row status pending, want done"},
		{"the old leader sends after its lock was lost", func(f *runFacts) {
			// Arrivals at 0-4 s; the leader's lock cut at 1 s: k2 at 3 s is
			// 2 s later, past the window.
			f.LockCuts = []lockCutFact{{At: time.Second, Leader: "relay-a"}}
			for i := range f.Sinks[1].Arrivals {
				f.Sinks[1].Arrivals[i].From = "relay-a"
			}
		}, "a leader whose lock is lost sends nothing once it can know", "relay-a sent k2 at 3.00 s, 2.00 s after its lock session was ended at 1.00 s"},
		{"another relay sends after the cut", func(f *runFacts) {
			f.LockCuts = []lockCutFact{{At: time.Second, Leader: "relay-a"}}
			for i := range f.Sinks[1].Arrivals {
				f.Sinks[1].Arrivals[i].From = "relay-b"
			}
		}, "", ""},
		{"side effect applied twice", func(f *runFacts) {
			f.SideEffects["k3"] = 2
		}, "webhook side effect applied exactly once per event (dedup by webhook-id)", "k3: side effect applied 2 times"},
		{"retained WAL over the bound", func(f *runFacts) {
			f.MaxRetained = 300 << 20
		}, "retained WAL bounded", "over the 256.0 MB bound"},
		{"failed without a reason", func(f *runFacts) {
			f.Events[2].Status = "failed"
		}, "every failed row has a reason; only refused events failed", "k3: failed without a last_error"},
		{"failed without being refused", func(f *runFacts) {
			f.Events[2].Status, f.Events[2].LastError = "failed", "hook: timeout"
		}, "every failed row has a reason; only refused events failed", "k3: failed, but no sink refused it for good"},
		{"refused but not dead-lettered", func(f *runFacts) {
			refuseK3(f)
			f.Events[2].Status = "pending"
		}, "no event missing at any sink", "k3 was refused for good, row status pending, want failed"},
		{"refused, yet a delivered ledger row", func(f *runFacts) {
			refuseK3(f)
			f.Ledger = append(f.Ledger, ledgerRow{"k3", "hook", "delivered"})
		}, "each (event_key, action) has one delivered ledger row; delivered rows are done", "(k3, hook): refused for good, yet ledger rows [delivered]"},
		{"refused, yet its side effect applied", func(f *runFacts) {
			refuseK3(f)
			f.SideEffects["k3"] = 1
		}, "webhook side effect applied exactly once per event (dedup by webhook-id)", "k3: refused for good, yet its side effect applied 1 times"},
		{"a commit the table lost", func(f *runFacts) {
			f.Written = append(f.Written, "k4")
		}, "committed events = the writers' record", "k4: the writer saw it committed"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := goodRun()
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

func TestCheck_FailedEventDoesNotHoldItsAggregate(t *testing.T) {
	f := goodRun()
	f.Events[0].Status, f.Events[0].LastError = "failed", "webhook: 422"
	w := &f.Sinks[1]
	w.Arrivals = []delivery{w.Arrivals[0], w.Arrivals[2], w.Arrivals[3]} // k1 only failed
	got := failures(f)
	if _, bad := got["per-aggregate order"]; bad {
		t.Fatalf("a dead-lettered predecessor counted as an order violation: %v", got)
	}
	if vs := got["no event missing at any sink"]; len(vs) != 1 || !strings.Contains(vs[0], `k1 never delivered (row status failed, last_error "webhook: 422")`) {
		t.Fatalf("missing: %v", vs)
	}
}

func TestCheck_ListsAtMostTwentyPerInvariant(t *testing.T) {
	f := goodRun()
	for i := range 50 {
		f.Written = append(f.Written, fmt.Sprintf("lost-%d", i))
	}
	vs := failures(f)["committed events = the writers' record"]
	if len(vs) != maxListed+1 || vs[maxListed] != "… and 30 more" {
		t.Fatalf("got %d lines, last %q", len(vs), vs[len(vs)-1])
	}
}

func TestComputeRecoveries(t *testing.T) {
	s := time.Second
	events := []committedEvent{{key: "old", at: 1 * s}, {key: "new1", at: 12 * s}, {key: "new2", at: 13 * s}}
	sinks := []sinkRecord{
		{Arrivals: []delivery{{Key: "old", At: 14 * s, OK: true}, {Key: "new1", At: 15 * s, OK: true}, {Key: "new2", At: 13500 * time.Millisecond, OK: true}}},
		{Arrivals: []delivery{{Key: "old", At: 11 * s, OK: false}, {Key: "old", At: 16 * s, OK: true}, {Key: "new1", At: 12500 * time.Millisecond, OK: true}, {Key: "new2", At: 14 * s, OK: true}}},
	}
	faults := []faultRecord{{healed: 10 * s}, {healed: 20 * s}}
	computeRecoveries(faults, events, sinks, nil)
	if faults[0].firstNew != 4*s || faults[0].drained != 6*s {
		t.Errorf("fault 1: first new %v, drained %v; want 4s, 6s", faults[0].firstNew, faults[0].drained)
	}
	if faults[1].firstNew != -1 || faults[1].drained != 0 {
		t.Errorf("fault 2: first new %v, drained %v; want never, 0", faults[1].firstNew, faults[1].drained)
	}
	sinks[1].Arrivals = sinks[1].Arrivals[:1] // "old" never delivered to sink 2
	computeRecoveries(faults, events, sinks, nil)
	if faults[0].drained != -1 {
		t.Errorf("drained %v with an event never delivered, want never", faults[0].drained)
	}
	// An event a sink refused for good is not waited for.
	sinks[1].Arrivals = append(sinks[1].Arrivals, delivery{Key: "new1", At: 12500 * time.Millisecond, OK: true})
	computeRecoveries(faults, events, sinks, map[string]bool{"old": true})
	if faults[0].drained != 0 || faults[0].firstNew != 5*s {
		t.Errorf("with the undelivered event refused: first new %v, drained %v; want 5s, 0", faults[0].firstNew, faults[0].drained)
	}
}

// TestSchedule_DeterministicEveryKindEachCycle: a seed gives one schedule;
// every cycle injects each kind (relay-kill p.kills times) and one more
// fault during its webhook outage, the slot drop in cycle 1.
func TestSchedule_DeterministicEveryKindEachCycle(t *testing.T) {
	p := profiles["full"]
	a, b := schedule(p, 7), schedule(p, 7)
	if describe(a) != describe(b) {
		t.Fatalf("same seed, different schedules:\n%s\n%s", describe(a), describe(b))
	}
	if describe(a) == describe(schedule(p, 8)) {
		t.Fatal("seeds 7 and 8 gave the same schedule")
	}
	n := map[faultKind]int{}
	for _, st := range a {
		n[st.kind]++
		if st.kind == webhookOutage && st.cycle == 0 && st.during != slotDrop {
			t.Errorf("cycle 1's outage injects %q during it, want %s", st.during, slotDrop)
		}
	}
	for _, st := range a {
		if st.during != "" {
			n[st.during]++
		}
	}
	for _, k := range faultKinds {
		want := p.cycles
		if k == relayKill {
			want *= p.kills
		}
		for c := range p.cycles {
			if duringOutage[c%len(duringOutage)] == k {
				want++
			}
		}
		if n[k] != want {
			t.Errorf("%s: %d in the schedule, want %d", k, n[k], want)
		}
	}
}

// TestCheck_EventLostInFailover: k2's first commit reached the sinks from
// the old primary (id 1), was lost with it, and its writer wrote it again
// (id 7); the sinks saw both rows under one key and id. After a failover
// that is a rewritten event, counted, not a violation; without a failover,
// or for a key no writer wrote again, or with another payload, it is.
func TestCheck_EventLostInFailover(t *testing.T) {
	lostRun := func() runFacts {
		f := goodRun()
		f.Events[1].ID = "7"
		rewritten := `{"id":7,"event_key":"k2","created_at":"2026-12-03T20:00:01.000000Z"}`
		for i := range f.Sinks {
			s := &f.Sinks[i]
			for j := range s.Arrivals {
				if s.Arrivals[j].Key == "k2" {
					s.Arrivals[j].Body = `{"id":1,"event_key":"k2","created_at":"2026-12-03T20:00:00.000000Z"}`
				}
			}
			s.Arrivals = append(s.Arrivals, delivery{Index: len(s.Arrivals), At: 5 * time.Second, Key: "k2", ID: "k2", Body: rewritten, OK: true})
			s.Extra = nil
		}
		f.Crashes = append(f.Crashes, 4500*time.Millisecond)
		f.Rewritten = map[string]bool{"k2": true}
		f.Failovers = 1
		return f
	}
	f := lostRun()
	if got := failures(f); len(got) != 0 {
		t.Fatalf("an event lost in a failover and written again fails the run: %v", got)
	}
	if n := f.lostInFailover(); n != 1 {
		t.Errorf("lostInFailover = %d, want 1", n)
	}

	noFailover := lostRun()
	noFailover.Failovers = 0
	if got := failures(noFailover)["every repeat carries the same idempotency id and body"]; len(got) == 0 {
		t.Error("two bodies for k2 without a failover pass")
	}
	notRewritten := lostRun()
	notRewritten.Rewritten = nil
	if got := failures(notRewritten)["every repeat carries the same idempotency id and body"]; len(got) == 0 {
		t.Error("two bodies for a key no writer wrote again pass")
	}
	otherPayload := lostRun()
	last := &otherPayload.Sinks[1].Arrivals[len(otherPayload.Sinks[1].Arrivals)-1]
	last.Body = `{"id":7,"event_key":"k2","payload":{"seq":9},"created_at":"2026-12-03T20:00:01.000000Z"}`
	if got := failures(otherPayload)["every repeat carries the same idempotency id and body"]; len(got) == 0 {
		t.Error("a rewritten event with another payload passes")
	}
}

// checkVerify reads verify's JSON: clean passes; each gap listed is a
// violation naming its kind, sink and row; a verify that could not run or
// printed no JSON is one too.
func TestCheckVerify(t *testing.T) {
	clean := `{"clean": true, "rows": 3, "sinks": [{"sink": "nats", "routed": 3, "delivered": 3, "stream": {"read": 3, "repeats": 1}}], "gaps": []}`
	if iv := checkVerify([]byte(clean), 0, "", nil); !iv.ok() || !strings.Contains(iv.Checked, "nats 3/3 delivered (stream: 3 copies read, 1 repeats") {
		t.Errorf("a clean answer: %+v", iv)
	}
	gaps := `{"clean": false, "rows": 3, "gaps": [
		{"kind": "missing", "sink": "hook", "count": 2, "first": [{"id": 7, "event_key": "k7", "detail": "row done, no delivered ledger row"}]},
		{"kind": "stuck", "count": 1, "first": [{"id": 9, "event_key": "k9", "detail": "pending, due 1m0s ago"}]}]}`
	iv := checkVerify([]byte(gaps), 1, "outbox-relay: verify found 3 gaps", nil)
	want := []string{"missing at hook: row 7 (k7): row done, no delivered ledger row", "missing at hook: 1 more", "stuck: row 9 (k9): pending, due 1m0s ago"}
	if fmt.Sprint(iv.Violations) != fmt.Sprint(want) {
		t.Errorf("gaps: %q, want %q", iv.Violations, want)
	}
	for _, c := range []struct {
		out  string
		code int
	}{{"", 2}, {"not json", 1}, {`{"clean": true, "gaps": []}`, 1}, {`{"clean": false, "gaps": []}`, 0}, {"", -1}} {
		if iv := checkVerify([]byte(c.out), c.code, "boom", nil); iv.ok() {
			t.Errorf("exit %d, %q: no violation", c.code, c.out)
		}
	}
}
