package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestLostLock_NothingSentOnceTheLeaderKnows: leader A has 40 events of one
// aggregate queued in its webhook lane (200 ms each) and a claim-path row
// in flight (an 8 s answer) when its lock session is terminated; B takes
// over and streams the same events again. A stops sending the moment it
// knows the lock is gone (its next ping, within a second): A begins no
// request after it has halted — the queue is not worked off during its
// drain, nor while its claim path waits for the row in flight. The moment
// it halted is A's own record (its log line, written once Halt returned);
// A's requests of the one aggregate go one at a time, each begun only after
// the one before was answered, so a request whose predecessor was answered
// after that moment was begun after it: no tolerance for load is needed.
// The window in which A could not know yet, from the cut to its log line,
// is measured. Before, A kept sending queued events for seconds while B
// sent the same.
func TestLostLock_NothingSentOnceTheLeaderKnows(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	// A hot event is answered no sooner than hotAnswer after it arrived.
	const hotAnswer = 200 * time.Millisecond
	s.hook.setReply(func(d delivery) int {
		switch {
		case d.EventKey == "claim-slow":
			time.Sleep(8 * time.Second)
		case strings.HasPrefix(d.EventKey, "hot-"):
			time.Sleep(hotAnswer)
		}
		return 204
	})
	var logA, logB syncBuffer
	s.startProcess(t, s.relayConfig(t, "A", s.url), &logA)
	s.waitSlot(t)
	s.startProcess(t, s.relayConfig(t, "B", s.url), &logB)
	eventually(t, 10*time.Second, "B standing by", func() bool { return strings.Contains(logB.String(), "standing by") })

	ctx := context.Background()
	if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, handoff_at, available_at)
		VALUES ('order.placed', 'order', 'slow', 'claim-slow', '{}', now(), now())`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		SELECT 'order.placed', 'order', 'hot', 'hot-' || g, '{}' FROM generate_series(1, 40) g`); err != nil {
		t.Fatal(err)
	}
	fromA := func() int {
		n := 0
		for _, d := range s.hook.deliveries() {
			if d.From == "A" && strings.HasPrefix(d.EventKey, "hot-") {
				n++
			}
		}
		return n
	}
	eventually(t, 30*time.Second, "A delivering the queue", func() bool { return fromA() >= 2 })
	if n := s.scalar(t, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'outbox-relay leader outbox_relay'
		AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)`); n != 1 {
		t.Fatalf("terminated %d leader lock sessions, want 1", n)
	}
	cut := time.Now()
	eventually(t, 10*time.Second, "A to log the lost lock", func() bool { return strings.Contains(logA.String(), "lost the leader lock") })
	knew := logTime(t, logA.String(), "lost the leader lock")
	if knew.IsZero() {
		t.Fatal("no time on A's log line of the lost lock")
	}
	const haltedMsg = "the engine is halted, nothing more is sent"
	eventually(t, 10*time.Second, "A to log its halt", func() bool { return strings.Contains(logA.String(), haltedMsg) })
	halted := logTime(t, logA.String(), haltedMsg)
	if halted.IsZero() {
		t.Fatal("no time on A's log line of its halt")
	}
	// The log's time is truncated to the millisecond: A had halted by the
	// end of that millisecond.
	halted = halted.Add(time.Millisecond)

	keys := map[string]bool{"claim-slow": true}
	for i := 1; i <= 40; i++ {
		keys[fmt.Sprint("hot-", i)] = true
	}
	s.waitAllDelivered(t, 90*time.Second, keys)
	var lastA time.Time
	byBoth := 0
	sentBy := map[string]map[string]bool{}
	var prevA *delivery // A's previous request of the hot aggregate
	for _, d := range s.hook.deliveries() {
		if sentBy[d.EventKey] == nil {
			sentBy[d.EventKey] = map[string]bool{}
		}
		sentBy[d.EventKey][d.From] = true
		if d.From != "A" || !strings.HasPrefix(d.EventKey, "hot-") {
			continue
		}
		lastA = d.At
		// d was begun after prevA's answer, which came no sooner than
		// hotAnswer after prevA arrived.
		if prevA != nil && prevA.At.Add(hotAnswer).After(halted) {
			t.Errorf("A sent %s (arrived %s) after it halted at %s: the request before it, %s, was answered %v after the halt at the earliest",
				d.EventKey, d.At.Format("15:04:05.000"), halted.Format("15:04:05.000"), prevA.EventKey, prevA.At.Add(hotAnswer).Sub(halted).Round(time.Millisecond))
		}
		prevA = &d
	}
	// B reads the ledger for the whole queue when it takes it from the
	// stream, once it holds the lock; A does not know yet and goes on for
	// up to a ping. So an event may reach the webhook from both only if A's
	// request began in that window — from shortly before the cut (a request
	// answered then, its delivery not yet settled) to when A knew — or it
	// was the claim-path row, in flight at A and cancelled. A repeat of an
	// event A had sent earlier would be B missing a settled delivery.
	windowFrom := cut.Add(-time.Second)
	for key, by := range sentBy {
		if !by["A"] || !by["B"] {
			continue
		}
		byBoth++
		for _, d := range s.hook.deliveries() {
			if d.EventKey != key {
				continue
			}
			t.Logf("%s sent by %s at %s (%v after the cut)", key, d.From, d.At.Format("15:04:05.000"), d.At.Sub(cut).Round(time.Millisecond))
			if d.From == "A" && key != "claim-slow" && d.At.Before(windowFrom) {
				t.Errorf("%s: A sent it at %s, %v before the cut, and B sent it again: B missed a delivery A had settled",
					key, d.At.Format("15:04:05.000"), cut.Sub(d.At).Round(time.Millisecond))
			}
		}
	}
	t.Logf("lock cut at %s; A knew %v later; A's last request %v after the cut; %d events delivered by both (sent by A before it knew, then by B)",
		cut.Format("15:04:05.000"), knew.Sub(cut).Round(time.Millisecond), lastA.Sub(cut).Round(time.Millisecond), byBoth)
	if w := knew.Sub(cut); w > 3*time.Second {
		t.Errorf("A learnt of the lost lock %v after the cut, want within its ping interval and timeout (3 s)", w)
	}
}
