package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The faults of this file write rows of shapes the relay once mishandled
// (docs/guarantees.md, "Deleted rows and invisible rows", "NULL status and
// NULL available_at", "Bad input never stops the stream"), each at a moment
// the schedule draws, in an aggregate of its own (hd-c1, lk-c1, …: a fault
// kind runs once per cycle; the writers' are a000, a001, …), so that they
// need no writer's sequence.

// Log messages of `outbox-relay run` the faults count: a slot created, its
// hand-over's rows read (in the slot's snapshot) and recorded as settled,
// a row settled as deleted.
const (
	msgSlotCreated  = `"message":"created replication slot`
	msgHandOverRead = `"message":"read the rows pending in the new slot's snapshot`
	msgHandOverDone = `"message":"hand-over done`
	msgGone         = `"message":"the event's row was deleted before its outcome was written`
)

// longKeyMax is the longest key long-keys writes: the outbox's unique index
// on event_key takes an entry of at most 2,704 bytes, header included.
const longKeyMax = 2690

// logCount counts a message over every log of both relays.
func (s *stack) logCount(msg string) int {
	n := 0
	for _, r := range s.relays {
		n += r.countInLog(msg)
	}
	return n
}

// handoverDelete drops the slot while the receiver answers slowly, commits
// a few rows with a NULL status (pending at the new slot's creation unless
// it was created first), and as soon as the new slot's hand-over has read
// the rows pending in its snapshot, deletes a few pending rows the webhook
// has not got, as an application's cleanup would: rows the hand-over holds
// (the slow receiver keeps them in flight) whose outcome it has not
// written. Then it terminates the walsender (a reconnect while the
// hand-over runs) and heals the receiver. The relay must record the
// hand-over and stream again, each within 60 s of the deletion. The slot's
// row in pg_replication_slots is no signal: it is there while the slot is
// being created, before its snapshot exists.
func (s *stack) handoverDelete(ctx context.Context, rec *faultRecord) (string, error) {
	created, reads := s.logCount(msgSlotCreated), s.logCount(msgHandOverRead)
	handOvers, gone := s.logCount(msgHandOverDone), s.logCount(msgGone)
	s.hook.setMode(hookSlow)
	defer s.hook.setMode(hookHealthy)
	attempts, err := s.dropSlot(ctx)
	if err != nil {
		return "", err
	}
	dropped := s.since()
	agg := fmt.Sprintf("hd-c%d", rec.cycle+1)
	var rows []outboxRow
	for i := range 3 {
		eventType := "order.updated"
		if i == 0 {
			eventType = "order.created"
		}
		rows = append(rows, outboxRow{key: fmt.Sprintf("%s-%d", agg, i+1), agg: agg, eventType: eventType, seq: int64(i + 1),
			payload: fmt.Sprintf(`{"seq": %d, "fault": %q}`, i+1, handoverDelete), nullStatus: i != 1})
	}
	if err := s.load.commit(ctx, rows); err != nil {
		return "", fmt.Errorf("write rows with a NULL status: %w", err)
	}
	early := s.logCount(msgSlotCreated) > created
	for deadline := time.Now().Add(60 * time.Second); s.logCount(msgHandOverRead) == reads; {
		if time.Now().After(deadline) || !sleep(ctx, 10*time.Millisecond) {
			return "", fmt.Errorf("no relay logged %q within 60 s of the slot's drop", "read the rows pending in the new slot's snapshot")
		}
	}
	read := s.since()
	running := s.logCount(msgHandOverDone) == handOvers
	rec.deleted, err = s.deletePending(ctx, s.o.profile.deletes)
	rec.deletedAt = s.since()
	handOverDeadline := time.Now().Add(60 * time.Second)
	if err != nil {
		return "", err
	}
	if len(rec.deleted) == 0 {
		return "", errors.New("no pending row the webhook had not got to delete once the new slot's hand-over had read its rows")
	}
	var ended int
	for end := time.Now().Add(10 * time.Second); ; {
		ended, err = s.terminateWalsender(ctx)
		if err != nil || ended > 0 || time.Now().After(end) || !sleep(ctx, 20*time.Millisecond) {
			break
		}
	}
	s.hook.setMode(hookHealthy)
	rec.healed = s.since()
	if err == nil && ended == 0 {
		err = errors.New("no walsender streamed from the new slot within 10 s to terminate")
	}
	if err != nil {
		return "", err
	}
	if err := s.waitStreaming(ctx, 60*time.Second); err != nil {
		return "", err
	}
	streaming := s.since() - rec.healed
	for s.logCount(msgHandOverDone) == handOvers {
		if time.Now().After(handOverDeadline) || !sleep(ctx, 100*time.Millisecond) {
			return "", fmt.Errorf("no relay logged %q within 60 s of the deletion of %d rows during the new slot's hand-over (a stall, docs/guarantees.md, \"Deleted rows and invisible rows\")",
				"hand-over done", len(rec.deleted))
		}
	}
	recorded := s.since() - rec.deletedAt
	pending := "pending when the slot was created"
	if early {
		pending = "committed after the slot was created"
	}
	during := "while the hand-over ran"
	if !running {
		during = "after the hand-over was recorded"
	}
	return fmt.Sprintf("dropped at attempt %d; 2 rows with a NULL status %s; the hand-over read its rows %.2f s after the drop; %d rows deleted %.0f ms after that, %s; walsender terminated; hand-over recorded within %.1f s of the deletion, streaming again %.1f s after the heal; %d rows settled as deleted (the relays' log)",
		attempts, pending, (read - dropped).Seconds(), len(rec.deleted), float64((rec.deletedAt - read).Milliseconds()), during, recorded.Seconds(), streaming.Seconds(), s.logCount(msgGone)-gone), nil
}

// deletePending deletes up to n of the oldest rows of the writers'
// aggregates still pending (status pending or NULL), due, not handed to the
// claim path, that the webhook has no delivered ledger row for — the rows a
// new slot's hand-over or the stream holds — and returns their keys: the
// ids first, then DELETE … WHERE id = ANY, as an application's cleanup
// would; a row no longer pending by then is left. The faults' own rows
// are left alone.
func (s *stack) deletePending(ctx context.Context, n int) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rows, err := s.pool.Query(ctx, `SELECT o.id FROM integration_outbox AS o
		WHERE (o.status IS NULL OR o.status = 'pending') AND o.aggregate_id ~ '^a[0-9]+$'
		  AND o.handoff_at IS NULL AND coalesce(o.available_at, now()) <= now()
		  AND NOT EXISTS (SELECT FROM integration_idempotency AS l WHERE l.event_key = o.event_key AND l.action = $1 AND l.state = 'delivered')
		ORDER BY o.id LIMIT $2`, hookAction, n)
	if err != nil {
		return nil, fmt.Errorf("find pending rows to delete: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("find pending rows to delete: %w", err)
	}
	rows, err = s.pool.Query(ctx, `DELETE FROM integration_outbox WHERE id = ANY($1) AND (status IS NULL OR status = 'pending') RETURNING event_key`, ids)
	if err != nil {
		return nil, fmt.Errorf("delete %d pending rows: %w", len(ids), err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("delete %d pending rows: %w", len(ids), err)
	}
	return keys, nil
}

// writeLongKeys commits, in one transaction with the bound on key lengths
// off (a legacy row predating migration 012), rows of an aggregate of its
// own whose keys alternate: a normal key, then one of
// relay.MaxEventKeyBytes+1..longKeyMax random bytes, …, a normal key last.
// It waits, at most 30 s, for the over-long ones to be dead-lettered, for
// the note; the checks judge them at the end.
func (s *stack) writeLongKeys(ctx context.Context, rec *faultRecord) (string, error) {
	rng := rand.New(rand.NewPCG(s.o.seed, 0x6c6f6e67+uint64(rec.cycle)))
	agg := fmt.Sprintf("lk-c%d", rec.cycle+1)
	var rows []outboxRow
	shortest, longest := longKeyMax, 0
	for i := range 2*s.o.profile.longKeys + 1 {
		key := fmt.Sprintf("%s-%d", agg, i+1)
		eventType := "order.updated"
		if i == 0 {
			eventType = "order.created"
		}
		if i%2 == 1 {
			n := relay.MaxEventKeyBytes + 1 + rng.IntN(longKeyMax-relay.MaxEventKeyBytes)
			key += "-" + randomText(rng, n-len(key)-1)
			rec.longKeys = append(rec.longKeys, key)
			shortest, longest = min(shortest, n), max(longest, n)
		} else {
			rec.beside = append(rec.beside, key)
		}
		rows = append(rows, outboxRow{key: key, agg: agg, eventType: eventType, seq: int64(i + 1),
			payload: fmt.Sprintf(`{"seq": %d, "fault": %q}`, i+1, longKeys), legacy: true})
	}
	rec.at = s.since()
	err := s.load.commit(ctx, rows)
	rec.healed = s.since()
	if err != nil {
		return "", fmt.Errorf("write %d rows with over-long keys: %w", len(rows), err)
	}
	failed := 0
	for deadline := time.Now().Add(30 * time.Second); ; {
		err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+allOutbox+` AS o WHERE event_key = ANY($1) AND status = 'failed'`, rec.longKeys).Scan(&failed)
		if err == nil && failed == len(rec.longKeys) || time.Now().After(deadline) || !sleep(ctx, 100*time.Millisecond) {
			break
		}
	}
	outcome := fmt.Sprintf("dead-lettered %.1f s after the commit", (s.since() - rec.healed).Seconds())
	if failed < len(rec.longKeys) {
		outcome = fmt.Sprintf("%d of them dead-lettered 30 s after the commit", failed)
	}
	return fmt.Sprintf("%d keys of %d–%d bytes among %d rows with normal keys in one transaction; %s",
		len(rec.longKeys), shortest, longest, len(rec.beside), outcome), nil
}
