package ledger_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// randomText returns n bytes of random letters and digits: text that no
// compression PostgreSQL applies to an index entry makes shorter.
func randomText(n int) string {
	const alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	for i := range b {
		b[i] = alnum[rand.IntN(len(alnum))]
	}
	return string(b)
}

// ledgerWrites are the store calls that write a key into the ledger, each
// given one event of key delivered (or to deliver) to sink.
func ledgerWrites(f *fixture, store *ledger.Store, sink string) []struct {
	name  string
	write func(ctx context.Context, key string) error
} {
	return []struct {
		name  string
		write func(ctx context.Context, key string) error
	}{
		{"SettleStream", func(ctx context.Context, key string) error {
			_, err := store.SettleStream(ctx, []*relay.Work{streamWork(0, key, relay.Decision{Kind: relay.Done}, outcomePair(sink, relay.Delivered))}, "relay-a")
			return err
		}},
		{"PrepareStream of a sink that holds unknown outcomes", func(ctx context.Context, key string) error {
			return store.PrepareStream(ctx, []*relay.Work{streamWork(0, key, relay.Decision{}, &relay.Pair{Sink: sink, Hold: true})}, false, "relay-a")
		}},
		{"PrepareClaim", func(ctx context.Context, key string) error {
			return store.PrepareClaim(ctx, []*relay.Work{streamWork(0, key, relay.Decision{}, &relay.Pair{Sink: sink})}, "relay-a", time.Minute)
		}},
		{"SettleClaim", func(ctx context.Context, key string) error {
			p := &relay.Pair{Sink: sink, Claimed: true, Outcome: relay.Outcome{Kind: relay.Delivered}}
			_, err := store.SettleClaim(ctx, []*relay.Work{streamWork(0, key, relay.Decision{Kind: relay.Done}, p)}, "relay-a")
			return err
		}},
	}
}

// TestLedgerRefusingAKeyIsTheRowsError: an event_key too long for the
// ledger's primary key makes PostgreSQL refuse the index entry (SQLSTATE
// 54000, program limit exceeded). That is the row's own data, not the
// server's failure: every store call that writes the key into the ledger
// returns an error wrapping relay.ErrRowData, so the engine isolates the
// row instead of retrying its whole batch forever. Before, only classes 22
// and 23 wrapped it, and the claims made before sending not at all. The key
// (2,690 random bytes) is one the outbox's own unique index on event_key
// alone takes.
func TestLedgerRefusingAKeyIsTheRowsError(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	key := randomText(2690)
	for _, w := range ledgerWrites(f, f.store, "webhook") {
		t.Run(w.name, func(t *testing.T) {
			err := w.write(ctx, key)
			if !errors.Is(err, relay.ErrRowData) || !strings.Contains(err.Error(), "54000") {
				t.Fatalf("%s of a %d-byte key: %v; want an error wrapping relay.ErrRowData with SQLSTATE 54000", w.name, len(key), err)
			}
			if n := f.MustCount(t, "SELECT count(*) FROM integration_idempotency"); n != 0 {
				t.Errorf("%d ledger rows written", n)
			}
		})
	}
}

// TestLedgerHoldsTheLongestKey: the bounds hold with room to spare. An
// incompressible event_key of relay.MaxEventKeyBytes with a sink name of
// relay.MaxSinkNameBytes is written by every store call that writes the
// ledger.
func TestLedgerHoldsTheLongestKey(t *testing.T) {
	f := MustFixture(t)
	ctx := context.Background()
	sink := randomText(relay.MaxSinkNameBytes)
	store := f.store
	for _, w := range ledgerWrites(f, store, sink) {
		t.Run(w.name, func(t *testing.T) {
			key := randomText(relay.MaxEventKeyBytes)
			if err := w.write(ctx, key); err != nil {
				t.Fatalf("%s of a %d-byte key for a sink named with %d bytes: %v", w.name, len(key), len(sink), err)
			}
			if got := f.MustLedger(t, key); len(got) != 1 {
				t.Errorf("ledger rows of the key: %v, want one", got)
			}
		})
	}
}
