package main

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// event is a committed outbox row as the table holds it after the run.
type event struct {
	ID        string // the row's id, as text
	Key, Agg  string
	Seq       int64 // within the aggregate, from the payload
	Status    string
	LastError string
}

// delivery is one arrival at a sink, keyed by the event_key in its body.
type delivery struct {
	Index int // arrival order at this sink
	At    time.Duration
	Key   string // the body's event_key ("" when the body does not decode)
	ID    string // webhook-id or Nats-Msg-Id
	Body  string
	OK    bool   // delivered: answered with a 2xx, or stored by the stream
	From  string // the relay that sent it, when the sink tells (the webhook)
}

// sinkRecord is what one sink received.
type sinkRecord struct {
	Name   string // in messages: webhook, nats
	Action string // the ledger's action: the sink's configured name
	// Arrivals are in arrival order; missing events and order are judged on
	// them (the webhook: every request; NATS: the stream's stored copies).
	Arrivals []delivery
	// AckedRepeatsNeedCrash: every arrival after the first OK one must
	// follow a crash (the webhook, whose 2xx the relay receives; the
	// stream's second copies are judged by the duplicate window instead).
	AckedRepeatsNeedCrash bool
	// Extra are further attempts observed (NATS: every publish the tap
	// saw, duplicates the stream dropped included): they must carry the
	// same id and body too.
	Extra []delivery
	// Refused are the events that must never be delivered to this sink:
	// those the sink refused for good (the receiver's 400s of
	// unstorable-reply) and those the relay must refuse unsent (the
	// over-long keys of long-keys). Each must end dead-lettered (failed,
	// with a reason); no other event may.
	Refused map[string]bool
}

// ledgerRow is one row of the idempotency ledger.
type ledgerRow struct{ Key, Action, State string }

// runFacts is everything the invariants are judged on.
type runFacts struct {
	Events  []event
	Written []string // keys the writers saw committed
	// Rewritten are keys a writer wrote again after finding an attempt not
	// committed; Failovers counts the failovers. After a failover such a
	// key may have been delivered as the old primary's row, which its
	// standby never received: the rewritten row has another id and
	// created_at, and the rest of its body the same (see lostInFailover).
	Rewritten map[string]bool
	Failovers int
	Sinks     []sinkRecord
	Ledger    []ledgerRow
	// SideEffects counts, per event_key, the webhook-ids whose side effect
	// the receiver applied (it applies one per webhook-id).
	SideEffects map[string]int
	MaxRetained int64 // bytes of WAL the slot retained, at most
	WALBound    int64
	// PeakRSS is each relay's largest peak resident memory (VmHWM) over its
	// processes, in bytes; RSSBound bounds each.
	PeakRSS  map[string]int64
	RSSBound int64
	// NullStatus are the keys of the rows written with a NULL status, Large
	// those with a large payload (its padding's bytes): events like any
	// other, which must reach both sinks whole.
	NullStatus map[string]bool
	Large      map[string]int
	// LongKeys are long-keys' over-long keys, also in every sink's Refused:
	// they must end failed with a last_error naming the limit, never
	// reach a sink and have no ledger row; Beside are the rows written in
	// the same transactions, which must be delivered.
	LongKeys map[string]bool
	Beside   []string
	// Deleted are the rows handover-delete deleted, with when the DELETE
	// committed: exempt from "must be delivered" (a row delivered before
	// its deletion, or sent from the WAL after it, is fine), but not from
	// order, once and the same id and body where they arrived.
	Deleted map[string]time.Duration
	// WantID is the idempotency id the relay must send for a key; nil
	// checks only that repeats agree with the first copy.
	WantID func(key string) string
	// Crashes are the times of the faults after which the relay may have
	// lost what it knew of an outcome (a killed relay, PostgreSQL gone
	// before a ledger write): the only excuses for a repeat after a 2xx.
	Crashes []time.Duration
	// LockCuts are the lock-cut faults: when the leader's lock session was
	// ended, and which relay led.
	LockCuts []lockCutFact
}

// lockCutFact is one lock-cut fault.
type lockCutFact struct {
	At     time.Duration
	Leader string
}

// lockCutWindow bounds how long a leader whose lock session was ended may
// still send: its next ping (every second) fails at once, and it sends
// nothing from then on (docs/operations-health.md, "a lost lock"); half a
// second more for a request already on its way. lockCutQuiet is how long
// after the cut the old leader cannot lead again (its stand-by pause).
const (
	lockCutWindow = 1500 * time.Millisecond
	lockCutQuiet  = 3 * time.Second
)

// invariant is one checked guarantee.
type invariant struct {
	Name       string
	Checked    string // what was checked, with its figures
	Violations []string
}

func (iv invariant) ok() bool { return len(iv.Violations) == 0 }

// maxListed bounds the violations listed per invariant.
const maxListed = 20

// violations collects an invariant's violations, listing at most maxListed.
type violations struct {
	list []string
	more int
}

func (v *violations) add(format string, args ...any) {
	if len(v.list) < maxListed {
		v.list = append(v.list, fmt.Sprintf(format, args...))
		return
	}
	v.more++
}

func (v *violations) result() []string {
	if v.more > 0 {
		return append(v.list, fmt.Sprintf("… and %d more", v.more))
	}
	return v.list
}

// check judges the run. Every invariant is reported, violated or not.
func check(f runFacts) []invariant {
	byKey := make(map[string]event, len(f.Events))
	for _, e := range f.Events {
		byKey[e.Key] = e
	}
	return []invariant{
		checkWritten(f, byKey),
		checkMissing(f),
		checkLedger(f, byKey),
		checkIdentity(f, byKey),
		checkSideEffects(f),
		checkRepeatCauses(f),
		checkOrder(f),
		checkWAL(f),
		checkRSS(f),
		checkFailed(f),
		checkLockCuts(f),
		checkShapes(f),
		checkLongKeys(f),
	}
}

// checkWritten: the table holds exactly the events the writers committed
// (so "missing" is counted against the truth, unknown commit outcomes
// included).
func checkWritten(f runFacts, byKey map[string]event) invariant {
	var v violations
	written := make(map[string]bool, len(f.Written))
	for _, k := range f.Written {
		written[k] = true
		if _, ok := byKey[k]; !ok {
			v.add("%s: the writer saw it committed, the table does not hold it", k)
		}
	}
	for _, e := range f.Events {
		if !written[e.Key] {
			v.add("%s: in the table, but its writer never saw it committed", e.Key)
		}
	}
	return invariant{Name: "committed events = the writers' record",
		Checked:    fmt.Sprintf("%d rows in the table, %d seen committed by the writers", len(f.Events), len(written)),
		Violations: v.result()}
}

// checkMissing: every committed event reached every sink (a 2xx, a stored
// message) at least once, but the events that must never reach it
// (Refused: dead-lettered instead) and the rows deleted (Deleted: either).
func checkMissing(f runFacts) invariant {
	var v violations
	var counts []string
	for _, s := range f.Sinks {
		ok := map[string]time.Duration{}
		for _, d := range s.Arrivals {
			if _, seen := ok[d.Key]; d.OK && !seen {
				ok[d.Key] = d.At
			}
		}
		missing, refused := 0, 0
		var deleted [3]int // delivered before the deletion, after it, never
		for _, e := range f.Events {
			at, delivered := ok[e.Key]
			if deletedAt, gone := f.Deleted[e.Key]; gone {
				switch {
				case !delivered:
					deleted[2]++
				case at <= deletedAt:
					deleted[0]++
				default:
					deleted[1]++
				}
				continue
			}
			if s.Refused[e.Key] {
				refused++
				switch {
				case delivered:
					v.add("%s: %.60s was refused for good, yet delivered", s.Name, e.Key)
				case e.Status != "failed":
					v.add("%s: %.60s was refused for good, row status %s, want failed", s.Name, e.Key, e.Status)
				}
				continue
			}
			if !delivered {
				missing++
				v.add("%s: %s never delivered (row status %s, last_error %q)", s.Name, e.Key, e.Status, e.LastError)
			}
		}
		c := fmt.Sprintf("%s %d missing", s.Name, missing)
		if refused > 0 {
			c += fmt.Sprintf(" (and %d refused for good, to be dead-lettered)", refused)
		}
		if len(f.Deleted) > 0 {
			c += fmt.Sprintf(" (and %d deleted: %d delivered before their deletion, %d after, %d never)", len(f.Deleted), deleted[0], deleted[1], deleted[2])
		}
		counts = append(counts, c)
	}
	return invariant{Name: "no event missing at any sink",
		Checked:    fmt.Sprintf("%d events × %d sinks: %s", len(f.Events), len(f.Sinks), strings.Join(counts, ", ")),
		Violations: v.result()}
}

// checkLedger: every (event_key, action) has its one delivered ledger row,
// the record of delivery on both paths (docs/operations.md, "what the relay
// writes back"); nothing left sending or unknown, no row for an event that
// does not exist; a pair refused for good has no delivered row; and every
// event no sink refused ends done (its status written in its settlement).
func checkLedger(f runFacts, byKey map[string]event) invariant {
	var v violations
	state := map[string]map[string][]string{} // action → key → states
	for _, r := range f.Ledger {
		if state[r.Action] == nil {
			state[r.Action] = map[string][]string{}
		}
		state[r.Action][r.Key] = append(state[r.Action][r.Key], r.State)
		if _, ok := byKey[r.Key]; !ok {
			v.add("ledger row (%s, %s) for an event the table does not hold", r.Key, r.Action)
		}
	}
	var counts []string
	refused := map[string]bool{}
	for _, s := range f.Sinks {
		delivered, exempt := 0, 0
		for _, e := range f.Events {
			states := state[s.Action][e.Key]
			if _, gone := f.Deleted[e.Key]; gone {
				// Delivered first, or settled without its outcome: at
				// most one row, whatever its state.
				exempt++
				if len(states) > 1 {
					v.add("(%s, %s): deleted, ledger rows %v, want at most one", e.Key, s.Action, states)
				}
				continue
			}
			if s.Refused[e.Key] {
				exempt++
				refused[e.Key] = true
				if slices.Contains(states, "delivered") {
					v.add("(%.60s, %s): refused for good, yet ledger rows %v", e.Key, s.Action, states)
				}
				continue
			}
			switch {
			case len(states) == 1 && states[0] == "delivered":
				delivered++
			case len(states) == 0:
				v.add("(%s, %s): no ledger row", e.Key, s.Action)
			default:
				v.add("(%s, %s): ledger rows %v, want one delivered", e.Key, s.Action, states)
			}
		}
		counts = append(counts, fmt.Sprintf("%s %d/%d", s.Action, delivered, len(f.Events)-exempt))
	}
	done := 0
	for _, e := range f.Events {
		if _, gone := f.Deleted[e.Key]; gone {
			refused[e.Key] = true // no row to be done
		}
		switch {
		case refused[e.Key]:
		case e.Status == "done":
			done++
		default:
			v.add("%s: delivered to every sink, row status %s, want done", e.Key, e.Status)
		}
	}
	return invariant{Name: "each (event_key, action) has one delivered ledger row; delivered rows are done",
		Checked:    fmt.Sprintf("delivered ledger rows per action: %s; rows done %d/%d", strings.Join(counts, ", "), done, len(f.Events)-len(refused)),
		Violations: v.result()}
}

// checkLockCuts: after a lock-cut, the old leader sends nothing once it
// can know (lockCutWindow after the cut) and until it could lead again
// (lockCutQuiet): the only overlap with the relay that takes over is the
// requests in flight when it learnt of the loss.
func checkLockCuts(f runFacts) invariant {
	var v violations
	var notes []string
	for _, c := range f.LockCuts {
		var last time.Duration = -1
		for _, s := range f.Sinks {
			for _, d := range s.Arrivals {
				if d.From != c.Leader || d.At < c.At || d.At > c.At+lockCutQuiet {
					continue
				}
				if d.At > last {
					last = d.At
				}
				if d.At > c.At+lockCutWindow {
					v.add("%s sent %s at %.2f s, %.2f s after its lock session was ended at %.2f s", c.Leader, d.Key, d.At.Seconds(), (d.At - c.At).Seconds(), c.At.Seconds())
				}
			}
		}
		if last >= 0 {
			notes = append(notes, fmt.Sprintf("%s's last request %.2f s after the cut", c.Leader, (last-c.At).Seconds()))
		} else {
			notes = append(notes, fmt.Sprintf("%s sent nothing after the cut", c.Leader))
		}
	}
	checked := fmt.Sprintf("%d lock cuts", len(f.LockCuts))
	if len(notes) > 0 {
		checked += ": " + strings.Join(notes, "; ")
	}
	return invariant{Name: "a leader whose lock is lost sends nothing once it can know", Checked: checked, Violations: v.result()}
}

// checkIdentity: every copy of an event at a sink carries the same
// idempotency id (the one the relay must send) and a byte-identical body.
func checkIdentity(f runFacts, byKey map[string]event) invariant {
	var v violations
	var counts []string
	for _, s := range f.Sinks {
		first := map[string]delivery{}
		var repeats [2]int // of Arrivals, of Extra
		for g, group := range [][]delivery{s.Arrivals, s.Extra} {
			seen := map[string]bool{}
			for _, d := range group {
				if _, ok := byKey[d.Key]; !ok {
					v.add("%s: a delivery whose body names no committed event (event_key %q, id %q): %.120s", s.Name, d.Key, d.ID, d.Body)
					continue
				}
				if seen[d.Key] {
					repeats[g]++
				}
				seen[d.Key] = true
				if f.WantID != nil && d.ID != f.WantID(d.Key) {
					v.add("%s: %s sent with id %q, want %q", s.Name, d.Key, d.ID, f.WantID(d.Key))
				}
				f0, ok := first[d.Key]
				if !ok {
					first[d.Key] = d
					continue
				}
				if d.ID != f0.ID {
					v.add("%s: a repeat of %s carries id %q, the first copy %q", s.Name, d.Key, d.ID, f0.ID)
				}
				if d.Body != f0.Body && !f.sameEventRewritten(d.Key, d.Body, f0.Body) {
					v.add("%s: a repeat of %s has another body:\n    first  %.300s\n    repeat %.300s", s.Name, d.Key, f0.Body, d.Body)
				}
			}
		}
		c := fmt.Sprintf("%s %d repeats", s.Name, repeats[0])
		if len(s.Extra) > 0 {
			c += fmt.Sprintf(" (+%d among other attempts seen)", repeats[1])
		}
		counts = append(counts, c)
	}
	return invariant{Name: "every repeat carries the same idempotency id and body",
		Checked: strings.Join(counts, ", "), Violations: v.result()}
}

// crashSlack is how long before a delivery's 2xx was recorded a crash may
// have happened and still explain a repeat: a request written just before
// the relay died can be read and answered after it.
const crashSlack = time.Second

// checkRepeatCauses: a sink sees a repeat only for an attempt whose outcome
// was unknown (docs/guarantees.md, "at most one delivery"). After a 2xx the relay knows the outcome, so a
// later copy needs a crash in between: one at or after the 2xx (less
// crashSlack) and at or before the copy.
func checkRepeatCauses(f runFacts) invariant {
	var v violations
	var counts []string
	for _, s := range f.Sinks {
		if !s.AckedRepeatsNeedCrash {
			continue
		}
		acked := map[string]time.Duration{}
		explained, unexplained := 0, 0
		for _, d := range s.Arrivals {
			first, ok := acked[d.Key]
			if !ok {
				if d.OK {
					acked[d.Key] = d.At
				}
				continue
			}
			crashed := false
			for _, c := range f.Crashes {
				if c >= first-crashSlack && c <= d.At {
					crashed = true
					break
				}
			}
			if crashed {
				explained++
				continue
			}
			unexplained++
			v.add("%s: %s arrived again at %.2f s after its 2xx at %.2f s, with no crash in between", s.Name, d.Key, d.At.Seconds(), first.Seconds())
		}
		counts = append(counts, fmt.Sprintf("%s: %d repeats after a 2xx, %d of them after a crash", s.Name, explained+unexplained, explained))
	}
	return invariant{Name: "a repeat after a 2xx only follows a crash",
		Checked: strings.Join(counts, "; "), Violations: v.result()}
}

// checkSideEffects: deduplicating by webhook-id, the receiver applied each
// event's side effect exactly once (a repeat with another id would apply it
// twice).
func checkSideEffects(f runFacts) invariant {
	var v violations
	once, refused, deleted := 0, 0, 0
	for _, e := range f.Events {
		if _, gone := f.Deleted[e.Key]; gone {
			deleted++
			if n := f.SideEffects[e.Key]; n > 1 {
				v.add("%s: deleted, its side effect applied %d times", e.Key, n)
			}
			continue
		}
		if f.hookRefused()[e.Key] {
			refused++
			if n := f.SideEffects[e.Key]; n != 0 {
				v.add("%.60s: refused for good, yet its side effect applied %d times", e.Key, n)
			}
			continue
		}
		switch n := f.SideEffects[e.Key]; n {
		case 1:
			once++
		case 0:
			v.add("%s: side effect never applied", e.Key)
		default:
			v.add("%s: side effect applied %d times (once per distinct webhook-id)", e.Key, n)
		}
	}
	checked := fmt.Sprintf("%d of %d events applied once, %d refused for good applied never", once, len(f.Events)-refused-deleted, refused)
	if deleted > 0 {
		checked += fmt.Sprintf(", %d deleted at most once", deleted)
	}
	return invariant{Name: "webhook side effect applied exactly once per event (dedup by webhook-id)",
		Checked: checked, Violations: v.result()}
}

// checkOrder: per sink and aggregate, no event arrives (in any attempt)
// before the aggregate's previous event was delivered; so the first
// deliveries are in sequence order. An event dead-lettered (failed) does not
// hold its successors back, nor does a deleted one that never reached the
// sink; a deleted one that did is judged like any other, whenever it came.
func checkOrder(f runFacts) invariant {
	var v violations
	byAgg := map[string][]event{}
	for _, e := range f.Events {
		byAgg[e.Agg] = append(byAgg[e.Agg], e)
	}
	aggs := make([]string, 0, len(byAgg))
	for a, es := range byAgg {
		aggs = append(aggs, a)
		sort.Slice(es, func(i, j int) bool { return es[i].Seq < es[j].Seq })
	}
	sort.Strings(aggs)
	pairs := 0
	for _, s := range f.Sinks {
		firstAny, firstOK := map[string]int{}, map[string]int{}
		for _, d := range s.Arrivals {
			if _, ok := firstAny[d.Key]; !ok {
				firstAny[d.Key] = d.Index
			}
			if _, ok := firstOK[d.Key]; !ok && d.OK {
				firstOK[d.Key] = d.Index
			}
		}
		for _, a := range aggs {
			es := byAgg[a]
			// prev is the nearest earlier event that holds next back.
			var prev *event
			for i := range es {
				next := &es[i]
				if i > 0 {
					pairs++
				}
				if arrived, ok := firstAny[next.Key]; ok && prev != nil {
					delivered, ok := firstOK[prev.Key]
					switch {
					case !ok:
						v.add("%s: aggregate %s: seq %d (%.60s) arrived but seq %d (%.60s) was never delivered", s.Name, a, next.Seq, next.Key, prev.Seq, prev.Key)
					case arrived < delivered:
						v.add("%s: aggregate %s: seq %d (%.60s) arrived (#%d) before seq %d (%.60s) was delivered (#%d)", s.Name, a, next.Seq, next.Key, arrived, prev.Seq, prev.Key, delivered)
					}
				}
				_, delivered := firstOK[next.Key]
				if _, gone := f.Deleted[next.Key]; next.Status == "failed" || gone && !delivered {
					continue
				}
				prev = next
			}
		}
	}
	return invariant{Name: "per-aggregate order",
		Checked: fmt.Sprintf("%d aggregates, %d consecutive pairs over %d sinks", len(aggs), pairs, len(f.Sinks)), Violations: v.result()}
}

// checkWAL: the WAL the slot retained stayed under the bound.
func checkWAL(f runFacts) invariant {
	var v violations
	if f.MaxRetained > f.WALBound {
		v.add("the slot retained %s of WAL, over the %s bound", mb(f.MaxRetained), mb(f.WALBound))
	}
	return invariant{Name: "retained WAL bounded",
		Checked: fmt.Sprintf("max %s ≤ %s", mb(f.MaxRetained), mb(f.WALBound)), Violations: v.result()}
}

// checkRSS: no relay's peak memory passed the bound, large payloads among
// the load (docs/guarantees.md, "Memory bounded by bytes"; settle-lock and
// backpressure-drop stop decoding rather than buffer).
func checkRSS(f runFacts) invariant {
	var v violations
	names := make([]string, 0, len(f.PeakRSS))
	for name := range f.PeakRSS {
		names = append(names, name)
	}
	sort.Strings(names)
	var peaks []string
	for _, name := range names {
		peak := f.PeakRSS[name]
		peaks = append(peaks, fmt.Sprintf("%s %s", name, mb(peak)))
		if peak > f.RSSBound {
			v.add("%s reached a peak of %s of resident memory, over the %s bound", name, mb(peak), mb(f.RSSBound))
		}
	}
	checked := fmt.Sprintf("peak RSS (VmHWM) %s, each ≤ %s", strings.Join(peaks, ", "), mb(f.RSSBound))
	if len(f.Large) > 0 {
		lo, hi := largeSpan(f.Large)
		checked += fmt.Sprintf(", with %d large payloads of %d–%d KiB among the load", len(f.Large), lo>>10, hi>>10)
	}
	return invariant{Name: "relay memory bounded", Checked: checked, Violations: v.result()}
}

// checkFailed: every dead-lettered row says why, and only the events a
// sink refused for good are dead-lettered (checkMissing sees that each of
// those is).
func checkFailed(f runFacts) invariant {
	var v violations
	failed, example := 0, ""
	for _, e := range f.Events {
		if e.Status != "failed" {
			continue
		}
		failed++
		if example == "" {
			example = e.LastError
		}
		if strings.TrimSpace(e.LastError) == "" {
			v.add("%.60s: failed without a last_error", e.Key)
		}
		refused := false
		for _, s := range f.Sinks {
			refused = refused || s.Refused[e.Key]
		}
		if !refused {
			v.add("%s: failed, but no sink refused it for good (last_error %q)", e.Key, e.LastError)
		}
	}
	checked := fmt.Sprintf("%d failed rows", failed)
	if example != "" {
		checked += fmt.Sprintf(", e.g. last_error %.100q", example)
	}
	return invariant{Name: "every failed row has a reason; only refused events failed",
		Checked: checked, Violations: v.result()}
}

// sameEventRewritten reports whether two bodies of key may differ because
// its first commit was lost in a failover and its writer wrote it again:
// only their id and created_at differ.
func (f runFacts) sameEventRewritten(key, a, b string) bool {
	if f.Failovers == 0 || !f.Rewritten[key] {
		return false
	}
	strip := func(body string) (string, bool) {
		var m map[string]json.RawMessage
		if json.Unmarshal([]byte(body), &m) != nil {
			return "", false
		}
		delete(m, "id")
		delete(m, "created_at")
		out, err := json.Marshal(m)
		return string(out), err == nil
	}
	x, okA := strip(a)
	y, okB := strip(b)
	return okA && okB && x == y
}

// lostInFailover counts the events a sink received as a row the new
// primary does not hold: a body with the key of a rewritten event but
// another id (the old primary's row, delivered before the failover lost
// it). PostgreSQL 17's synchronized_standby_slots makes that 0; before 17
// the walsender may send a commit its synchronous standby has not yet
// confirmed.
func (f runFacts) lostInFailover() int {
	if f.Failovers == 0 {
		return 0
	}
	idOf := map[string]string{}
	for _, e := range f.Events {
		if f.Rewritten[e.Key] {
			idOf[e.Key] = e.ID
		}
	}
	lost := map[string]bool{}
	for _, s := range f.Sinks {
		for _, group := range [][]delivery{s.Arrivals, s.Extra} {
			for _, d := range group {
				id, ok := idOf[d.Key]
				if !ok {
					continue
				}
				var env struct {
					ID json.Number `json:"id"`
				}
				if json.Unmarshal([]byte(d.Body), &env) == nil && env.ID.String() != id {
					lost[d.Key] = true
				}
			}
		}
	}
	return len(lost)
}

// hookRefused is the webhook's Refused set (side effects are the
// webhook's).
func (f runFacts) hookRefused() map[string]bool {
	for _, s := range f.Sinks {
		if s.Name == "webhook" {
			return s.Refused
		}
	}
	return nil
}

// mb formats bytes as MiB.
func mb(b int64) string { return fmt.Sprintf("%.1f MB", float64(b)/(1<<20)) }
