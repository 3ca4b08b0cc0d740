package ledger

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The stream's origin: which server its events come from.
//
// After a promotion the new primary may lack the old primary's last
// transactions, and it hands out their ids again to new rows (sequences are
// logged ahead, and that log may be lost too). An outcome of an event
// streamed from the old primary that is written by id on the new one —
// the delivered record, status done, a dead letter, a hold — could mark a
// different, undelivered row, which would then never be delivered. So the
// stream's by-id writes go only to the timeline its events came from
// (docs/failover.md, "what is written where"): each such transaction first
// reads the server's timeline and rolls back on another; and when the
// stream starts on a new timeline, the ids not yet written are dropped.
// The events the new primary does have come again — from the synced slot,
// or through a new slot's hand-over to the claim path — and may be
// delivered a second time, with the same id and body.

// originState is the server the stream's writes are bound to.
type originState struct {
	mu        sync.Mutex
	set       bool
	systemID  string
	timeline  int32
	termBound bool // bound by a StreamFrom of the current term
}

// BeginTerm starts a leadership term (docs/architecture.md): the first
// StreamFrom of the term may bind the stream to a new server; a later one
// on another server fails with relay.ErrServerChanged, so that the events
// of two servers never share a term.
func (s *Store) BeginTerm() {
	s.origin.mu.Lock()
	defer s.origin.mu.Unlock()
	s.origin.termBound = false
}

// StreamFrom binds the stream's writes to the server a replication session
// streams from, named by IDENTIFY_SYSTEM's system identifier and timeline;
// the stream calls it at the start of every session, before it writes
// anything. From then on SettleStream and SaveCheckpoint check in
// their own transaction that the server is on that timeline and roll back
// otherwise. Within a term (see BeginTerm) only the first session may change
// the server: a later change returns relay.ErrServerChanged. Safe to repeat
// for the same server.
func (s *Store) StreamFrom(_ context.Context, systemID string, timeline int32) error {
	o := &s.origin
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.set && o.termBound && (o.systemID != systemID || o.timeline != timeline) {
		return fmt.Errorf("%w: the stream moved from system %s timeline %d to system %s timeline %d",
			relay.ErrServerChanged, o.systemID, o.timeline, systemID, timeline)
	}
	o.set, o.systemID, o.timeline, o.termBound = true, systemID, timeline, true
	return nil
}

// originGuard returns the step that checks the server's system identifier
// and timeline against the stream's origin, or false when the stream has
// not bound one.
func (s *Store) originGuard() (step, bool) {
	s.origin.mu.Lock()
	defer s.origin.mu.Unlock()
	if !s.origin.set {
		return step{}, false
	}
	want, systemID := s.origin.timeline, s.origin.systemID
	return step{kind: "check the server's timeline", sql: catalog.Get("ServerTimeline"), check: func(row pgx.Row) error {
		var gotSystem string
		var got int32
		if err := row.Scan(&gotSystem, &got); err != nil {
			return err
		}
		if gotSystem != systemID {
			return fmt.Errorf("%w: the server is system %s, the stream's events came from system %s timeline %d: their outcomes are not written here",
				relay.ErrServerChanged, gotSystem, systemID, want)
		}
		if got != want {
			return fmt.Errorf("%w: the server is on timeline %d, the stream's events came from system %s timeline %d: their outcomes are not written here",
				relay.ErrServerChanged, got, systemID, want)
		}
		return nil
	}}, true
}

// runStreamSteps is runSteps for the stream's writes: preceded, in the same
// transaction, by the origin guard.
func (s *Store) runStreamSteps(ctx context.Context, setCommit string, steps []step) ([]int64, error) {
	if guard, ok := s.originGuard(); ok {
		steps = append([]step{guard}, steps...)
	}
	return s.runSteps(ctx, setCommit, steps)
}

// standbySlotsPoll is how often waitStandbys reads the standbys' positions.
const standbySlotsPoll = 10 * time.Millisecond

// waitStandbys waits until every physical slot named in setting (the
// server's synchronized_standby_slots, PostgreSQL 17+) has flushed the WAL
// the server has flushed now, or ctx ends. It returns nil at once when the
// setting is empty. Called after a checkpoint commits: the standbys then
// hold the delivered record and every outcome written before it, so a
// failover slot synced to them never stands past an event whose outcome
// they lack (docs/failover.md). Slots that do not exist or are not
// physical are skipped: the walsender itself waits for them.
func (s *Store) waitStandbys(ctx context.Context, setting string) error {
	var names []string
	for _, n := range strings.Split(setting, ",") {
		n = strings.TrimSpace(n)
		if len(n) >= 2 && n[0] == '"' && n[len(n)-1] == '"' {
			n = strings.ReplaceAll(n[1:len(n)-1], `""`, `"`)
		}
		if n != "" {
			names = append(names, n)
		}
	}
	if skip := s.decodingStandbySlot.Load(); skip != nil && *skip != "" {
		names = slices.DeleteFunc(names, func(n string) bool { return n == *skip })
	}
	if len(names) == 0 {
		return nil
	}
	var flushed string
	if err := s.pool.QueryRow(ctx, catalog.Get("WALFlushPosition")).Scan(&flushed); err != nil {
		return fmt.Errorf("read the flushed WAL position: %w", err)
	}
	var behind []string
	slots := strings.Join(names, ", ")
	for {
		behind = behind[:0]
		err := s.pool.QueryRow(ctx, catalog.Get("StandbysBehind"), names, flushed).Scan(&behind)
		if err != nil && ctx.Err() == nil {
			return fmt.Errorf("read the standbys' positions: %w", err)
		}
		if err == nil && len(behind) == 0 {
			return nil
		}
		if err == nil {
			slots = strings.Join(behind, ", ")
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("standby slots %s (synchronized_standby_slots) have not flushed %s: %w", slots, flushed, ctx.Err())
		case <-time.After(standbySlotsPoll):
		}
	}
}
