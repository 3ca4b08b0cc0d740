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

// Terms builds the parts of each leadership term: the lock, and for each
// phase a fresh engine and the sources feeding it. It is implemented where
// the database and the ledger are, in cmd/outbox-relay: the supervisor only
// decides when each part starts and stops (docs/architecture.md, "Who
// builds the supervisor").
type Terms interface {
	// Leader blocks until this relay holds the slot's leader lock, or ctx
	// ends. Not called in poll mode.
	Leader(ctx context.Context) (Leadership, error)
	// Engine builds a fresh engine for a phase.
	Engine() (*relay.Engine, error)
	// Stream builds the replication source feeding e. Not called in poll
	// mode.
	Stream(e *relay.Engine) (Runner, error)
	// Claim builds the claim source feeding e; all takes every due row
	// (poll mode), otherwise only rows diverted to the claim path.
	Claim(e *relay.Engine, all bool) (Runner, error)
}

// Observer is told of the supervisor's moves, for the relay's metrics and
// health. Its methods are called on the supervisor's goroutines and must
// return promptly.
type Observer interface {
	// Mode is told the mode a phase runs in ("replication", "poll").
	Mode(mode string)
	// Leading is told whether this relay leads.
	Leading(leader bool)
	// LeadershipLost is called when the lock is lost: this process's link
	// to the database is suspect (the relay resets its pool there).
	LeadershipLost()
	// StandbyMove is told each move of delivery off the standby (to
	// "primary", with the watch's error) and back (to "standby", err nil).
	StandbyMove(to string, err error)
}

// NopObserver is an Observer that ignores everything; embed it to observe
// only some moves.
type NopObserver struct{}

func (NopObserver) Mode(string)               {}
func (NopObserver) Leading(bool)              {}
func (NopObserver) LeadershipLost()           {}
func (NopObserver) StandbyMove(string, error) {}

// Config configures a Supervisor. Zero durations take the defaults in
// brackets.
type Config struct {
	Mode Mode
	// Terms builds each term's lock, engines and sources; its methods are
	// called as the Config's own (s.cfg.Engine()).
	Terms
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
	// Observer is told of the supervisor's moves [NopObserver].
	Observer Observer
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
	Logger  zerolog.Logger
}
