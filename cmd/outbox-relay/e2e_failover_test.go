package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// failoverWriters publish events through a multi-host URL until stopped,
// each writer owning its aggregates; an attempt that fails (the primary is
// gone, the standby not yet promoted) is retried with the same key, as an
// application would, until it is acknowledged.
type failoverWriters struct {
	url     string
	stop    chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	acked   map[string]time.Time // key → when its commit was acknowledged
	retries atomic.Int64
	pause   time.Duration // after each acknowledged event
}

func startFailoverWriters(t *testing.T, url string, writers int) *failoverWriters {
	return startPacedWriters(t, url, writers, 5*time.Millisecond)
}

// startPacedWriters is startFailoverWriters with a pause of its own.
func startPacedWriters(t *testing.T, url string, writers int, pause time.Duration) *failoverWriters {
	w := &failoverWriters{url: url, stop: make(chan struct{}), acked: map[string]time.Time{}, pause: pause}
	for n := range writers {
		w.wg.Go(func() { w.run(t, n) })
	}
	return w
}

func (w *failoverWriters) run(t *testing.T, n int) {
	ctx := context.Background()
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(ctx)
		}
	}()
	for i := 0; ; i++ {
		key := fmt.Sprintf("fo-w%d-%d", n, i)
		agg := fmt.Sprintf("w%d-%d", n, i%5)
		for {
			select {
			case <-w.stop:
				return
			default:
			}
			var err error
			if conn == nil {
				cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				conn, err = pgx.Connect(cctx, w.url)
				cancel()
			}
			if err == nil {
				qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				var res string
				err = conn.QueryRow(qctx, `SELECT outbox_publish('order.placed', 'order', $1, $2, jsonb_build_object('i', $3::int))`, agg, key, i).Scan(&res)
				cancel()
				if err != nil {
					conn.Close(ctx)
					conn = nil
				}
			}
			if err == nil {
				w.mu.Lock()
				w.acked[key] = time.Now()
				w.mu.Unlock()
				break
			}
			w.retries.Add(1)
			time.Sleep(50 * time.Millisecond)
		}
		time.Sleep(w.pause)
	}
}

func (w *failoverWriters) halt() {
	close(w.stop)
	w.wg.Wait()
}

// outboxRow is a row of the new primary's outbox.
type outboxRow struct {
	id  int64
	key string
}

// TestRelay_Failover: a primary and a physical standby (on 17+ with the
// relay's slot synced to it and synchronized_standby_slots set), writers
// and the relay on a multi-host URL with target_session_attrs=read-write;
// kill -9 of the primary, promotion of the standby. Every row of the new
// primary reaches both sinks; a repeat carries the same id and body; per
// aggregate, the rows of the new primary arrive in order. It reports the
// time from the promotion to the first delivery of an event committed on
// the new primary, the events delivered that the new primary does not have,
// and which path recovered (the synced slot, or a new slot's hand-over).
func TestRelay_Failover(t *testing.T) {
	// How long replication to the standby stalls before the kill: 2 s
	// loses about a thousand acknowledged commits (the figures); 200 ms
	// loses a few dozen, whose ids the new primary hands out again at once
	// to new rows — the case where an outcome of the old primary written on
	// the new one would mark a new row delivered.
	for _, stall := range []time.Duration{2 * time.Second, 200 * time.Millisecond} {
		t.Run("stall "+stall.String(), func(t *testing.T) { testFailover(t, stall) })
	}
}

func testFailover(t *testing.T, failoverStall time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	primary := pgtest.NewCluster(t, pgtest.Options{})
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	// The standby streams through a proxy, to stall replication before the
	// kill: the old primary then acknowledges commits the standby never
	// receives.
	link := netfault.NewProxy(t, "127.0.0.1:"+strconv.Itoa(primary.Port()))
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{PrimaryAddr: link.Addr()})
	url := pgtest.MultiHostURL("app", primary, standby)
	s := newSetup(t, url)
	version := s.scalar(t, "SELECT current_setting('server_version_num')::int")

	var relayLog syncBuffer
	log := zerolog.New(&relayLog).Level(zerolog.InfoLevel).With().Timestamp().Logger()
	stop := runInProcess(t, config.Options{Path: s.configFile(t, "")}, log)
	defer func() {
		stop()
		if t.Failed() || testing.Verbose() {
			t.Logf("relay log:\n%s", relayLog.String())
		}
	}()
	s.waitSlot(t)

	writers := startFailoverWriters(t, url, 4)
	defer func() {
		select {
		case <-writers.stop:
		default:
			writers.halt()
		}
	}()
	eventually(t, 30*time.Second, "deliveries before the failover", func() bool { return len(s.hook.deliveries()) >= 300 })

	synced := false
	if version >= 170000 {
		// A slot the standby has synced but not yet persisted is dropped at
		// promotion: wait until it is persistent. It is persisted once the
		// primary's slot has moved past what the standby reserved for it,
		// which takes a running-transactions record (logged every 15 s, or
		// at once by pg_log_standby_snapshot).
		syncStart := time.Now()
		sconn, err := pgx.Connect(ctx, standby.URL("app"))
		if err != nil {
			t.Fatal(err)
		}
		eventually(t, 60*time.Second, "the relay's slot synced to the standby", func() bool {
			if _, err := s.pool.Exec(ctx, "SELECT pg_log_standby_snapshot()"); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := sconn.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND synced AND NOT temporary`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 1
		})
		sconn.Close(ctx)
		t.Logf("the relay's failover slot was synced to the standby and persisted in %v", time.Since(syncStart).Round(time.Millisecond))
		synced = true
	}
	time.Sleep(500 * time.Millisecond)

	link.BlackHole(netfault.NewConnsBlackHole)
	time.Sleep(failoverStall)
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	link.ResetConns()
	link.Pass()
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	t.Logf("replication stalled %v, then kill -9 of the primary; the standby promoted %v later", failoverStall, promoted.Sub(killed).Round(time.Millisecond))

	// Writers go on against the new primary, then stop.
	eventually(t, 30*time.Second, "writes on the new primary", func() bool {
		writers.mu.Lock()
		defer writers.mu.Unlock()
		n := 0
		for _, at := range writers.acked {
			if at.After(promoted) {
				n++
			}
		}
		return n >= 200
	})
	writers.halt()

	rows, err := s.pool.Query(ctx, "SELECT id, event_key FROM integration_outbox")
	if err != nil {
		t.Fatal(err)
	}
	onNew, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (outboxRow, error) {
		var o outboxRow
		err := r.Scan(&o.id, &o.key)
		return o, err
	})
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	idOf := map[string]int64{}
	for _, o := range onNew {
		keys[o.key] = true
		idOf[o.key] = o.id
	}
	s.waitAllDelivered(t, 90*time.Second, keys)

	// The first event committed on the new primary to reach the webhook.
	writers.mu.Lock()
	var firstNew time.Time
	for _, d := range s.hook.deliveries() {
		if at, ok := writers.acked[d.EventKey]; ok && at.After(promoted) && (firstNew.IsZero() || d.At.Before(firstNew)) {
			firstNew = d.At
		}
	}
	lostAcked := 0
	for key := range writers.acked {
		if !keys[key] {
			lostAcked++
		}
	}
	writers.mu.Unlock()

	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		repeats, notOnNew, wrongID := 0, 0, 0
		var kept []delivery
		for key, copies := range byKey(ds) {
			for _, c := range copies[1:] {
				repeats++
				if c.IdemKey != copies[0].IdemKey || c.Body != copies[0].Body || c.ID != copies[0].ID {
					t.Errorf("%s: a repeat of %s differs: id %d, then %d", sink, key, copies[0].ID, c.ID)
				}
			}
			switch id, ok := idOf[key]; {
			case !ok:
				notOnNew++
			case id != copies[0].ID:
				wrongID++
				t.Errorf("%s: event %s delivered with id %d, the new primary has it as id %d", sink, key, copies[0].ID, id)
			}
		}
		for _, d := range ds {
			if keys[d.EventKey] {
				kept = append(kept, d)
			}
		}
		checkOrder(t, sink, kept)
		t.Logf("%s: %d events on the new primary, %d deliveries, %d repeats, %d delivered events the new primary does not have", sink, len(keys), len(ds), repeats, notOnNew)
		if synced && notOnNew > 0 {
			t.Errorf("%s: %d delivered events the new primary does not have, with synchronized_standby_slots", sink, notOnNew)
		}
	}

	path := "the synced slot"
	if strings.Count(relayLog.String(), "created replication slot") > 1 {
		path = "slot-loss recovery (a new slot's hand-over to the claim path)"
	}
	if synced && path != "the synced slot" {
		t.Errorf("the relay recovered through %s although its slot was synced to the standby", path)
	}
	t.Logf("PostgreSQL %d: promotion → first new event delivered %v; writers retried %d times; %d acknowledged commits lost with the old primary; recovered through %s",
		version/10000, firstNew.Sub(promoted).Round(time.Millisecond), writers.retries.Load(), lostAcked, path)
	if d := firstNew.Sub(promoted); d > 15*time.Second {
		t.Errorf("first new event delivered %v after the promotion, want < 15 s", d)
	}
}
