package ledger_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// payloadBytes is the bytes of the events' payloads as read.
func payloadBytes(events []*relay.Event) int64 {
	var n int64
	for _, ev := range events {
		n += int64(len(ev.Payload))
	}
	return n
}

// mustInsertLarge inserts a pending row of aggregate ("order", agg) whose
// payload is a JSON string of size bytes, and returns its id.
func (f *fixture) mustInsertLarge(tb testing.TB, key, agg string, size int) int64 {
	tb.Helper()
	var id int64
	err := f.pool.QueryRow(context.Background(), `
		INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
		VALUES ('test.event', 'order', $1, $2, to_jsonb(repeat('x', $3::int))) RETURNING id`, agg, key, size).Scan(&id)
	if err != nil {
		tb.Fatalf("insert %s: %v", key, err)
	}
	return id
}

// TestHandOverReadsSlicesByBytes: a new slot's hand-over reads its rows —
// NewestUnblocked's and each slice of Deliver — in slices whose payloads take at most
// relay.ReadBytes of the engine's budget, a row larger than that alone,
// and still feeds every row, each aggregate's in id order. Before, a slice
// was cut by count only (1,000 rows): 900 rows of 600 KiB were 540 MB in
// memory at once before the engine took any.
func TestHandOverReadsSlicesByBytes(t *testing.T) {
	const (
		budget = 8 << 20
		row    = 200 << 10
		big    = 3 << 20
	)
	read := relay.ReadBytes(budget)
	f := MustFixture(t)
	cfg := ledger.DefaultConfig()
	cfg.MaxInFlightBytes = budget
	store := mustStore(t, f.pool, cfg)
	ctx := context.Background()
	var ids []int64
	aggOf := map[int64]string{}
	for i := range 40 {
		size := row
		if i == 20 {
			size = big
		}
		id := f.mustInsertLarge(t, fmt.Sprintf("large-%d", i), fmt.Sprint(i%3), size)
		ids, aggOf[id] = append(ids, id), fmt.Sprint(i%3)
	}
	slot, created, h := f.mustOpenHandOver(t, store)
	defer h.Close()

	early, earlyAggs, err := h.NewestUnblocked(ctx)
	if err != nil {
		t.Fatalf("NewestUnblocked: %v", err)
	}
	if n := payloadBytes(early); len(early) > 1 && n > read {
		t.Errorf("NewestUnblocked read %d rows of %d payload bytes at once, want at most %d", len(early), n, read)
	}
	// Every row is among the newest: only the aggregates whose every row
	// NewestUnblocked fed are left out of the pin.
	for _, a := range earlyAggs {
		for _, id := range ids {
			if aggOf[id] == a.ID && !slices.ContainsFunc(early, func(ev *relay.Event) bool { return ev.ID == id }) {
				t.Errorf("NewestUnblocked reported aggregate %s fed, but its row %d was not", a.ID, id)
			}
		}
	}
	if _, err := h.Aggregates(ctx); err != nil {
		t.Fatal(err)
	}
	fed := &feedLog{onFeed: func(events []*relay.Event) error {
		if n := payloadBytes(events); len(events) > 1 && n > read {
			t.Errorf("Deliver fed %d rows of %d payload bytes at once, want at most %d", len(events), n, read)
		}
		for _, ev := range events {
			if len(ev.Payload) >= big && len(events) > 1 {
				t.Errorf("the row larger than a read came with %d others, want it alone", len(events)-1)
			}
		}
		return nil
	}}
	n, err := fed.deliver(ctx, h, slot, created.consistent)
	if err != nil {
		t.Fatalf("Deliver: %v", err)
	}
	if n != int64(len(ids)) {
		t.Errorf("Deliver reported %d rows, want %d", n, len(ids))
	}
	all := append(slices.Clone(early), fed.events...)
	got := make([]int64, 0, len(all))
	last := map[string]int64{}
	for _, ev := range all {
		got = append(got, ev.ID)
		if a := *ev.AggregateID; ev.ID < last[a] {
			t.Errorf("aggregate %s: row %d fed after row %d", a, ev.ID, last[a])
		}
		last[*ev.AggregateID] = ev.ID
	}
	slices.Sort(got)
	if !slices.Equal(got, ids) {
		t.Errorf("fed %v, want every row %v", got, ids)
	}
	t.Logf("NewestUnblocked fed %d rows; Deliver fed slices of %v rows", len(early), fed.feeds)
}

// TestClaimTakesByBytes: a claim takes rows until their payloads use the
// claim's byte limit (relay.ClaimQuery.MaxBytes), a first row larger than
// it alone, and the next claims take the rest. Before, only Limit cut it:
// a claim of 500 rows of 600 KiB held 300 MB before the engine took them.
func TestClaimTakesByBytes(t *testing.T) {
	const (
		maxBytes = 1 << 20
		row      = 200 << 10
		big      = 3 << 20
	)
	f := MustFixture(t)
	ctx := context.Background()
	var ids []int64
	for i := range 20 {
		size := row
		if i == 10 {
			size = big
		}
		ids = append(ids, f.mustInsertLarge(t, fmt.Sprintf("large-%d", i), fmt.Sprint(i), size))
	}
	owner := ledger.NewOwner()
	var claimed []int64
	for round := 0; len(claimed) < len(ids); round++ {
		if round == len(ids) {
			t.Fatalf("claimed %v after %d claims, want every row %v", claimed, round, ids)
		}
		works, err := f.store.Claim(ctx, relay.ClaimQuery{All: true, Limit: 500, Owner: owner, MaxBytes: maxBytes})
		if err != nil {
			t.Fatal(err)
		}
		var events []*relay.Event
		for _, w := range works {
			events = append(events, w.Event)
			claimed = append(claimed, w.Event.ID)
		}
		if n := payloadBytes(events); len(events) > 1 && n > maxBytes {
			t.Fatalf("claim %d took %d rows of %d payload bytes, want at most %d bytes", round+1, len(events), n, maxBytes)
		}
		if slices.ContainsFunc(events, func(ev *relay.Event) bool { return len(ev.Payload) >= big }) && len(events) > 1 {
			t.Errorf("claim %d took the row larger than the limit with %d others, want it alone", round+1, len(events)-1)
		}
	}
	slices.Sort(claimed)
	if !slices.Equal(claimed, ids) {
		t.Errorf("claimed %v, want %v", claimed, ids)
	}
}
