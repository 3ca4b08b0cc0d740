package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
	"github.com/outbox-relay/outbox-relay/relay/replication"
)

// TestRelay_Standby (PostgreSQL 16+): the relay decodes on a physical
// standby (source.standby_url) while writers publish on the primary through
// a multi-host URL, through every fault of docs/standby.md in a row:
//
//  1. streaming from the standby: the slot is there, none on the primary;
//  2. a restart of the relay;
//  3. the standby falls behind (its link to the primary black-holed) past
//     source.standby_max_lag: delivery moves to the claim path on the
//     primary, and events committed meanwhile are delivered while the
//     standby still lags; the link back, delivery returns to the standby;
//  4. the standby stopped (unreachable): the same, then started again;
//  5. a restart of the standby within the bound;
//  6. the primary killed and the standby promoted: the relay continues from
//     the slot it had on the standby (no new slot, no hand-over).
//
// Every row of the final primary reaches both sinks, in per-aggregate order;
// before the promotion no sink sees a repeat; after it a repeat carries the
// same id and body. Both moves of each fault are logged and counted.
func TestRelay_Standby(t *testing.T) {
	bindir := pgtest.BindirAtLeast(t, 16, "logical decoding on a standby")
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	primary := pgtest.NewCluster(t, pgtest.Options{Bindir: bindir})
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	link := netfault.NewProxy(t, "127.0.0.1:"+strconv.Itoa(primary.Port()))
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{PrimaryAddr: link.Addr()})
	url := pgtest.MultiHostURL("app", primary, standby)
	s := newSetup(t, url)
	pconn, err := pgx.Connect(ctx, primary.URL("app"))
	if err != nil {
		t.Fatal(err)
	}
	defer pconn.Close(ctx)
	standbyCount := func(sql string) int64 {
		conn, err := pgx.Connect(ctx, standby.URL("app"))
		if err != nil {
			return -1
		}
		defer conn.Close(ctx)
		var n int64
		if err := conn.QueryRow(ctx, sql).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	// Rows pending before the relay's first start go through the
	// hand-over of the slot made on the standby.
	s.publishWriters(t, 1, 20, 5, "before-start")

	cfgPath := s.configFileWith(t, "", fmt.Sprintf("source: {standby_url: %q, standby_max_lag: 3s}\n", standby.URL("app")))
	var relayLog syncBuffer
	log := zerolog.New(&relayLog).Level(zerolog.InfoLevel).With().Timestamp().Logger()
	stopRelay := runInProcess(t, config.Options{Path: cfgPath}, log)
	defer func() {
		stopRelay()
		if t.Failed() || testing.Verbose() {
			t.Logf("relay log:\n%s", relayLog.String())
		}
	}()
	streamingOnStandby := func(what string) {
		t.Helper()
		eventually(t, 60*time.Second, what, func() bool {
			return standbyCount("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active") == 1
		})
	}
	streamingOnStandby("the relay streaming from its slot on the standby")
	if n := s.scalar(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'"); n != 0 {
		t.Errorf("the primary holds %d logical slots while the relay decodes on the standby", n)
	}

	writers := startPacedWriters(t, url, 2, 20*time.Millisecond)
	defer func() {
		select {
		case <-writers.stop:
		default:
			writers.halt()
		}
	}()
	delivered := func(key string) bool {
		for _, d := range s.hook.deliveries() {
			if d.EventKey == key {
				return true
			}
		}
		return false
	}
	// ackedAfter returns a key a writer had acknowledged after at.
	ackedAfter := func(at time.Time) string {
		var key string
		eventually(t, 30*time.Second, "a commit on the primary", func() bool {
			writers.mu.Lock()
			defer writers.mu.Unlock()
			for k, when := range writers.acked {
				if when.After(at) {
					key = k
					return true
				}
			}
			return false
		})
		return key
	}
	eventually(t, 30*time.Second, "deliveries from the standby", func() bool { return len(s.hook.deliveries()) >= 100 })

	// 2. A restart of the relay.
	stopRelay()
	stopRelay = runInProcess(t, config.Options{Path: cfgPath}, log)
	streamingOnStandby("the restarted relay streaming from the standby")

	moves := func(to, reason string) float64 {
		var m dto.Metric
		if err := replication.StandbyMoves.WithLabelValues(to, reason).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetCounter().GetValue()
	}
	// 3. The standby falls behind.
	lagging, back := moves("primary", replication.StandbyLagging), moves("standby", "healthy")
	link.BlackHole(netfault.NewConnsBlackHole)
	eventually(t, 30*time.Second, "delivery moved to the primary (lagging)", func() bool { return moves("primary", replication.StandbyLagging) == lagging+1 })
	fallback := time.Now()
	key := ackedAfter(fallback)
	eventually(t, 60*time.Second, "an event committed while the standby lags, delivered", func() bool { return delivered(key) })
	if moves("standby", "healthy") != back {
		t.Fatal("delivery returned to the standby while its link was black-holed")
	}
	t.Logf("standby lagging: delivery moved to the primary; %s delivered %v after the move", key, time.Since(fallback).Round(time.Millisecond))
	link.ResetConns()
	link.Pass()
	eventually(t, 60*time.Second, "delivery back on the standby", func() bool { return moves("standby", "healthy") == back+1 })
	streamingOnStandby("the relay streaming from the standby again")

	// 4. The standby unreachable.
	unreachable, back := moves("primary", replication.StandbyUnreachable), moves("standby", "healthy")
	if err := standby.Stop(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "delivery moved to the primary (unreachable)", func() bool {
		return moves("primary", replication.StandbyUnreachable) == unreachable+1
	})
	key = ackedAfter(time.Now())
	eventually(t, 60*time.Second, "an event committed while the standby is down, delivered", func() bool { return delivered(key) })
	if err := standby.Start(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, 60*time.Second, "delivery back on the standby", func() bool { return moves("standby", "healthy") == back+1 })
	streamingOnStandby("the relay streaming from the restarted standby")

	// 5. A restart of the standby within the bound: no move.
	moved := moves("primary", replication.StandbyUnreachable) + moves("primary", replication.StandbyLagging)
	if err := standby.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	streamingOnStandby("the relay streaming again after the standby's restart")
	key = ackedAfter(time.Now())
	eventually(t, 90*time.Second, "an event after the standby's restart, delivered", func() bool { return delivered(key) })
	if got := moves("primary", replication.StandbyUnreachable) + moves("primary", replication.StandbyLagging); got != moved {
		t.Logf("the standby's restart took longer than source.standby_max_lag: delivery moved to the primary meanwhile")
	}

	// Before the promotion: every acknowledged row at both sinks, no repeat.
	writers.mu.Lock()
	before := map[string]bool{}
	for k := range writers.acked {
		before[k] = true
	}
	writers.mu.Unlock()
	for k := range s.keys(t, "event_key LIKE 'before-start%'") {
		before[k] = true
	}
	s.waitAllDelivered(t, 90*time.Second, before)
	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		for k, copies := range byKey(ds) {
			if len(copies) > 1 && sink == "webhook" {
				t.Errorf("%s: %s delivered %d times before the promotion", sink, k, len(copies))
			}
		}
	}
	created := strings.Count(relayLog.String(), "created replication slot")

	// 6. The primary dies; the standby is promoted.
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	link.ResetConns()
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	s.pool.Reset() // its connections to the killed primary are dead
	key = ackedAfter(promoted)
	eventually(t, 60*time.Second, "an event committed on the promoted standby, delivered", func() bool { return delivered(key) })
	t.Logf("promotion: the first event committed on the promoted standby delivered %v after it", time.Since(promoted).Round(time.Millisecond))
	writers.halt()
	if n := strings.Count(relayLog.String(), "created replication slot"); n != created {
		t.Errorf("the relay made %d new slots after the promotion; the slot on the promoted standby was lost", n-created)
	}

	all := s.keys(t, "true")
	s.waitAllDelivered(t, 90*time.Second, all)
	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		repeats := 0
		for k, copies := range byKey(ds) {
			for _, c := range copies[1:] {
				repeats++
				if c.IdemKey != copies[0].IdemKey || c.Body != copies[0].Body || c.ID != copies[0].ID {
					t.Errorf("%s: a repeat of %s differs", sink, k)
				}
			}
		}
		checkOrder(t, sink, ds)
		t.Logf("%s: %d rows, %d deliveries, %d repeats (all after the promotion)", sink, len(all), len(ds), repeats)
	}
	for _, line := range []string{"delivery moves to the primary", "delivery returns to it"} {
		if !strings.Contains(relayLog.String(), line) {
			t.Errorf("the relay log has no line %q", line)
		}
	}
}
