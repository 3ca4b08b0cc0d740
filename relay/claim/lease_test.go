package claim_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// strand marks key as claimed by owner: the row 'processing' since
// lockedAgo, and a 'sending' ledger claim of sink.
func strand(tb testing.TB, f *fixture, key, owner, sink string, lockedAgo time.Duration) {
	tb.Helper()
	f.MustExec(tb, `UPDATE integration_outbox SET status = 'processing', locked_by = $2,
		locked_at = now() - $3::bigint * interval '1 millisecond' WHERE event_key = $1`, key, owner, lockedAgo.Milliseconds())
	f.MustExec(tb, `INSERT INTO integration_idempotency (event_key, action, state, attempts, owner, claimed_at)
		VALUES ($1, $2, 'sending', 1, $3, now() - $4::bigint * interval '1 millisecond')`, key, sink, owner, lockedAgo.Milliseconds())
}

// A dead owner's rows come back when their lease passes, and its 'sending'
// claims are taken over as unknown outcomes: sent again to a retry sink,
// held for a hold sink.
func TestLeaseExpiryTakesOverDeadOwner(t *testing.T) {
	const lease = 2 * time.Second
	for _, tc := range []struct {
		name string
		hold bool
	}{{"retry sink sends again", false}, {"hold sink holds", true}} {
		t.Run(tc.name, func(t *testing.T) {
			f := MustFixture(t)
			f.MustInsert(t, event{Key: "k1", AggType: "order", AggID: "A", Diverted: true},
				event{Key: "k2", AggType: "order", AggID: "B", Diverted: true})
			// 'dead' is not a relay owner id: only the lease frees its rows.
			strand(t, f, "k1", "dead", "a", 0)
			f.MustExec(t, `UPDATE integration_outbox SET status = 'processing', locked_by = 'dead', locked_at = now()
				WHERE event_key = 'k2'`)
			a := newFakeSink("a", nil)
			start := time.Now()
			c := MustStart(t, f, options{Routes: []relay.Route{{Sink: a, Hold: tc.hold}}, LockTimeout: lease,
				PollInterval: 100 * time.Millisecond})

			want := "done"
			if tc.hold {
				want = "held"
			}
			waitFor(t, 10*time.Second, "k1 "+want+" and k2 done", func() bool {
				return f.MustRow(t, "k1").Status == want && f.MustRow(t, "k2").Status == "done"
			})
			took := time.Since(start)
			t.Logf("taken over after %s (lease %s)", took.Round(time.Millisecond), lease)
			if took < lease {
				t.Errorf("taken over after %s, before the lease of %s passed", took, lease)
			}
			pair := f.MustLedger(t)[relay.LedgerKey{EventKey: "k1", Action: "a"}]
			sent := a.Delivered()
			if tc.hold {
				if pair.State != "unknown" || pair.Detail == nil || !strings.Contains(*pair.Detail, "dead") {
					t.Errorf("ledger pair %+v (detail %s), want unknown naming the old owner", pair, deref(pair.Detail))
				}
				if sent["k1"] != 0 {
					t.Errorf("a hold sink was sent an event whose outcome is unknown")
				}
				if r := f.MustRow(t, "k1"); r.LastError == nil || !strings.Contains(*r.LastError, "outcome unknown") {
					t.Errorf("last_error %s", deref(r.LastError))
				}
			} else {
				if pair.State != "delivered" || pair.Attempts != 2 {
					t.Errorf("ledger pair %+v, want delivered on the second claim", pair)
				}
				if sent["k1"] != 1 {
					t.Errorf("k1 sent %d times, want once more", sent["k1"])
				}
			}
			if sent["k2"] != 1 {
				t.Errorf("k2 sent %d times, want once", sent["k2"])
			}
			// The source counts the leases its sweeper returned; the ledger
			// claim taken over is no longer counted there (the engine takes
			// it over in PrepareClaim and logs it): the pair's attempts and
			// detail above show it.
			if got := c.Stats.TakenOver.Load(); got != 2 {
				t.Errorf("Stats.TakenOver = %d, want 2 (two leases)", got)
			}
		})
	}
}

// A relay owner whose owner lock is free is gone: its rows and claims are
// taken over at once, long before the lease. A live owner (lock held) keeps
// both, and a row whose pair it is sending waits without an attempt.
func TestGoneOwnerIsTakenOverBeforeItsLease(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "ghost-row", AggType: "order", AggID: "A", Diverted: true},
		event{Key: "alive-row", AggType: "order", AggID: "B", Diverted: true},
		event{Key: "alive-pair", AggType: "order", AggID: "C", Diverted: true})
	const ghost, alive = ledger.OwnerPrefix + "ghost", ledger.OwnerPrefix + "alive"
	strand(t, f, "ghost-row", ghost, "a", 0)
	strand(t, f, "alive-row", alive, "a", 0)
	f.MustExec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, owner, claimed_at)
		VALUES ('alive-pair', 'a', 'sending', 1, $1, now())`, alive)

	// The live owner's lock, held the way a claim source holds it.
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, f.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1, hashtext($2))`, int32(ledger.OwnerLockClass), alive); err != nil {
		t.Fatal(err)
	}

	a := newFakeSink("a", nil)
	start := time.Now()
	c := MustStart(t, f, options{Routes: routes(a), LockTimeout: time.Minute, PollInterval: 100 * time.Millisecond})
	waitFor(t, 5*time.Second, "the gone owner's row done", func() bool { return f.MustRow(t, "ghost-row").Status == "done" })
	t.Logf("gone owner's row delivered %s after start (lease 1m)", time.Since(start).Round(time.Millisecond))

	// The source's own lock, by the documented key.
	if n := f.MustInt(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2
		AND classid = $1 AND objid = hashtext($2)::oid`, int64(ledger.OwnerLockClass), c.Owner()); n != 1 {
		t.Errorf("owner lock of %s not in pg_locks", c.Owner())
	}

	time.Sleep(1500 * time.Millisecond) // more sweeps and claims
	rows := f.MustRows(t)
	if r := rows["alive-row"]; r.Status != "processing" || deref(r.LockedBy) != alive {
		t.Errorf("live owner's row: %+v, want still processing by it", r)
	}
	// The row is claimed again every second, finds the pair still held and
	// goes back to pending: between those claims it is pending, naming the
	// owner, and never attempted. (A single look can land inside a claim —
	// on a slow server that window is wide — so look until it is pending.)
	var last row
	pendingNamingOwner := func() bool {
		last = f.MustRow(t, "alive-pair")
		if last.Attempts != 0 {
			t.Fatalf("row whose pair a live owner is sending was attempted: %+v", last)
		}
		return last.Status == "pending" && last.LastError != nil && strings.Contains(*last.LastError, alive)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !pendingNamingOwner() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if last.Status != "pending" || last.LastError == nil || !strings.Contains(*last.LastError, alive) {
		t.Errorf("row whose pair a live owner is sending: status %s attempts %d last_error %s, want pending, 0, naming the owner",
			last.Status, last.Attempts, deref(last.LastError))
	}
	if sent := a.Delivered(); sent["alive-row"]+sent["alive-pair"] != 0 || sent["ghost-row"] != 1 {
		t.Errorf("sent %v, want ghost-row once and nothing else", sent)
	}
	if pair := f.MustLedger(t)[relay.LedgerKey{EventKey: "alive-pair", Action: "a"}]; pair.State != "sending" || deref(pair.Owner) != alive {
		t.Errorf("live owner's claim %+v changed", pair)
	}
}

// The engine renews the leases of the rows it is delivering: with
// lock_timeout 1 s and a sink that takes 3 s per event, two relays (two
// owners, each its own engine and claim source) on one table deliver each
// row exactly once. Without the renewal every row would outlive its lease
// while being sent, and a sweeper would return it to be sent again.
func TestLeaseRenewedWhileDelivering(t *testing.T) {
	f := MustFixture(t)
	const rows = 6
	const lease, sendTime = time.Second, 3 * time.Second

	var relays []*rig
	var sinks []*fakeSink
	for range 2 {
		a := newFakeSink("a", func(*relay.Delivery) error {
			time.Sleep(sendTime)
			return nil
		})
		sinks = append(sinks, a)
		relays = append(relays, MustStart(t, f, options{Routes: routes(a), All: true, BatchSize: 1,
			LockTimeout: lease, PollInterval: 100 * time.Millisecond}))
	}
	waitFor(t, 5*time.Second, "both owner locks", func() bool {
		return f.MustInt(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = $1`,
			int64(ledger.OwnerLockClass)) == 2
	})
	// One row at a time, so that both relays are likely to claim some.
	start := time.Now()
	for i := range rows {
		f.MustInsert(t, event{Key: fmt.Sprintf("evt-%d", i)})
		time.Sleep(150 * time.Millisecond)
	}
	waitFor(t, 30*time.Second, "every row done", func() bool { return f.MustStatusCount(t, "done") == rows })
	t.Logf("%d rows of %s each, lease %s: done after %s; claimed %d and %d", rows, sendTime, lease,
		time.Since(start).Round(time.Millisecond), relays[0].Stats.Claimed.Load(), relays[1].Stats.Claimed.Load())
	time.Sleep(2 * lease) // more sweeps: nothing comes back

	sent := map[string]int{}
	for _, s := range sinks {
		for _, c := range s.Calls() {
			sent[c.Key]++
		}
	}
	if len(sent) != rows {
		t.Errorf("sent %d distinct rows, want %d", len(sent), rows)
	}
	for key, n := range sent {
		if n != 1 {
			t.Errorf("%s sent %d times, want once", key, n)
		}
	}
	for i, r := range relays {
		if n := r.Stats.TakenOver.Load(); n != 0 {
			t.Errorf("relay %d's sweeper returned %d leases while their rows were being delivered", i+1, n)
		}
	}
	for k, p := range f.MustLedger(t) {
		if p.State != "delivered" || p.Attempts != 1 {
			t.Errorf("ledger pair %v: %+v, want delivered at its first claim", k, p)
		}
	}
	if n := f.MustStatusCount(t, "done"); n != rows {
		t.Errorf("%d rows done, want %d", n, rows)
	}
}
