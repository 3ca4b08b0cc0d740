package main

// Rows the ledger cannot record, and rows whose status is NULL: end to end,
// what an operator sees (docs/guarantees.md, "bad input never stops the
// stream"; "NULL status and NULL available_at").

import (
	"context"
	"fmt"
	"math/rand/v2"
	"regexp"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// randomKey returns an event key of n random letters and digits: text that
// no compression PostgreSQL applies to an index entry makes shorter.
func randomKey(prefix string, n int) string {
	const alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
	b := []byte(prefix)
	for len(b) < n {
		b = append(b, alnum[rand.IntN(len(alnum))])
	}
	return string(b)
}

// insertUnchecked inserts events of aggregate order/agg in one transaction
// with the table's triggers off (session_replication_role = replica, as a
// restore or a logical subscriber writes), so that migrate's bound on the
// key's length does not refuse them: rows written before migrate had it.
func (s *setup) insertUnchecked(t *testing.T, agg string, keys ...string) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL session_replication_role = replica"); err != nil {
			return err
		}
		for _, k := range keys {
			if _, err := tx.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload)
				VALUES ('order.placed', 'order', $1, $2, '{}')`, agg, k); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("insert %d rows: %v", len(keys), err)
	}
}

// waitRefused waits until key's row is dead-lettered with a last_error
// matching reason; it names the key by its first bytes.
func (s *setup) waitRefused(t *testing.T, key string, reason *regexp.Regexp) {
	t.Helper()
	var status, lastError string
	eventually(t, 30*time.Second, fmt.Sprintf("row %.20s… dead-lettered", key), func() bool {
		status, lastError = s.biRow(t, key)
		return status == "failed"
	})
	if !reason.MatchString(lastError) {
		t.Fatalf("row %.20s…: last_error %q does not match %q", key, lastError, reason)
	}
	t.Logf("dead letter %.20s…: %s", key, lastError)
}

// TestBadInput_EventKeyTheLedgerCannotHold: an event_key of 2,690 random
// bytes fits the outbox's unique index on event_key alone but not the
// ledger's primary key (event_key, action). Such an event is dead-lettered
// with a reason naming its length and the limit, and is sent to no sink
// (its delivery could never be recorded); the events of its transaction
// get their ledger rows and settle, the slot is acknowledged past them, and
// nothing is sent twice after a graceful restart. The same holds for such a
// row pending when the slot is created (the hand-over) and on the claim
// path (poll mode); a key of exactly the limit is delivered. Before, the
// ledger's refusal (SQLSTATE 54000) held the whole batch: retried forever
// on the stream, put back forever on the claim path.
func TestBadInput_EventKeyTheLedgerCannotHold(t *testing.T) {
	const long = 2690
	reason := regexp.MustCompile(regexp.QuoteMeta(fmt.Sprintf("event_key is %d bytes; the ledger holds at most %d", long, relay.MaxEventKeyBytes)))
	for _, mode := range []string{"replication", "poll"} {
		t.Run(mode, func(t *testing.T) {
			s := newSetup(t, pgtest.NewDatabase(t))
			cfg := s.configFileWith(t, "", biSource(mode))
			var refused, delivered []string
			if mode == "replication" {
				// Pending when the slot is created: the hand-over's.
				existing := randomKey("existing-", long)
				s.insertUnchecked(t, "E", "existing-1", existing, "existing-2")
				refused, delivered = append(refused, existing), append(delivered, "existing-1", "existing-2")
			}
			r := s.biRun(t, cfg)
			if mode == "replication" {
				s.waitSlot(t)
			}
			inTx := randomKey("tx-", long)
			s.insertUnchecked(t, "T", "tx-1", "tx-2", inTx, "tx-4", "tx-5")
			_, end := s.slotLSN(t)
			atLimit := randomKey("limit-", relay.MaxEventKeyBytes)
			s.biPublish(t, "order.placed", "order", "T", atLimit, `{}`)
			refused, delivered = append(refused, inTx), append(delivered, "tx-1", "tx-2", "tx-4", "tx-5", atLimit)

			for _, key := range refused {
				s.waitRefused(t, key, reason)
			}
			for _, key := range delivered {
				for _, sink := range []string{"hook", "nats"} {
					s.biWaitDelivered(t, sink, key)
				}
			}
			for _, key := range refused {
				for _, sink := range []string{"hook", "nats"} {
					if n := len(s.biAt(t, sink)[key]); n != 0 {
						t.Errorf("%s received the event whose key the ledger cannot hold %d times", sink, n)
					}
				}
				if got := s.biLedger(t, key); len(got) != 0 {
					t.Errorf("ledger rows of the refused key: %v", got)
				}
			}
			if mode == "poll" {
				return
			}
			eventually(t, 30*time.Second, "the slot acknowledged past the transaction", func() bool {
				confirmed, _ := s.slotLSN(t)
				return confirmed >= end
			})
			r.stop()
			s.biRun(t, cfg)
			s.biPublish(t, "order.placed", "order", "T", "after-restart", `{}`)
			s.biFlows(t, "after-restart")
			for key, ds := range byKey(s.hook.deliveries()) {
				if len(ds) > 1 {
					t.Errorf("%.40s… reached the webhook %d times across a graceful restart", key, len(ds))
				}
			}
		})
	}
}

// TestNoStall_NullStatusIsPending: a row inserted with a NULL status (the
// column is nullable) is pending. One pending when the slot is created is
// delivered by the slot's hand-over, still NULL (the table is locked
// against the sweeper writing it pending meanwhile), and the later events
// of its aggregate follow it; in poll mode the claim path delivers one
// before the later events of its aggregate. Before, the new slot's
// hand-over read only status = 'pending': the row was never streamed,
// never claimed, and only the stuck-rows alarm told of it; and the poll
// mode's claim sent the later event first (the order index held no NULL
// status).
func TestNoStall_NullStatusIsPending(t *testing.T) {
	for _, mode := range []string{"replication", "poll"} {
		t.Run(mode, func(t *testing.T) {
			s := newSetup(t, pgtest.NewDatabase(t))
			ctx := context.Background()
			insertNull := func() {
				t.Helper()
				if _, err := s.pool.Exec(ctx, `INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status)
					VALUES ('order.placed', 'order', 'null-agg', 'null-1', '{}', NULL)`); err != nil {
					t.Fatal(err)
				}
			}
			if mode == "replication" {
				insertNull()
				// No write to the outbox passes the lock (the stream's
				// deliveries are recorded in the ledger); the slot, made
				// meanwhile, has the row in its snapshot with a NULL status.
				lock, err := s.pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer lock.Rollback(ctx)
				if _, err := lock.Exec(ctx, "LOCK TABLE integration_outbox IN SHARE MODE"); err != nil {
					t.Fatal(err)
				}
				s.biRun(t, s.configFileWith(t, "", biSource(mode)))
				s.waitSlot(t)
				s.biFlows(t, "null-1")
				if err := lock.Rollback(ctx); err != nil {
					t.Fatal(err)
				}
			} else {
				// Claims every second, the sweeper every five: the row
				// inserted after the first sweep is claimed with its NULL
				// status, or waited for.
				s.biRun(t, s.configFileWith(t, "", "source: {mode: poll, poll_interval: 1s}"))
				s.biPublish(t, "order.placed", "order", "warm-up", "warm-up", `{}`)
				s.biFlows(t, "warm-up")
				insertNull()
			}
			s.biPublish(t, "order.placed", "order", "null-agg", "null-2", `{}`)
			s.biFlows(t, "null-1", "null-2")
			checkOrder(t, "hook", s.hook.deliveries())
			checkOrder(t, "nats", natsMessages(t, s.nats))
			if got := s.biLedger(t, "null-1"); got["hook"] != "delivered" || got["nats"] != "delivered" {
				t.Errorf("ledger of the NULL-status row: %v, want delivered at both sinks", got)
			}
		})
	}
}
