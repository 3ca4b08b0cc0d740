package claim_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
)

// mustEvent reads row key as the stream would decode it.
func (f *fixture) mustEvent(tb testing.TB, key string) *relay.Event {
	tb.Helper()
	ev := &relay.Event{}
	var created, avail pgtype.Timestamptz
	err := f.pool.QueryRow(context.Background(), `SELECT id, event_key, event_type, aggregate_type, aggregate_id, payload::text,
		created_at, available_at FROM integration_outbox WHERE event_key = $1`, key).Scan(&ev.ID, &ev.EventKey, &ev.EventType,
		&ev.AggregateType, &ev.AggregateID, &ev.Payload, &created, &avail)
	if err != nil {
		tb.Fatalf("read %s: %v", key, err)
	}
	ev.CreatedAt, ev.AvailableAt = created.Time, avail.Time
	return ev
}

// The stream hands an event off; while it is with the claim path the
// stream hands off the aggregate's later events too; the claim path
// delivers them in order and, once the last one settles, tells the engine
// (Undiverted), after which the stream delivers the aggregate's events
// itself again. Both paths send the same body.
func TestEngineHandOffAndUndivert(t *testing.T) {
	f := MustFixture(t)
	store := ledger.New(f.pool, ledger.DefaultConfig())

	var (
		mu       sync.Mutex
		order    []string
		failOnce = map[string]bool{"e1": true}
	)
	// One sink object shared by both paths, as the CLI wires it.
	s := newFakeSink("n8n", func(d *relay.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		if failOnce[d.Event.EventKey] {
			delete(failOnce, d.Event.EventKey)
			return relay.TransientError(errors.New("HTTP 503"), 0)
		}
		order = append(order, d.Event.EventKey)
		return nil
	})
	owner := claim.NewOwner()
	engine, err := relay.NewEngine(relay.EngineConfig{Routes: routes(s), Store: store, Holds: store, Owner: owner,
		InlineAttempts: 0, Backoff: []time.Duration{300 * time.Millisecond}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	engineDone := make(chan error, 1)
	go func() { engineDone <- engine.Run(ctx) }()
	defer func() { cancel(); <-engineDone }()

	c := MustStart(t, f, claim.Config{Routes: routes(s), Owner: owner, PollInterval: 50 * time.Millisecond,
		Backoff: []time.Duration{50 * time.Millisecond}, OnAggregateSettled: engine.Undiverted, DivertSeq: engine.DivertSeq})

	submit := func(keys ...string) {
		t.Helper()
		var events []event
		for _, k := range keys {
			events = append(events, event{Key: k, AggType: "order", AggID: "A", Payload: `{"k": "` + k + `"}`})
		}
		f.MustInsert(t, events...)
		var evs []*relay.Event
		for _, k := range keys {
			evs = append(evs, f.mustEvent(t, k))
		}
		if err := engine.Submit(ctx, evs); err != nil {
			t.Fatal(err)
		}
	}

	// e1 fails at the stream and is handed off (due in 300 ms); e2, submitted
	// meanwhile, follows it to the claim path.
	submit("e1")
	waitFor(t, 5*time.Second, "e1 handed off", func() bool { return f.MustRow(t, "e1").HandedOff })
	submit("e2")
	waitFor(t, 5*time.Second, "e2 handed off", func() bool { return f.MustRow(t, "e2").HandedOff })
	waitFor(t, 10*time.Second, "e1 and e2 done by the claim path", func() bool {
		rows := f.MustRows(t)
		return rows["e1"].Status == "done" && rows["e2"].Status == "done"
	})
	// The claim path settled the aggregate's last hand-off: the stream
	// delivers e3 itself.
	time.Sleep(100 * time.Millisecond)
	submit("e3")
	waitFor(t, 5*time.Second, "e3 delivered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(order) == 3
	})
	time.Sleep(200 * time.Millisecond) // the engine's settlement
	if r := f.MustRow(t, "e3"); r.HandedOff {
		t.Errorf("e3 was handed off; the aggregate should no longer be diverted")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(order) != 3 || order[0] != "e1" || order[1] != "e2" || order[2] != "e3" {
		t.Errorf("delivered in order %v, want [e1 e2 e3]", order)
	}
	var e1 []string
	for _, call := range s.Calls() {
		if call.Key == "e1" {
			e1 = append(e1, string(call.Body))
		}
	}
	if len(e1) != 2 || e1[0] != e1[1] {
		t.Errorf("e1's bodies from the stream and the claim path: %q, want two identical", e1)
	}
	if c.Stats.Delivered.Load() != 2 {
		t.Errorf("the claim path delivered %d, want 2 (e1, e2)", c.Stats.Delivered.Load())
	}
}
