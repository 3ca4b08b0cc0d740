package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Mode is how the relay is running, as far as the database can tell.
type Mode string

// Modes, from the strongest evidence to none.
const (
	// ModeReplication: a process is streaming from the slot.
	ModeReplication Mode = "replication"
	// ModePoll: no one streams from the slot, but an outbox-relay session
	// is connected to the database (the claim path polls).
	ModePoll Mode = "poll"
	// ModeStopped: no outbox-relay session at all.
	ModeStopped Mode = "stopped"
)

// Session is a server process as pg_stat_activity shows it. BackendStart
// and ClientAddr are visible only for sessions of the same role or with
// pg_read_all_stats; otherwise they are nil and empty.
type Session struct {
	PID             int32      `json:"pid"`
	ApplicationName string     `json:"application_name"`
	BackendStart    *time.Time `json:"backend_start,omitempty"`
	ClientAddr      string     `json:"client_addr,omitempty"`
}

// Leader is the session that leads the relays of a slot: the holder of the
// leader lock ("lock") or, when no one holds it, the process streaming from
// the slot ("slot").
type Leader struct {
	Session
	By string `json:"by"`
}

// SlotStatus describes the replication slot.
type SlotStatus struct {
	Name string `json:"name"`
	// Server is where the slot is: "primary", or "standby" when the relay
	// decodes on a standby (source.standby_url, docs/standby.md).
	Server string `json:"server"`
	// Error says why the slot could not be read (the standby unreachable);
	// Exists and the rest are then unknown.
	Error  string `json:"error,omitempty"`
	Exists bool   `json:"exists"`
	Active bool   `json:"active"`
	// Holder is the process streaming from the slot, when Active: a
	// session of the server the slot is on.
	Holder *Session `json:"holder,omitempty"`
	// WALStatus is reserved, extended, unreserved or lost ("" when the slot
	// does not exist).
	WALStatus string `json:"wal_status,omitempty"`
	// InvalidationReason is why the server invalidated the slot
	// (pg_replication_slots.invalidation_reason, PostgreSQL 17+: wal_removed,
	// idle_timeout, ...); "" when it is valid or the server is older.
	InvalidationReason string `json:"invalidation_reason,omitempty"`
	// RetainedWALBytes is the WAL the slot keeps from being removed: from
	// its restart_lsn to the server's current position (on a standby, its
	// last replayed one). Nil when unknown or none (no slot, or
	// invalidated: PostgreSQL 18 keeps the restart_lsn of a slot
	// invalidated for idleness, but the slot retains nothing).
	RetainedWALBytes *int64 `json:"retained_wal_bytes,omitempty"`
	// ConfirmedFlushLSN is the position the relay last acknowledged to the
	// slot: the server may discard the WAL before it.
	ConfirmedFlushLSN string `json:"confirmed_flush_lsn,omitempty"`
	// LagBytes is the WAL written since ConfirmedFlushLSN: how far the
	// slot's consumer is behind. Nil when unknown, as RetainedWALBytes.
	LagBytes *int64 `json:"lag_bytes,omitempty"`
}

// CheckpointStatus is the slot's row in the checkpoint table: the
// relay's own durable record of the position up to which every event is
// settled, written with a synchronous commit before each acknowledgement
// that passes events (docs/operations.md, "status").
type CheckpointStatus struct {
	ConfirmedLSN string    `json:"confirmed_lsn"`
	UpdatedAt    time.Time `json:"updated_at"`
}

// Status is what the status command shows.
type Status struct {
	Mode   Mode    `json:"mode"`
	Leader *Leader `json:"leader"`
	// Relays counts the relay processes of this slot: the sessions that
	// hold or wait for its leader lock (one per relay in replication and
	// auto mode) or, when there are none, the owner-lock sessions (one per
	// relay in poll mode).
	Relays int `json:"relays"`
	// Connections are every outbox-relay session in the database (the
	// operator commands' own excluded): a relay holds several (leader
	// lock, owner lock, walsender, LISTEN).
	Connections []Session         `json:"connections"`
	Slot        SlotStatus        `json:"slot"`
	Checkpoint  *CheckpointStatus `json:"checkpoint,omitempty"`
	// Rows counts outbox rows by status; the relay's statuses
	// (docs/schema.md, "A row's states") are always present, others (a
	// legacy poller's) only when they occur.
	Rows map[string]int64 `json:"rows"`
	// OldestPendingSeconds is the age of the oldest pending row (by
	// created_at), nil when none is pending.
	OldestPendingSeconds *float64 `json:"oldest_pending_seconds"`
	// DeliveredLastHour counts ledger rows delivered in the last hour, per
	// sink (the ledger's action).
	DeliveredLastHour map[string]int64 `json:"delivered_last_hour"`
	Held              int64            `json:"held"`
	Failed            int64            `json:"failed"`
	// SinksDown are, per sink, the pending rows whose last attempt found
	// that sink down (a failure of the sink-down class, or its circuit
	// open): they wait on the claim path until it is back. Only sinks with
	// such rows are listed; the configured sinks (Tables.Sinks) are looked
	// for.
	SinksDown map[string]SinkDown `json:"sinks_down,omitempty"`
	// Paused are the sinks an operator paused (PauseSink), by name: no
	// relay sends to them until they are resumed.
	Paused []Pause `json:"paused"`
	// RateLimits are the configured sinks' rate limits (docs/sinks.md,
	// "Rate limits"), by sink; the status command fills them in from the
	// configuration.
	RateLimits map[string]RateLimit `json:"rate_limits,omitempty"`
	// Progress is what the tables show of a stall (ReadProgress); the
	// status command fills it in.
	Progress *Progress `json:"progress,omitempty"`
}

// RateLimit is a sink's configured rate limit.
type RateLimit struct {
	PerSecond float64 `json:"per_second"`
	Burst     int     `json:"burst"`
}

// SinkDown is what the outbox shows of a sink that was down.
type SinkDown struct {
	// Waiting counts the pending rows whose last attempt found it down.
	Waiting int64 `json:"waiting"`
	// LastError is the newest such row's last_error: why.
	LastError string `json:"last_error"`
}

// Where says where status finds a relay's slot and leader lock.
type Where struct {
	// Slot is source.slot and LeaderKey its leader lock
	// (ledger.LeaderLockKey).
	Slot      string
	LeaderKey int64
	// Standby is a connection to source.standby_url when the relay decodes
	// on a standby (docs/standby.md): the slot is read there. StandbyErr
	// is why the standby could not be reached, when it could not. Both
	// zero: the slot is the primary's.
	Standby    DB
	StandbyErr error
}

func (w Where) onStandby() bool { return w.Standby != nil || w.StandbyErr != nil }

// Statuses are the outbox statuses (docs/schema.md, "A row's states").
var Statuses = []string{"pending", "processing", "held", "failed", "done", Discarded}

// ReadStatus reads the state of the relays of w.Slot from the database,
// and the slot from the server it is on (w): ReadRelays, and the counts.
// It only reads. The counts scan the outbox and the ledger (which has no
// index on delivered_at); retention keeps both small.
func ReadStatus(ctx context.Context, db DB, t Tables, w Where) (*Status, error) {
	st, err := ReadRelays(ctx, db, t, w)
	if err != nil {
		return nil, err
	}
	if err := st.readCounts(ctx, db, t); err != nil {
		return nil, err
	}
	return st, nil
}

// ReadRelays reads the part of the status that concerns the relays: mode,
// leader, sessions, the slot (on the server it is on) and the checkpoint.
// The leader is the session holding the session advisory lock w.LeaderKey,
// or else the process streaming from the slot. It reads the server's views
// and the checkpoint's row, never the outbox or the ledger, so it is cheap
// enough to repeat every few seconds (the admin API does); Rows,
// DeliveredLastHour and SinksDown are left empty.
func ReadRelays(ctx context.Context, db DB, t Tables, w Where) (*Status, error) {
	slot := w.Slot
	st := &Status{Rows: map[string]int64{}, DeliveredLastHour: map[string]int64{}, Connections: []Session{}}

	var err error
	st.Slot, err = ReadSlot(ctx, db, w)
	if err != nil {
		return nil, err
	}
	sessions, err := relaySessions(ctx, db)
	if err != nil {
		return nil, err
	}
	st.Connections = sessions
	st.Relays = countRelays(sessions, slot)

	lockHolder, err := lockHolder(ctx, db, w.LeaderKey)
	if err != nil {
		return nil, err
	}
	switch {
	case lockHolder != nil:
		st.Leader = &Leader{Session: *lockHolder, By: "lock"}
	case st.Slot.Holder != nil:
		st.Leader = &Leader{Session: *st.Slot.Holder, By: "slot"}
	}

	switch {
	case st.Slot.Active:
		st.Mode = ModeReplication
	case len(st.Connections) > 0:
		st.Mode = ModePoll
	default:
		st.Mode = ModeStopped
	}

	var cp CheckpointStatus
	err = db.QueryRow(ctx, t.sql("StatusCheckpoint"), slot).
		Scan(&cp.ConfirmedLSN, &cp.UpdatedAt)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return nil, fmt.Errorf("read checkpoint: %w", err)
	default:
		st.Checkpoint = &cp
	}
	return st, nil
}

// readCounts adds to st the outbox's rows by status, the oldest pending
// row's age, the deliveries of the last hour and the sinks that were down.
func (st *Status) readCounts(ctx context.Context, db DB, t Tables) error {
	for _, s := range Statuses {
		st.Rows[s] = 0
	}
	rows, err := db.Query(ctx, t.sql("StatusCountRows"))
	if err != nil {
		return fmt.Errorf("count outbox rows: %w", err)
	}
	var (
		status string
		n      int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&status, &n}, func() error { st.Rows[status] = n; return nil }); err != nil {
		return fmt.Errorf("count outbox rows: %w", err)
	}
	st.Held, st.Failed = st.Rows["held"], st.Rows["failed"]

	err = db.QueryRow(ctx, t.sql("StatusOldestPending")).Scan(&st.OldestPendingSeconds)
	if err != nil {
		return fmt.Errorf("oldest pending row: %w", err)
	}

	rows, err = db.Query(ctx, t.sql("StatusDeliveredLastHour"))
	if err != nil {
		return fmt.Errorf("count deliveries: %w", err)
	}
	var action string
	if _, err := pgx.ForEachRow(rows, []any{&action, &n}, func() error { st.DeliveredLastHour[action] = n; return nil }); err != nil {
		return fmt.Errorf("count deliveries: %w", err)
	}
	if st.SinksDown, err = sinksDown(ctx, db, t); err != nil {
		return err
	}
	if st.Paused, err = Pauses(ctx, db, t.Outbox); err != nil {
		return fmt.Errorf("read the paused sinks: %w", err)
	}
	return nil
}

// sinksDown reads, per configured sink, the pending rows whose last_error
// says the sink was down: the engine writes each sink's reason as
// "sink <name>: <reason>", and a sink that was down as the failure's class
// ("sink-down: …") or as its open circuit ("circuit open: sink is down").
func sinksDown(ctx context.Context, db DB, t Tables) (map[string]SinkDown, error) {
	if len(t.Sinks) == 0 {
		return nil, nil
	}
	names := make([]string, len(t.Sinks))
	for i, s := range t.Sinks {
		names[i] = s.Name
	}
	rows, err := db.Query(ctx, t.sql("StatusSinksDown"), names)
	if err != nil {
		return nil, fmt.Errorf("read the rows waiting on a sink that was down: %w", err)
	}
	out := map[string]SinkDown{}
	var (
		name string
		sd   SinkDown
	)
	if _, err := pgx.ForEachRow(rows, []any{&name, &sd.Waiting, &sd.LastError}, func() error { out[name] = sd; return nil }); err != nil {
		return nil, fmt.Errorf("read the rows waiting on a sink that was down: %w", err)
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

// ReadSlot reads the relay's slot w.Slot on the server it is on: the
// standby when w names one, else db. An unreachable or unreadable standby
// is reported in SlotStatus.Error, not as an error. It only reads.
func ReadSlot(ctx context.Context, db DB, w Where) (SlotStatus, error) {
	st := SlotStatus{Name: w.Slot, Server: "primary"}
	on := db
	if w.onStandby() {
		st.Server, on = "standby", w.Standby
		if w.StandbyErr != nil {
			st.Error = fmt.Sprintf("cannot connect to source.standby_url: %v", w.StandbyErr)
			return st, nil
		}
	}
	var (
		pid      int32
		retained *int64
		lag      *int64
		walStat  *string
		reason   *string
		flushLSN *string
	)
	err := on.QueryRow(ctx, catalogSQL("StatusSlot"), w.Slot).Scan(&pid, &walStat, &reason, &flushLSN, &retained, &lag)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return st, nil
	case err != nil && st.Server == "standby":
		st.Error = fmt.Sprintf("read the standby's pg_replication_slots: %v", err)
		return st, nil
	case err != nil:
		return st, fmt.Errorf("read slot %s: %w", w.Slot, err)
	}
	st.Exists = true
	st.Active = pid != 0
	st.WALStatus = deref(walStat)
	st.InvalidationReason = deref(reason)
	st.ConfirmedFlushLSN = deref(flushLSN)
	st.RetainedWALBytes = retained
	st.LagBytes = lag
	if st.Active {
		s, err := session(ctx, on, pid)
		if err != nil {
			return st, err
		}
		st.Holder = &s
	}
	return st, nil
}

// The application_name of a relay's dedicated sessions (ledger.AcquireLeader,
// ledger's dedicatedConfig).
const (
	leaderSessionPrefix = "outbox-relay leader "
	ownerLockSession    = "outbox-relay owner lock"
	// maxApplicationName is the server's limit (NAMEDATALEN - 1 bytes): a
	// longer name arrives cut.
	maxApplicationName = 63
)

// countRelays counts the relay processes of slot among sessions: every
// relay in replication and auto mode holds a session for the slot's leader
// lock (the leader, and each standby while it waits), and every relay in
// poll mode, which has none, an owner-lock session (the leader has one too,
// so owner locks count only when no relay waits for the leader lock).
func countRelays(sessions []Session, slot string) int {
	leader := leaderSessionPrefix + slot
	var leaders, owners int
	for _, s := range sessions {
		app := s.ApplicationName
		switch {
		case app == leader,
			len(leader) > maxApplicationName && len(app) > len(leaderSessionPrefix) && len(app) >= maxApplicationName-3 && strings.HasPrefix(leader, app):
			leaders++
		case app == ownerLockSession:
			owners++
		}
	}
	if leaders > 0 {
		return leaders
	}
	return owners
}

// scanSession reads a Session from the columns of StatusSession,
// StatusRelaySessions and StatusLockHolder.
func scanSession(row pgx.Row) (Session, error) {
	var s Session
	err := row.Scan(&s.PID, &s.ApplicationName, &s.BackendStart, &s.ClientAddr)
	return s, err
}

// session returns pid's session; a process that has just exited is
// returned with its pid only.
func session(ctx context.Context, db DB, pid int32) (Session, error) {
	s, err := scanSession(db.QueryRow(ctx, catalogSQL("StatusSession"), pid))
	if errors.Is(err, pgx.ErrNoRows) {
		return Session{PID: pid}, nil
	}
	if err != nil {
		return Session{}, fmt.Errorf("read session %d: %w", pid, err)
	}
	return s, nil
}

// relaySessions lists the sessions of relays in this database (a
// walsender of a logical slot is connected to its database too). The
// operator commands and this session are not relays.
func relaySessions(ctx context.Context, db DB) ([]Session, error) {
	rows, err := db.Query(ctx, catalogSQL("StatusRelaySessions"), CLIApplicationName)
	if err != nil {
		return nil, fmt.Errorf("list relay sessions: %w", err)
	}
	sessions, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Session, error) { return scanSession(r) })
	if err != nil {
		return nil, fmt.Errorf("list relay sessions: %w", err)
	}
	return sessions, nil
}

// lockHolder returns the session holding the session advisory lock key in
// this database, or nil.
func lockHolder(ctx context.Context, db DB, key int64) (*Session, error) {
	classid, objid := lockIDs(key)
	s, err := scanSession(db.QueryRow(ctx, catalogSQL("StatusLockHolder"), int64(classid), int64(objid)))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read leader lock: %w", err)
	}
	return &s, nil
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// Progress is what the database shows of the relays' progress, for status
// (docs/operations-health.md, "What outbox-relay status can know"). The relay's own
// stall detector sees more (events in memory, the acknowledged position);
// from the tables status sees rows that wait and the traces progress
// leaves: the checkpoint the stream writes before it acknowledges events,
// and the claim path's claims and settlements.
type Progress struct {
	// StallAfter is the age beyond which a waiting row counts.
	StallAfterSeconds float64 `json:"stall_after_seconds"`
	// StreamWaiting counts rows the stream owns (pending, not diverted)
	// created more than StallAfter ago, while
	// the slot exists; OldestStreamWaitingSeconds is the oldest one's age.
	StreamWaiting              int64    `json:"stream_waiting"`
	OldestStreamWaitingSeconds *float64 `json:"oldest_stream_waiting_seconds,omitempty"`
	// CheckpointAgeSeconds is how long ago the stream last wrote its
	// checkpoint; nil when it never did.
	CheckpointAgeSeconds *float64 `json:"checkpoint_age_seconds,omitempty"`
	// ClaimWaiting counts rows of the claim path (diverted; every
	// pending row when there is no slot) due more than StallAfter ago and
	// not claimed; OldestClaimWaitingSeconds is how long the oldest has
	// been due.
	ClaimWaiting              int64    `json:"claim_waiting"`
	OldestClaimWaitingSeconds *float64 `json:"oldest_claim_waiting_seconds,omitempty"`
	// ClaimActivityAgeSeconds is how long ago the claim path last claimed
	// or settled a row (the latest locked_at, processed_at, or ledger
	// claimed_at or delivered_at); nil when never.
	ClaimActivityAgeSeconds *float64 `json:"claim_activity_age_seconds,omitempty"`
	// Stalled says why the tables show a stall: rows that have waited
	// longer than StallAfter on a path that has shown no progress for as
	// long. "" when they show none.
	Stalled string `json:"stalled,omitempty"`
	// Note points at rows that wait though their path progresses: rows the
	// stream owns that it may never stream (outbox-relay reconcile), or a
	// backlog.
	Note string `json:"note,omitempty"`
}

// ReadProgress reads what the tables show of the progress of the relays of
// the slot (as ReadSlot read it), counting rows that have waited longer
// than stallAfter. It only reads; like ReadStatus it scans the outbox and
// the ledger.
func ReadProgress(ctx context.Context, db DB, t Tables, slotStatus SlotStatus, stallAfter time.Duration) (*Progress, error) {
	p := &Progress{StallAfterSeconds: stallAfter.Seconds()}
	after := stallAfter.Seconds()
	slot, slotExists := slotStatus.Name, slotStatus.Exists
	err := db.QueryRow(ctx, t.sql("StatusRowsWaiting"), after, slotExists).
		Scan(&p.StreamWaiting, &p.OldestStreamWaitingSeconds, &p.ClaimWaiting, &p.OldestClaimWaitingSeconds)
	if err != nil {
		return nil, fmt.Errorf("rows waiting: %w", err)
	}
	err = db.QueryRow(ctx, t.sql("StatusCheckpointAge"), slot).
		Scan(&p.CheckpointAgeSeconds)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("read checkpoint: %w", err)
	}
	err = db.QueryRow(ctx, t.sql("StatusClaimActivity")).Scan(&p.ClaimActivityAgeSeconds)
	if err != nil {
		return nil, fmt.Errorf("claim path activity: %w", err)
	}

	age := func(s *float64) string {
		if s == nil {
			return "never"
		}
		return roundSeconds(*s) + " ago"
	}
	var stalled []string
	if p.StreamWaiting > 0 {
		if p.CheckpointAgeSeconds == nil || *p.CheckpointAgeSeconds > after {
			stalled = append(stalled, fmt.Sprintf("the stream last wrote its checkpoint %s while %d rows it owns have waited longer than %s (the oldest %s)",
				age(p.CheckpointAgeSeconds), p.StreamWaiting, stallAfter, roundSeconds(*p.OldestStreamWaitingSeconds)))
		} else {
			p.Note = fmt.Sprintf("%d rows the stream owns have waited longer than %s (the oldest %s) though it checkpoints: a backlog, or rows it will never stream (a slot made again while the relay was down): if they stay, outbox-relay reconcile",
				p.StreamWaiting, stallAfter, roundSeconds(*p.OldestStreamWaitingSeconds))
		}
	}
	if p.ClaimWaiting > 0 {
		if p.ClaimActivityAgeSeconds == nil || *p.ClaimActivityAgeSeconds > after {
			stalled = append(stalled, fmt.Sprintf("the claim path last claimed or settled a row %s while %d rows due have waited longer than %s (the oldest %s)",
				age(p.ClaimActivityAgeSeconds), p.ClaimWaiting, stallAfter, roundSeconds(*p.OldestClaimWaitingSeconds)))
		} else if p.Note == "" {
			p.Note = fmt.Sprintf("%d rows due for the claim path have waited longer than %s (the oldest %s) though it works: a backlog",
				p.ClaimWaiting, stallAfter, roundSeconds(*p.OldestClaimWaitingSeconds))
		}
	}
	p.Stalled = strings.Join(stalled, "; ")
	return p, nil
}

// roundSeconds prints s seconds to the second.
func roundSeconds(s float64) string {
	return (time.Duration(s * float64(time.Second))).Round(time.Second).String()
}
