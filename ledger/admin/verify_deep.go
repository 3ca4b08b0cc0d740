package admin

import (
	"context"
	"fmt"
	"hash/maphash"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// The deep checks read what a sink itself holds (docs/operations.md,
// "verify"): a JetStream stream's messages (StreamAudit, fed by sink/nats),
// or a receiver's own table of the events it applied (a receiver query).

// StreamCopy is one copy of an event that a stream holds, as the sink's
// reader reports it.
type StreamCopy struct {
	EventKey string
	// Replay is 0, or n for the n-th operator replay's copy.
	Replay int
	// MsgID is the copy's idempotency id (Nats-Msg-Id).
	MsgID string
	// Stored is when the stream stored it.
	Stored time.Time
}

// StreamTally counts what a stream audit read and judged.
type StreamTally struct {
	// Read counts this deployment's copies read; Replays those of them an
	// operator replay published.
	Read    int64 `json:"read"`
	Replays int64 `json:"replays"`
	// Repeats counts copies stored again under the same id: a retry
	// stored past the stream's duplicate window, the repeat the contract
	// allows (docs/guarantees.md, "at most one delivery").
	Repeats int64 `json:"repeats"`
	// Foreign counts messages on the sink's subjects that are not this
	// deployment's events (the reader counts them).
	Foreign int64 `json:"foreign"`
	// NotCheckable counts delivered rows created before RemovedBefore
	// that have no copy: the stream's own retention may have removed it.
	NotCheckable int64      `json:"not_checkable"`
	FirstStored  *time.Time `json:"first_stored,omitempty"`
	// ReadSeconds is how long reading the stream took (the reader sets
	// it).
	ReadSeconds float64 `json:"read_seconds"`
}

// StreamAudit compares the copies a stream holds with the ledger: every
// event of the window the ledger shows delivered to the sink has a copy;
// no event has copies under two ids (a repeat carries the same id,
// docs/guarantees.md); and the stream holds no event the ledger does not
// show delivered, unless its row is still on its way.
//
// The caller reads the stream (from the window's start, before Verify
// runs) into it with Add, and sets CatchUp to read the copies stored since:
// an event delivered while Verify read the outbox has its copy in the
// stream before its ledger row is written, so after CatchUp every delivered
// event's copy has been read. A StreamAudit is used by one goroutine.
type StreamAudit struct {
	Tally StreamTally
	// RemovedBefore, when set, is when the stream's first message was
	// stored, if its retention has removed earlier ones: a row created
	// before it without a copy is counted NotCheckable, not missing.
	RemovedBefore time.Time
	// CatchUp, when set, adds the copies stored since the first read.
	CatchUp func(ctx context.Context) error

	seed       maphash.Seed
	got        map[string]storedCopies
	candidates []receiverKey // delivered, no copy read yet
}

// storedCopies are the copies of one event with one replay number; next
// holds the other replay numbers' (rare).
type storedCopies struct {
	replay int
	count  int
	idHash uint64
	twoIDs bool
	seen   bool  // judged with a row of the window
	stored int64 // the latest copy's, Unix nanoseconds
	next   *storedCopies
}

// NewStreamAudit returns an empty audit.
func NewStreamAudit() *StreamAudit {
	return &StreamAudit{seed: maphash.MakeSeed(), got: map[string]storedCopies{}}
}

// Add records one copy.
func (a *StreamAudit) Add(c StreamCopy) {
	a.Tally.Read++
	if c.Replay > 0 {
		a.Tally.Replays++
	}
	h := maphash.String(a.seed, c.MsgID)
	stored := c.Stored.UnixNano()
	head, ok := a.got[c.EventKey]
	if !ok {
		a.got[c.EventKey] = storedCopies{replay: c.Replay, count: 1, idHash: h, stored: stored}
		return
	}
	head.stored = max(head.stored, stored)
	for n := &head; ; n = n.next {
		if n.replay == c.Replay {
			n.count++
			if n.idHash == h {
				a.Tally.Repeats++
			} else {
				n.twoIDs = true
			}
			break
		}
		if n.next == nil {
			n.next = &storedCopies{replay: c.Replay, count: 1, idHash: h}
			break
		}
	}
	a.got[c.EventKey] = head
}

// row judges one row of the window: delivered says whether the ledger
// shows it delivered to the sink.
func (a *StreamAudit) row(r *VerifyReport, sink string, x *verifyRow, delivered bool, fate rowFate) {
	head, ok := a.got[x.key]
	if !ok {
		switch {
		case !delivered:
		case !a.RemovedBefore.IsZero() && x.created.Valid && x.created.Time.Before(a.RemovedBefore):
			a.Tally.NotCheckable++
		default:
			a.candidates = append(a.candidates, receiverKey{x.id, x.key})
		}
		return
	}
	head.seen = true
	a.got[x.key] = head
	a.duplicates(r, sink, x.id, x.key, &head)
	if !delivered && fate != fateOnItsWay {
		r.add(GapUnrecorded, sink, Gap{ID: x.id, EventKey: x.key, Detail: "in the stream, but the ledger shows no delivery to it; row " + fateName(fate)})
	}
}

func (a *StreamAudit) duplicates(r *VerifyReport, sink string, id int64, key string, head *storedCopies) {
	for n := head; n != nil; n = n.next {
		if n.twoIDs {
			what := "the event"
			if n.replay > 0 {
				what = fmt.Sprintf("replay %d", n.replay)
			}
			r.add(GapDuplicate, sink, Gap{ID: id, EventKey: key, Detail: fmt.Sprintf("%s stored %d times under different ids", what, n.count)})
		}
	}
}

// finish catches up with the stream and judges what is left: delivered
// rows without a copy, and copies of events outside the window.
func (a *StreamAudit) finish(ctx context.Context, v *verifier, sink string) error {
	if a.CatchUp != nil {
		if err := a.CatchUp(ctx); err != nil {
			return fmt.Errorf("verify: sink %s: read the stream again: %w", sink, err)
		}
	}
	r := v.r
	for _, c := range a.candidates {
		head, ok := a.got[c.key]
		if !ok {
			r.add(GapMissingAtSink, sink, Gap{ID: c.id, EventKey: c.key, Detail: "delivered by the ledger, not in the stream"})
			continue
		}
		head.seen = true
		a.got[c.key] = head
		a.duplicates(r, sink, c.id, c.key, &head)
	}
	// A copy whose row is gone is judged only when retention could not
	// have removed the row since the copy was stored: it deletes a row
	// with its ledger rows, done_after after the row settled.
	var rest []string
	prunable := map[string]bool{}
	for key, head := range a.got {
		if head.seen {
			continue
		}
		rest = append(rest, key)
		if d := v.o.RetentionDoneAfter; d > 0 && !time.Unix(0, head.stored).After(r.AsOf.Add(-d)) {
			prunable[key] = true
		}
	}
	slices.Sort(rest)
	for len(rest) > 0 {
		n := min(len(rest), v.o.Slice)
		batch := rest[:n]
		rest = rest[n:]
		rows, err := v.db.Query(ctx, v.q.unrecorded, batch, sink)
		if err != nil {
			return fmt.Errorf("verify: sink %s: look up the stream's events outside the window: %w", sink, err)
		}
		var (
			key               string
			id                *int64
			status, lastError pgtype.Text
			delivered         bool
		)
		_, err = pgx.ForEachRow(rows, []any{&key, &id, &status, &lastError, &delivered}, func() error {
			switch {
			case delivered:
			case id == nil && prunable[key]:
			case id == nil:
				r.add(GapUnrecorded, sink, Gap{EventKey: key, Detail: "in the stream; no outbox row, no delivered ledger row"})
			default:
				if fate := classify(status, lastError); fate != fateOnItsWay {
					r.add(GapUnrecorded, sink, Gap{ID: *id, EventKey: key, Detail: "in the stream, but the ledger shows no delivery to it; row " + fateName(fate)})
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("verify: sink %s: look up the stream's events outside the window: %w", sink, err)
		}
	}
	return nil
}

func fateName(f rowFate) string {
	switch f {
	case fateOnItsWay:
		return "on its way"
	case fateDone:
		return "done"
	case fateDeadLettered:
		return "failed"
	case fateHeld:
		return "held"
	case fateDiscarded:
		return "discarded"
	}
	return "in a status the relay does not write"
}

// receiverKey is a row of the window the ledger shows delivered to a sink.
type receiverKey struct {
	id  int64
	key string
}

// checkReceiver asks the receiver's own table (s.ReceiverQuery, with $1 the
// keys) which of keys it applied; each one it did not is missing there.
func (v *verifier) checkReceiver(ctx context.Context, s VerifySink, keys []receiverKey) error {
	arg := make([]string, len(keys))
	for i, k := range keys {
		arg[i] = k.key
	}
	rows, err := v.db.Query(ctx, s.ReceiverQuery, arg)
	if err != nil {
		return fmt.Errorf("verify: sink %s: the receiver query: %w", s.Name, err)
	}
	applied := make(map[string]bool, len(keys))
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			rows.Close()
			return fmt.Errorf("verify: sink %s: the receiver query: %w", s.Name, err)
		}
		if len(vals) == 0 {
			rows.Close()
			return fmt.Errorf("verify: sink %s: the receiver query returns no column; it must return the applied event keys first", s.Name)
		}
		k, ok := vals[0].(string)
		if !ok {
			rows.Close()
			return fmt.Errorf("verify: sink %s: the receiver query's first column is %T, not the event key (text)", s.Name, vals[0])
		}
		applied[k] = true
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("verify: sink %s: the receiver query: %w", s.Name, err)
	}
	*v.r.tally(s.Name).Receiver += int64(len(keys))
	for _, k := range keys {
		if !applied[k.key] {
			v.r.add(GapMissingAtSink, s.Name, Gap{ID: k.id, EventKey: k.key, Detail: "delivered by the ledger, not in the receiver's table"})
		}
	}
	return nil
}
