package ledger

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// recordFlushAt is how many delivered ids may wait for a checkpoint before
// SettleStream writes them itself (a transaction of many thousands of events
// is not acknowledged until its last event settles, so no checkpoint comes
// meanwhile). recordMax bounds them when that write fails too: the engine
// then stops taking events (docs/guarantees.md, "back-pressure").
const (
	recordFlushAt = 2048
	recordMax     = 4096
)

// errRecordFull is SettleStream's refusal while recordMax ids wait.
var errRecordFull = fmt.Errorf("the delivered record holds %d ids waiting for a checkpoint (checkpoints are failing): waiting", recordMax)

// record is the stream's delivered ids not yet written.
type record struct {
	mu  sync.Mutex
	ids []int64
	// writing serialises the writes of the record (checkpoints, flushes),
	// so that a flush returns only when every id taken before it is
	// committed. A semaphore, so that waiting for it ends with ctx.
	writing   *semaphore.Weighted
	lastWrite time.Time // guarded by mu
}

func newRecord() *record { return &record{writing: semaphore.NewWeighted(1), lastWrite: time.Now()} }

// recordEvery is how often SettleStream writes the record itself, with an
// asynchronous commit, between checkpoints: the ids become visible at once,
// so after a crash of the relay (not of PostgreSQL) at most this much of
// its deliveries are sent again. The checkpoint's synchronous commit makes
// them durable before the slot is acknowledged.
const recordEvery = 50 * time.Millisecond

// add adds ids; it reports whether the record is due for a write of its
// own.
func (r *record) add(ids []int64) (flush bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.ids) >= recordMax {
		return true, errRecordFull
	}
	r.ids = append(r.ids, ids...)
	return len(r.ids) >= recordFlushAt || time.Since(r.lastWrite) >= recordEvery, nil
}

// take empties the record and returns what it held.
func (r *record) take() []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	ids := r.ids
	r.ids = nil
	r.lastWrite = time.Now()
	return ids
}

// waiting returns the ids the record holds, once no write of it is in
// flight: every id taken out before is then committed (visible to a query
// made after) or put back.
func (r *record) waiting(ctx context.Context) (map[int64]struct{}, error) {
	if err := r.writing.Acquire(ctx, 1); err != nil {
		return nil, err
	}
	defer r.writing.Release(1)
	r.mu.Lock()
	defer r.mu.Unlock()
	set := make(map[int64]struct{}, len(r.ids))
	for _, id := range r.ids {
		set[id] = struct{}{}
	}
	return set, nil
}

// putBack returns ids a failed checkpoint did not write.
func (r *record) putBack(ids []int64) {
	if len(ids) == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ids = append(ids, r.ids...)
}

// LoadCheckpoint returns the confirmed position saved for slot, or 0 when
// none was saved. It only reads.
func (s *Store) LoadCheckpoint(ctx context.Context, slot string) (relay.LSN, error) {
	var lsn relay.LSN
	err := s.pool.QueryRow(ctx, s.sql.loadCheckpoint, slot).Scan(&lsn)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("load checkpoint of slot %s: %w", slot, err)
	}
	return lsn, nil
}

// SaveCheckpoint records lsn as slot's confirmed position, and writes the
// delivered record: the ids of the events the stream delivered to every
// sink since the last checkpoint. The position never moves backwards:
// saving an LSN below the stored one keeps the stored one (and refreshes
// updated_at), so a late or repeated save is harmless and the call is safe
// to repeat.
//
// The commit is synchronous (synchronous_commit = on for this transaction,
// whatever the role's default; a server set to remote_apply keeps it). When
// SaveCheckpoint returns nil the WAL is flushed up to its commit, so every
// asynchronous commit made before it on this server — the other outcomes
// SettleStream wrote — is durable too: only then may the slot be
// acknowledged up to lsn. When the server names standbys in
// synchronized_standby_slots (PostgreSQL 17+), it also waits until they
// have flushed that WAL: a failover slot synced to a standby must not stand
// past events whose outcomes the standby lacks (docs/failover.md). On an
// error before the commit the ids are kept for the next try; the commit is
// refused on another timeline than the stream's (see StreamFrom).
func (s *Store) SaveCheckpoint(ctx context.Context, slot string, lsn relay.LSN) error {
	standbys, err := s.saveCheckpoint(ctx, slot, lsn)
	if err != nil {
		return fmt.Errorf("save checkpoint %s of slot %s: %w", lsn, slot, err)
	}
	// Outside the record's lock: waiting for a standby must not hold up
	// the record's writes, nor with them the engine.
	if err := s.waitStandbys(ctx, standbys); err != nil {
		return fmt.Errorf("save checkpoint %s of slot %s: %w", lsn, slot, err)
	}
	return nil
}

// saveCheckpoint writes the checkpoint and the record, and returns the
// server's synchronized_standby_slots.
func (s *Store) saveCheckpoint(ctx context.Context, slot string, lsn relay.LSN) (standbys string, err error) {
	if err := s.record.writing.Acquire(ctx, 1); err != nil {
		return "", err
	}
	defer s.record.writing.Release(1)
	ids := s.record.take()
	err = s.writeRecord(ctx, s.sql.setSynchronousCommit, ids,
		exec("save the checkpoint", s.sql.saveCheckpoint, slot, lsn),
		step{kind: "read synchronized_standby_slots", sql: standbySlotsSQL, check: func(row pgx.Row) error { return row.Scan(&standbys) }})
	if err != nil {
		s.record.putBack(ids)
		return "", err
	}
	return standbys, nil
}

// writeRecord writes ids into the delivered record, then the other steps,
// in one transaction. The INSERT is a plain one of the ids the record lacks
// (ON CONFLICT's speculative insertion costs about 1.7 times as much per id,
// docs/performance.md); when another session inserted one of them between
// its check and its insert (two relays around a takeover), the unique
// violation is not a row's fault: the transaction is made again with ON
// CONFLICT DO NOTHING (TestRecordWriteMeetsAConcurrentWriterOfTheSameIDs).
func (s *Store) writeRecord(ctx context.Context, setCommit string, ids []int64, then ...step) error {
	write := func(sql string) error {
		steps := then
		if len(ids) > 0 {
			steps = append([]step{exec(fmt.Sprintf("record %d delivered events", len(ids)), sql, ids)}, then...)
		}
		_, err := s.runStreamSteps(ctx, setCommit, steps)
		return err
	}
	err := write(s.sql.recordDelivered)
	if len(ids) > 0 && hasSQLState(err, "23505") { // unique_violation
		err = write(s.sql.recordDeliveredAgain)
	}
	return err
}

// standbySlotsSQL reads synchronized_standby_slots ("" before PostgreSQL 17,
// which lacks it).
const standbySlotsSQL = `SELECT coalesce(current_setting('synchronized_standby_slots', true), '')`

// flushRecord writes the delivered ids waiting for a checkpoint, in a
// transaction of their own: synchronous before a slot is made, otherwise
// asynchronous (the next checkpoint makes it durable).
func (s *Store) flushRecord(ctx context.Context, sync bool) error {
	if err := s.record.writing.Acquire(ctx, 1); err != nil {
		return err
	}
	defer s.record.writing.Release(1)
	ids := s.record.take()
	if len(ids) == 0 {
		return nil
	}
	commit := s.sql.setAsyncCommit
	if sync {
		commit = s.sql.setSynchronousCommit
	}
	if err := s.writeRecord(ctx, commit, ids); err != nil {
		s.record.putBack(ids)
		return err
	}
	return nil
}
