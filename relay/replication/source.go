// Package replication is the stream path's source: it reads the outbox
// table's INSERTs from a logical replication slot (pgoutput, protocol
// version 1) and feeds them to a relay.Consumer in commit order.
//
// The slot is acknowledged only up to positions the consumer reports as
// settled (relay.Consumer.Settled), never on receipt, and an acknowledgement
// that passes a transaction with events is preceded by a synchronous
// checkpoint write. A Source owns its slot: it creates it when it is missing
// or lost, handing the rows pending in the slot's exported snapshot to the
// claim path (Config.HandOver), and always starts streaming at 0/0, the
// slot's confirmed position.
package replication

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Defaults for the zero values of Config's durations.
const (
	DefaultStatusInterval  = 500 * time.Millisecond
	DefaultCheckpointEvery = time.Minute
	DefaultReconnectMin    = 200 * time.Millisecond
	DefaultReconnectMax    = 10 * time.Second
)

// Config configures a Source.
type Config struct {
	// ConnString is a normal postgres URL or DSN. The replication connection
	// adds replication=database, TimeZone=UTC and DateStyle=ISO (so
	// timestamptz values arrive as "2026-12-02 16:17:36.123456+00"); the
	// helper connection used for catalog queries drops replication.
	ConnString string

	// Slot is the logical replication slot the Source owns.
	Slot string
	// Publication is the publication that publishes the outbox's INSERTs.
	Publication string
	// Outbox is the outbox table, schema-qualified after resolution. Relation
	// messages are matched on namespace and name; an empty Schema matches
	// "public".
	Outbox relay.QualifiedName

	// Consumer receives the decoded events. Submit, Commit, Keepalive and
	// Restart are called from one goroutine in stream order; Settled is
	// called from another goroutine, concurrently with a blocked Submit, so
	// that acknowledgements keep flowing under back-pressure.
	Consumer relay.Consumer
	// Checkpoint persists the acknowledged position of the slot.
	Checkpoint relay.Checkpoint
	// HandOver is the slot-creation hand-over: it gives the claim path every
	// row pending in a new slot's exported snapshot and records that it did.
	HandOver HandOver
	// WaitSettled, when set, is called before a slot is created (after a
	// drop or an invalidation, the consumer may still be delivering events
	// of the old slot): it waits until the consumer has settled everything
	// submitted, so that the hand-over does not give those rows to the
	// claim path as well. It must be bounded (relay.Engine.WaitSettled
	// ends once nothing settled for its StallAfter): its error ends the
	// session, and the next one waits again.
	WaitSettled func(ctx context.Context) error

	// StreamFrom, when set, is told at the start of every session which
	// server the session streams from (IDENTIFY_SYSTEM's system identifier
	// and timeline), before anything is written for it. It returns an
	// error wrapping relay.ErrServerChanged when the term must end;
	// ledger.Store.StreamFrom implements it (docs/failover.md).
	StreamFrom func(ctx context.Context, systemID string, timeline int32) error

	// Primary, when set, says that ConnString names a physical standby
	// (PostgreSQL 16+) of the primary the ledger, the checkpoint and the
	// claim path are on (source.standby_url): the slot is made and streamed
	// there, and the primary is asked only what the hand-over and the
	// re-stream horizon need (docs/standby.md). ledger.Store implements it.
	Primary Primary
	// StandbyCatchUp bounds the wait, before a slot is made on the
	// standby, for it to replay the primary's flushed position
	// [DefaultStandbyCatchUp]; the session fails and is retried after it.
	StandbyCatchUp time.Duration
	// StallAfter bounds a slot's creation, which waits for the
	// transactions running when it began to end (on a standby, also for a
	// running-transactions record from the primary), and the read of its
	// snapshot's rows: past it the session ends with an error naming what
	// it waited for, and the next one tries again (http.stall_after)
	// [relay.DefaultStallAfter].
	StallAfter time.Duration

	// StatusInterval is how often settled positions are acknowledged
	// [DefaultStatusInterval]. It is lowered to the server's
	// wal_sender_timeout/3 when that is shorter.
	StatusInterval time.Duration
	// CheckpointEvery bounds how often acknowledgements that pass no events
	// (keepalive-only advances) rewrite the checkpoint [DefaultCheckpointEvery].
	CheckpointEvery time.Duration
	// ReconnectMin and ReconnectMax bound the jittered exponential backoff
	// between connection attempts [DefaultReconnectMin, DefaultReconnectMax].
	ReconnectMin, ReconnectMax time.Duration

	Logger zerolog.Logger
}

// HandOver is the slot-creation hand-over (docs/architecture.md, "slot
// creation"), which ledger.Store implements.
type HandOver interface {
	// BeginSlot records, before the slot is created, that its hand-over
	// has not happened yet.
	BeginSlot(ctx context.Context, slot string) error
	// OpenHandOver imports the exported snapshot of the newly created slot
	// (SET TRANSACTION SNAPSHOT, in a REPEATABLE READ transaction), which
	// holds the rows pending there: exactly the ones the slot will never
	// stream. Once it returns, the replication connection may stream while
	// the returned hand-over reads those rows (Aggregates) and delivers them.
	OpenHandOver(ctx context.Context, snapshot string) (relay.HandOverRows, error)
	// HandedOver reports whether the hand-over of the existing slot was
	// recorded as done. A slot without the record (a crash between its
	// creation and the hand-over) is dropped and made again.
	HandedOver(ctx context.Context, slot string) (bool, error)
}

// UnavailableError reports a server on which logical replication cannot work
// until someone changes its configuration: wal_level is not logical, the
// role lacks the REPLICATION privilege, the publication is missing or does
// not publish the outbox's inserts, or the slot name is taken by a slot of
// another kind. Run returns it instead of retrying, so the caller can fall
// back to the claim path (poll mode).
type UnavailableError struct {
	// Reason says what is missing and how to fix it.
	Reason string
	// Err is the server's error, when there was one.
	Err error
}

func (e *UnavailableError) Error() string {
	if e.Err != nil {
		return "logical replication unavailable: " + e.Reason + ": " + e.Err.Error()
	}
	return "logical replication unavailable: " + e.Reason
}

func (e *UnavailableError) Unwrap() error { return e.Err }

// UnavailableReason returns Reason: what is missing and how to fix it.
func (e *UnavailableError) UnavailableReason() string { return e.Reason }

// Source streams outbox INSERTs from a replication slot into a
// relay.Consumer. Create it with New and start it with Run.
type Source struct {
	cfg         Config
	log         zerolog.Logger
	outbox      relay.QualifiedName // Schema never empty
	replConfig  *pgconn.Config
	queryConfig *pgx.ConnConfig

	// origin is the server of the first session: every later session must
	// stream from the same one (relay.ErrServerChanged). walsenders holds
	// the backend pids of this Source's replication connections, to end
	// one that outlived its connection and holds the slot. Both are touched
	// only by the goroutine running the sessions.
	origin     *origin
	walsenders []uint32

	// checkpointed and checkpointAt describe the last checkpoint this Source
	// wrote. They outlive sessions and are touched only by the goroutine that
	// owns the current session's connection.
	checkpointed relay.LSN
	checkpointAt time.Time

	// received and acknowledged are the highest WAL position of data read
	// from the server and the highest position acknowledged to it, over
	// all sessions (Progress). Written by the receiver alone.
	received, acknowledged atomic.Uint64
}

// Progress reports the highest WAL position of data (pgoutput messages) the
// stream has read, and the highest position it has acknowledged to the
// server, over every session of this Source. While the first is ahead,
// events wait to be settled; the stall detector watches the second move
// (docs/operations-health.md). Safe to call concurrently with Run.
func (s *Source) Progress() (received, acknowledged relay.LSN) {
	return relay.LSN(s.received.Load()), relay.LSN(s.acknowledged.Load())
}

// raise stores v in a if it is higher; a has one writer.
func raise(a *atomic.Uint64, v relay.LSN) {
	if uint64(v) > a.Load() {
		a.Store(uint64(v))
	}
}

// New validates cfg, fills in defaults and returns a Source. It does not
// connect.
func New(cfg Config) (*Source, error) {
	if err := relay.ValidateSlotName(cfg.Slot); err != nil {
		return nil, fmt.Errorf("replication: slot: %w", err)
	}
	if err := relay.ValidateIdentifier(cfg.Publication); err != nil {
		return nil, fmt.Errorf("replication: publication: %w", err)
	}
	if err := relay.ValidateIdentifier(cfg.Outbox.Name); err != nil {
		return nil, fmt.Errorf("replication: outbox table: %w", err)
	}
	if cfg.Outbox.Schema != "" {
		if err := relay.ValidateIdentifier(cfg.Outbox.Schema); err != nil {
			return nil, fmt.Errorf("replication: outbox schema: %w", err)
		}
	}
	switch {
	case cfg.Consumer == nil:
		return nil, errors.New("replication: Consumer is nil")
	case cfg.Checkpoint == nil:
		return nil, errors.New("replication: Checkpoint is nil")
	case cfg.HandOver == nil:
		return nil, errors.New("replication: HandOver is nil")
	}
	setDefault(&cfg.StatusInterval, DefaultStatusInterval)
	setDefault(&cfg.CheckpointEvery, DefaultCheckpointEvery)
	setDefault(&cfg.ReconnectMin, DefaultReconnectMin)
	setDefault(&cfg.ReconnectMax, DefaultReconnectMax)
	setDefault(&cfg.StandbyCatchUp, DefaultStandbyCatchUp)
	setDefault(&cfg.StallAfter, relay.DefaultStallAfter)
	if cfg.ReconnectMax < cfg.ReconnectMin {
		cfg.ReconnectMax = cfg.ReconnectMin
	}

	replConfig, err := pgconn.ParseConfig(cfg.ConnString)
	if err != nil {
		return nil, fmt.Errorf("replication: connection string: %w", err)
	}
	replConfig.DialFunc = relay.Dial
	if replConfig.ConnectTimeout == 0 {
		replConfig.ConnectTimeout = relay.ConnectTimeout
	}
	replConfig.RuntimeParams["replication"] = "database"
	replConfig.RuntimeParams["TimeZone"] = "UTC"
	replConfig.RuntimeParams["DateStyle"] = "ISO"
	if replConfig.RuntimeParams["application_name"] == "" {
		replConfig.RuntimeParams["application_name"] = "outbox-relay"
	}
	queryConfig, err := pgx.ParseConfig(cfg.ConnString)
	if err != nil {
		return nil, fmt.Errorf("replication: connection string: %w", err)
	}
	delete(queryConfig.RuntimeParams, "replication")
	queryConfig.DialFunc = relay.Dial
	if queryConfig.ConnectTimeout == 0 {
		queryConfig.ConnectTimeout = relay.ConnectTimeout
	}

	outbox := cfg.Outbox
	if outbox.Schema == "" {
		outbox.Schema = "public"
	}
	return &Source{
		cfg:          cfg,
		log:          cfg.Logger.With().Str("slot", cfg.Slot).Logger(),
		outbox:       outbox,
		replConfig:   replConfig,
		queryConfig:  queryConfig,
		checkpointAt: time.Now(),
	}, nil
}

func setDefault(d *time.Duration, def time.Duration) {
	if *d <= 0 {
		*d = def
	}
}

// Run streams until ctx is done, then returns nil. Every lost connection or
// stream error (including an event that cannot be decoded) is logged and
// followed by a reconnect after a jittered exponential backoff; streaming
// resumes from the slot's confirmed position, and Consumer.Restart is called
// before each new stream starts. Run returns an *UnavailableError, without
// retrying, when the server cannot do logical replication for this
// configuration, and an error wrapping relay.ErrServerChanged when a
// session finds another server than the first one did (a failover: the
// events already streamed belong to the old server). Run must not be called
// concurrently with itself.
func (s *Source) Run(ctx context.Context) error {
	b := backoff{min: s.cfg.ReconnectMin, max: s.cfg.ReconnectMax}
	for {
		streamed, err := s.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if ue, ok := errors.AsType[*UnavailableError](err); ok {
			return ue
		}
		if errors.Is(err, relay.ErrServerChanged) {
			return err
		}
		if streamed {
			b.reset()
		}
		wait := b.next()
		s.log.Warn().Err(err).Dur("retry_in", wait).Msg("replication stream stopped; reconnecting")
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// backoff is a jittered exponential backoff: each wait is drawn from
// [d/2, d], and d doubles up to max.
type backoff struct {
	min, max, cur time.Duration
}

func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.min
	}
	d := b.cur
	b.cur = min(2*b.cur, b.max)
	return d/2 + rand.N(d/2+1)
}

func (b *backoff) reset() { b.cur = 0 }
