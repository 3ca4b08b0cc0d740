package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// TestRelay_AutoPollsWithoutLogicalWAL: on a wal_level=replica cluster,
// mode auto falls back to the claim path over every row; with the NOTIFY
// trigger and poll_interval 5s, events still arrive within milliseconds.
func TestRelay_AutoPollsWithoutLogicalWAL(t *testing.T) {
	cluster := pgtest.NewCluster(t, pgtest.Options{WALLevel: "replica"})
	ctx := context.Background()
	if err := cluster.CreateDatabase(ctx, "outbox"); err != nil {
		t.Fatal(err)
	}
	s := newSetupWith(t, cluster.URL("outbox"), migrations.Options{Names: migrations.DefaultNames(), NotifyTrigger: true})
	s.startInProcess(t, s.configFileWith(t, "", "source: {mode: auto, poll_interval: 5s, notify_trigger: true}"))
	time.Sleep(time.Second) // let it find replication impossible and start polling

	committed := map[string]time.Time{}
	for i := range 1000 {
		key := fmt.Sprintf("poll-%d", i)
		if _, err := s.pool.Exec(ctx, `SELECT outbox_publish('order.placed', 'order', $1, $2, '{"pad": "x"}')`, fmt.Sprint(i%50), key); err != nil {
			t.Fatal(err)
		}
		committed[key] = time.Now()
		time.Sleep(2 * time.Millisecond)
	}
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 60*time.Second, keys)

	var lat []time.Duration
	for _, d := range s.hook.deliveries() {
		lat = append(lat, d.At.Sub(committed[d.EventKey]))
	}
	slices.Sort(lat)
	p50, p99 := lat[len(lat)/2], lat[len(lat)*99/100]
	t.Logf("poll mode with NOTIFY, poll_interval 5s: commit→webhook p50 %v, p99 %v over %d events", p50, p99, len(lat))
	if p50 > 100*time.Millisecond {
		t.Fatalf("p50 %v: the NOTIFY wake-up is not working (poll_interval is 5s)", p50)
	}
	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		if len(ds) != 1000 {
			t.Fatalf("%s: %d deliveries, want 1000", sink, len(ds))
		}
		checkOrder(t, sink, ds)
	}
	if n := s.scalar(t, "SELECT count(*) FROM pg_replication_slots"); n != 0 {
		t.Fatalf("%d slots exist on a wal_level=replica cluster", n)
	}
}

// TestRelay_SlotDroppedWhileStreaming: the walsender is terminated and the
// slot dropped while events flow. Nothing is lost: events the dead slot did
// not deliver are pending, and the new slot's snapshot hands them to the
// claim path; the relay streams again within 30 s.
func TestRelay_SlotDroppedWhileStreaming(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	s.startInProcess(t, s.configFile(t, ""))
	s.waitSlot(t)

	var wg sync.WaitGroup
	wg.Go(func() { s.publishWritersPaced(t, 3, 500, 20, "drop", 3*time.Millisecond) })
	eventually(t, 30*time.Second, "deliveries before the drop", func() bool { return len(s.hook.deliveries()) >= 300 })

	ctx := context.Background()
	dropped := false
	for attempt := 0; !dropped && attempt < 200; attempt++ {
		s.pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active`)
		_, err := s.pool.Exec(ctx, `SELECT pg_drop_replication_slot('outbox_relay')`)
		dropped = err == nil
		if !dropped {
			time.Sleep(5 * time.Millisecond)
		}
	}
	if !dropped {
		t.Fatal("could not drop the slot")
	}
	droppedAt := time.Now()
	t.Logf("slot dropped after %d webhook deliveries", len(s.hook.deliveries()))

	s.waitSlot(t)
	if d := time.Since(droppedAt); d > 30*time.Second {
		t.Fatalf("streaming again after %v, want within 30s", d)
	}
	t.Logf("streaming again %v after the drop", time.Since(droppedAt).Round(time.Millisecond))
	wg.Wait()
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 90*time.Second, keys)
	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		for key, copies := range byKey(ds) {
			for _, c := range copies[1:] {
				if c.IdemKey != copies[0].IdemKey || c.Body != copies[0].Body {
					t.Fatalf("%s: repeat of %s differs", sink, key)
				}
			}
		}
		checkOrder(t, sink, ds)
	}
	s.waitDone(t, "true", int64(len(keys)))
}

// TestRelay_UnconsumedSlotIsDropped: with its publication gone, the relay
// cannot stream and polls instead; the slot it owns is dropped after
// slot_max_unconsumed rather than retaining WAL forever, and events keep
// flowing through the claim path.
func TestRelay_UnconsumedSlotIsDropped(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	stop := s.startInProcess(t, s.configFile(t, ""))
	s.waitSlot(t)
	stop()
	ctx := context.Background()
	if _, err := s.pool.Exec(ctx, `DROP PUBLICATION outbox_relay`); err != nil {
		t.Fatal(err)
	}

	s.startInProcess(t, s.configFileWith(t, "", "source: {mode: auto, slot_max_unconsumed: 3s, poll_interval: 200ms}"))
	start := time.Now()
	s.publishWriters(t, 1, 20, 5, "unconsumed")
	eventually(t, 20*time.Second, "the unconsumed slot dropped", func() bool {
		return s.scalar(t, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outbox_relay'") == 0
	})
	t.Logf("slot dropped %v after the relay started polling", time.Since(start).Round(time.Millisecond))
	s.waitAllDelivered(t, 30*time.Second, s.keys(t, "true"))
}

// TestRelay_ReturnsToReplication: auto mode polls while replication is
// impossible (here: the publication is missing), and returns to streaming
// through the snapshot hand-over once it is possible again; writers keep
// inserting across both switches, and every event reaches each sink once.
func TestRelay_ReturnsToReplication(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	ctx := context.Background()
	if _, err := s.pool.Exec(ctx, `DROP PUBLICATION outbox_relay`); err != nil {
		t.Fatal(err)
	}
	s.startInProcess(t, s.configFileWith(t, "", "source: {mode: auto, replication_retry: 2s, poll_interval: 200ms}"))

	var wg sync.WaitGroup
	wg.Go(func() { s.publishWritersPaced(t, 2, 400, 10, "switch", 10*time.Millisecond) })
	eventually(t, 20*time.Second, "deliveries while polling", func() bool { return len(s.hook.deliveries()) >= 100 })
	if n := s.scalar(t, "SELECT count(*) FROM pg_replication_slots WHERE active"); n != 0 {
		t.Fatal("a slot is being consumed while the publication is missing")
	}

	if _, err := s.pool.Exec(ctx, `CREATE PUBLICATION outbox_relay FOR TABLE integration_outbox WITH (publish = 'insert')`); err != nil {
		t.Fatal(err)
	}
	fixed := time.Now()
	s.waitSlot(t)
	t.Logf("streaming %v after the publication was created (replication_retry 2s)", time.Since(fixed).Round(time.Millisecond))
	wg.Wait()
	s.publishWriters(t, 1, 50, 5, "after")

	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 60*time.Second, keys)
	for sink, ds := range map[string][]delivery{"webhook": s.hook.deliveries(), "nats": streamMessages(t, s.nats.URL())} {
		for key, copies := range byKey(ds) {
			if len(copies) != 1 {
				t.Fatalf("%s: %s delivered %d times", sink, key, len(copies))
			}
		}
		checkOrder(t, sink, ds)
	}
	eventually(t, 10*time.Second, "the 50 events after the return recorded as delivered by the stream", func() bool {
		// The stream's delivered ledger rows carry no owner; the claim
		// path's carry the claimer's.
		return s.scalar(t, `SELECT count(DISTINCT event_key) FROM integration_idempotency
			WHERE event_key LIKE 'after-%' AND state = 'delivered' AND owner IS NULL`) == 50
	})
}

// TestRelay_KillNineWhileProcessing: a relay in poll mode is killed while
// rows are claimed ('processing') and requests are in flight; the next relay
// (lock_timeout 2s) takes them over and delivers them; a repeat carries the
// same idempotency key and body.
func TestRelay_KillNineWhileProcessing(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	var slow sync.Mutex
	slowOn := true
	s.hook.setReply(func(delivery) int {
		slow.Lock()
		on := slowOn
		slow.Unlock()
		if on {
			time.Sleep(3 * time.Second)
		}
		return 204
	})
	cfgPath := s.configFileWith(t, "", "source: {mode: poll, poll_interval: 200ms, lock_timeout: 2s}")
	var logs syncBuffer
	first := s.startProcess(t, cfgPath, &logs)
	s.publishWriters(t, 1, 40, 40, "processing")
	eventually(t, 20*time.Second, "rows being processed", func() bool {
		return s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status = 'processing'") > 0
	})
	processing := s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status = 'processing'")
	first.Process.Signal(syscall.SIGKILL)
	first.Wait()
	t.Logf("killed the relay with %d rows processing", processing)

	slow.Lock()
	slowOn = false
	slow.Unlock()
	s.startProcess(t, cfgPath, &logs)
	keys := s.keys(t, "true")
	s.waitAllDelivered(t, 60*time.Second, keys)
	eventually(t, 20*time.Second, "every row done", func() bool {
		return s.scalar(t, "SELECT count(*) FROM integration_outbox WHERE status <> 'done'") == 0
	})
	repeats := 0
	for key, copies := range byKey(s.hook.deliveries()) {
		for _, c := range copies[1:] {
			repeats++
			if c.IdemKey != copies[0].IdemKey || c.Body != copies[0].Body {
				t.Fatalf("repeat of %s differs", key)
			}
		}
	}
	t.Logf("%d events delivered, %d repeats of requests in flight at the kill", len(keys), repeats)
}
