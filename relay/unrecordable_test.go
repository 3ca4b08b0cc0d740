package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// ledgerRefuses is what the ledger answers a claim of pairs whose key is
// longer than it holds: PostgreSQL's index row limit, a refusal of that
// row's data.
func ledgerRefuses(works []*relay.Work) error {
	for _, w := range works {
		if len(w.Pairs) > 0 && len(w.Event.EventKey) > relay.MaxEventKeyBytes {
			return fmt.Errorf("claim ledger pairs: ERROR: index row size 2712 exceeds btree version 4 maximum 2704 (SQLSTATE 54000): %w", relay.ErrRowData)
		}
	}
	return nil
}

// keyedEvent is event(id, aggregate) with its event_key n bytes long.
func keyedEvent(id int64, aggregate string, n int) *relay.Event {
	ev := event(id, aggregate)
	ev.EventKey = fmt.Sprintf("k%d-", id) + strings.Repeat("x", n-len(fmt.Sprintf("k%d-", id)))
	return ev
}

// TestEngine_KeyTheLedgerCannotHoldIsNeverSent: an event whose event_key is
// longer than the ledger holds (relay.MaxEventKeyBytes) is dead-lettered
// with a reason naming its length and the limit, on every path that feeds
// the core — the stream, a new slot's hand-over, the claim path — without
// being sent and without a ledger write for it (which PostgreSQL would
// refuse: the ledger here refuses such a batch, as PostgreSQL does). The
// events beside it, one with a key of exactly the limit among them, are
// delivered. Before, it was sent, and the ledger's refusal of the batch's
// claims held every event of the batch back: retried forever on the
// stream, put back forever on the claim path.
func TestEngine_KeyTheLedgerCannotHoldIsNeverSent(t *testing.T) {
	for _, path := range []string{"stream", "hand-over", "claim"} {
		t.Run(path, func(t *testing.T) {
			store := newFakeStore()
			var mu sync.Mutex
			var prepared []string // the keys whose pairs the stores were asked to claim
			prepare := store.prepareStream
			store.prepareStream = func(ctx context.Context, works []*relay.Work, restreamed bool, owner string) error {
				mu.Lock()
				for _, w := range works {
					if len(w.Pairs) > 0 {
						prepared = append(prepared, w.Event.EventKey)
					}
				}
				mu.Unlock()
				if err := ledgerRefuses(works); err != nil {
					return err
				}
				return prepare(ctx, works, restreamed, owner)
			}
			rec := &claimRecorder{settled: map[int64]relay.Decision{}}
			claims := &fakeClaimStore{settleClaim: rec.settle, prepareClaim: func(_ context.Context, works []*relay.Work, _ string, _ time.Duration) error {
				mu.Lock()
				for _, w := range works {
					if len(w.Pairs) > 0 {
						prepared = append(prepared, w.Event.EventKey)
					}
				}
				mu.Unlock()
				if err := ledgerRefuses(works); err != nil {
					return err
				}
				for _, w := range works {
					for _, p := range w.Pairs {
						p.Claimed = true
					}
				}
				return nil
			}}
			sink := newFakeSink("s", nil)
			// A sink that holds unknown outcomes: the stream claims its pairs
			// in the ledger before sending.
			held := newFakeSink("h", nil)
			e := startEngine(t, relay.EngineConfig{Stream: store, Claim: claims, Owner: "me",
				Routes: []relay.Route{{Sink: sink}, {Sink: held, Hold: true}}})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			events := []*relay.Event{keyedEvent(1, "a", 10), keyedEvent(2, "a", relay.MaxEventKeyBytes+1), keyedEvent(3, "a", relay.MaxEventKeyBytes)}
			decision := func(id int64) (relay.Decision, bool) {
				if path == "claim" {
					return rec.decision(id)
				}
				_, _, dead := store.snapshot()
				reason, ok := dead[id]
				return relay.Decision{Kind: relay.DeadLetter, Reason: reason}, ok
			}
			switch path {
			case "stream":
				if err := e.Stream().Submit(ctx, events); err != nil {
					t.Fatalf("Submit: %v", err)
				}
				e.Stream().Commit(100)
				waitSettledAt(t, e.Stream(), 100)
			case "hand-over":
				if err := e.Stream().HandOver(ctx, events); err != nil {
					t.Fatalf("HandOver: %v", err)
				}
				if err := e.Stream().HandOverSettled(ctx); err != nil {
					t.Fatalf("HandOverSettled: %v", err)
				}
			case "claim":
				var works []*relay.Work
				for _, ev := range events {
					ev.Status = "processing"
					works = append(works, &relay.Work{Event: ev})
				}
				if notTaken, err := e.SubmitClaimed(ctx, works); err != nil || len(notTaken) > 0 {
					t.Fatalf("SubmitClaimed: %v, %d rows not taken", err, len(notTaken))
				}
				if err := e.WaitPathSettled(ctx, relay.PathClaim); err != nil {
					t.Fatal(err)
				}
			}
			for _, s := range []*fakeSink{sink, held} {
				if sent := s.sentIDs(); slices.Contains(sent, 2) || !slices.Contains(sent, 1) || !slices.Contains(sent, 3) {
					t.Errorf("sink %s was sent %v: want 1 and 3 (its key is exactly the limit), never 2", s.name, sent)
				}
			}
			d, ok := decision(2)
			want := fmt.Sprintf("event_key is %d bytes; the ledger holds at most %d", relay.MaxEventKeyBytes+1, relay.MaxEventKeyBytes)
			if !ok || d.Kind != relay.DeadLetter || !strings.Contains(d.Reason, want) {
				t.Errorf("event 2 settled as %+v (written: %v), want a dead letter saying %q", d, ok, want)
			}
			mu.Lock()
			defer mu.Unlock()
			if slices.Contains(prepared, events[1].EventKey) {
				t.Errorf("the ledger was asked to claim event 2's pairs")
			}
		})
	}
}

// TestEngine_PrepareRowDataErrorIsIsolated: when the store refuses one
// row's data while it prepares a batch (the ledger claims made before
// sending: relay.ErrRowData), that row alone is dead-lettered unsent with
// the store's reason, and the rows prepared with it are sent — on the claim
// path (PrepareClaim) and on the stream for a sink that holds unknown
// outcomes (PrepareStream). Before, the claim path put the whole batch
// back, to fail the same way at every claim, and the stream retried it
// forever.
func TestEngine_PrepareRowDataErrorIsIsolated(t *testing.T) {
	refusal := errors.New("ERROR: value too long for the ledger (SQLSTATE 54000)")
	refuse := func(works []*relay.Work) error {
		for _, w := range works {
			if w.Event.EventKey == "k2" {
				return fmt.Errorf("claim %d ledger pairs: %w: %w", len(works), relay.ErrRowData, refusal)
			}
		}
		return nil
	}
	for _, path := range []string{"stream", "claim"} {
		t.Run(path, func(t *testing.T) {
			store := newFakeStore()
			prepare := store.prepareStream
			store.prepareStream = func(ctx context.Context, works []*relay.Work, restreamed bool, owner string) error {
				if err := refuse(works); err != nil {
					return err
				}
				return prepare(ctx, works, restreamed, owner)
			}
			rec := &claimRecorder{settled: map[int64]relay.Decision{}}
			claims := &fakeClaimStore{settleClaim: rec.settle, prepareClaim: func(_ context.Context, works []*relay.Work, _ string, _ time.Duration) error {
				if err := refuse(works); err != nil {
					return err
				}
				for _, w := range works {
					for _, p := range w.Pairs {
						p.Claimed = true
					}
				}
				return nil
			}}
			sink := newFakeSink("h", nil)
			e := startEngine(t, relay.EngineConfig{Stream: store, Claim: claims, Owner: "me", Routes: []relay.Route{{Sink: sink, Hold: true}}})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			const rows = 5
			var reason string
			var dead bool
			switch path {
			case "stream":
				var events []*relay.Event
				for i := int64(1); i <= rows; i++ {
					events = append(events, event(i, fmt.Sprint(i)))
				}
				if err := e.Stream().Submit(ctx, events); err != nil {
					t.Fatalf("Submit: %v", err)
				}
				e.Stream().Commit(100)
				waitSettledAt(t, e.Stream(), 100)
				_, _, deadLetters := store.snapshot()
				reason, dead = deadLetters[2]
			case "claim":
				var works []*relay.Work
				for i := int64(1); i <= rows; i++ {
					works = append(works, claimWork(i, fmt.Sprint(i)))
				}
				if notTaken, err := e.SubmitClaimed(ctx, works); err != nil || len(notTaken) > 0 {
					t.Fatalf("SubmitClaimed: %v, %d rows not taken", err, len(notTaken))
				}
				if err := e.WaitPathSettled(ctx, relay.PathClaim); err != nil {
					t.Fatal(err)
				}
				d, _ := rec.decision(2)
				reason, dead = d.Reason, d.Kind == relay.DeadLetter
			}
			sent := sink.sentIDs()
			slices.Sort(sent)
			if !slices.Equal(sent, []int64{1, 3, 4, 5}) {
				t.Errorf("sent %v, want [1 3 4 5]: every row but the refused one", sent)
			}
			if !dead || !strings.Contains(reason, "SQLSTATE 54000") {
				t.Errorf("the refused row: dead letter %v, reason %q; want a dead letter naming the store's refusal", dead, reason)
			}
		})
	}
}

// TestNewEngine_RefusesASinkNameTheLedgerCannotHold: a sink's name is the
// ledger's action, bounded like the event key (relay.MaxSinkNameBytes); a
// longer one is a configuration error, a name of exactly the limit is not.
func TestNewEngine_RefusesASinkNameTheLedgerCannotHold(t *testing.T) {
	for _, n := range []int{relay.MaxSinkNameBytes, relay.MaxSinkNameBytes + 1} {
		_, err := relay.NewEngine(relay.EngineConfig{Stream: newFakeStore(), Routes: []relay.Route{{Sink: newFakeSink(strings.Repeat("s", n), nil)}}})
		want := fmt.Sprintf("its name is %d bytes; the ledger's action holds at most %d", n, relay.MaxSinkNameBytes)
		if ok := n <= relay.MaxSinkNameBytes; ok != (err == nil) || !ok && !strings.Contains(err.Error(), want) {
			t.Errorf("NewEngine with a sink name of %d bytes: %v", n, err)
		}
	}
}
