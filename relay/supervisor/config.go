package supervisor

import (
	"context"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Mode is source.mode.
type Mode string

// The modes.
const (
	ModeAuto        Mode = "auto"
	ModeReplication Mode = "replication"
	ModePoll        Mode = "poll"
)

// Leadership is a held leader lock.
type Leadership interface {
	// Lost is closed when the lock is lost: delivery must stop at once,
	// another relay may already be taking over.
	Lost() <-chan struct{}
	// Release gives the lock up.
	Release()
}

// Runner is a source: it runs until ctx ends.
type Runner interface {
	Run(ctx context.Context) error
}

// Unavailable is implemented by errors that say replication cannot work on
// this server until someone changes its configuration
// (replication.UnavailableError).
type Unavailable interface {
	error
	UnavailableReason() string
}

// Slots is what the watchdog needs to know about the relay's slot.
type Slots interface {
	// Slot reports whether the slot exists, whether a process streams from
	// it, and the WAL it retains.
	Slot(ctx context.Context) (exists, active bool, retained int64, err error)
	// DropSlot drops the slot if it exists and nobody streams from it,
	// and reports whether it did.
	DropSlot(ctx context.Context) (bool, error)
	// EndStaleWalsender ends a process still streaming from the slot (a
	// former leader), and returns its pid, or 0.
	EndStaleWalsender(ctx context.Context) (int32, error)
}

// Standby watches the physical standby the stream decodes on
// (source.standby_url); replication.StandbyWatch implements it.
type Standby interface {
	// Watch runs beside the stream until ctx ends, then returns nil; it
	// returns an error (implementing Unavailable) once the standby is
	// unreachable, or lags its primary, past its bound.
	Watch(ctx context.Context) error
	// WaitHealthy returns nil once the standby is reachable and within its
	// bound again, or ctx's error.
	WaitHealthy(ctx context.Context) error
}

// Config configures a Supervisor. Zero durations take the defaults in
// brackets.
type Config struct {
	Mode Mode
	// Leader blocks until this relay holds the slot's leader lock, or ctx
	// ends. Not used in poll mode.
	Leader func(ctx context.Context) (Leadership, error)
	// Engine builds a fresh engine for a term.
	Engine func() (*relay.Engine, error)
	// Stream builds the replication source feeding e.
	Stream func(e *relay.Engine) (Runner, error)
	// Claim builds the claim source feeding e; all takes every due row
	// (poll mode), otherwise only rows handed to the claim path.
	Claim func(e *relay.Engine, all bool) (Runner, error)
	// Slots watches the relay's slot.
	Slots Slots
	// Standby, when set, watches the standby the stream decodes on
	// (docs/standby.md). In auto mode, once it reports the standby
	// unavailable, delivery moves to the primary — the claim path over
	// every due row — until WaitHealthy returns, then back to the stream on
	// the standby. In replication mode the stream keeps trying the standby,
	// and the report is only logged.
	Standby Standby
	// StandbySlots, when set, is the relay's slot on the standby the stream
	// decodes on: a watchdog of its own drops it when nobody consumes it,
	// a term ends a stale walsender there, and a return from poll mode
	// drops it there. Slots then watches the relay's slot of the same name
	// on the primary, a leftover of decoding there.
	StandbySlots Slots
	// OnStandbyMove is told each move of delivery off the standby (to
	// "primary", with the watch's error) and back (to "standby", err nil).
	OnStandbyMove func(to string, err error)
	// ReplicationRetry is how often auto mode, while polling, tries to
	// return to replication [1m].
	ReplicationRetry time.Duration
	// SlotMaxUnconsumed drops the relay's slot once nobody has streamed
	// from it this long [10m], or once it retains SlotMaxRetained bytes
	// [1 GiB] while nobody does.
	SlotMaxUnconsumed time.Duration
	SlotMaxRetained   int64
	// ShutdownTimeout bounds the drain at the end of a term [30s].
	ShutdownTimeout time.Duration
	// StandBy is the pause after a lost leadership before trying to lead
	// again, giving a healthy standby the first chance [3s].
	StandBy time.Duration
	// OnMode is told the mode a term runs in ("replication", "poll"), and
	// OnLeader whether this relay leads. OnLeadershipLost is called when the
	// lock is lost (this process's link to the database is suspect: the
	// relay resets its pool there).
	OnMode           func(mode string)
	OnLeader         func(leader bool)
	OnLeadershipLost func()
	Logger           zerolog.Logger
}
