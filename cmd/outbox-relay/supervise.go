package main

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
	"github.com/outbox-relay/outbox-relay/relay/replication"
	"github.com/outbox-relay/outbox-relay/relay/supervisor"
)

// newSupervisor builds the supervisor over what run wired — the pool, the
// store, the routes, the feed (docs/architecture.md, "Who builds the
// supervisor"): relayTerms builds each term's lock, engines and sources,
// relayObserver tells the metrics of its moves, and the stall detector
// follows both.
func newSupervisor(r *relayRun, stall *stallWatch) (*supervisor.Supervisor, error) {
	cfg := r.cfg
	sc := supervisor.Config{
		Mode:              supervisor.Mode(cfg.Source.Mode),
		Terms:             relayTerms{r},
		Slots:             ledger.NewSlots(r.pool, cfg.DatabaseURL.Reveal(), cfg.Source.Slot),
		Observer:          relayObserver{pool: r.pool, decodesOnStandby: r.standbyPool != nil},
		ReplicationRetry:  time.Duration(cfg.Source.ReplicationRetry),
		SlotMaxUnconsumed: time.Duration(cfg.Source.SlotMaxUnconsumed),
		SlotMaxRetained:   int64(cfg.Source.SlotMaxRetained),
		ShutdownTimeout:   time.Duration(cfg.ShutdownTimeout),
		Logger:            r.log,
	}
	if r.standbyPool != nil {
		r.addStandbyWatch(&sc)
	}
	return supervisor.New(stall.watch(sc))
}

// addStandbyWatch adds to sc what decoding on a standby needs
// (docs/standby.md): the standby watch and the slot's watchdog there.
func (r *relayRun) addStandbyWatch(sc *supervisor.Config) {
	cfg, log := r.cfg, r.log
	url := cfg.Source.StandbyURL.Reveal()
	watch, err := replication.NewStandbyWatch(replication.StandbyWatchConfig{
		ConnString: url,
		Primary:    r.store,
		MaxLag:     time.Duration(cfg.Source.StandbyMaxLag),
		// Delivery leaves the standby: its slot no longer carries it, and
		// is made again through the hand-over on the way back, even after
		// a restart of the relay.
		Void:   func(ctx context.Context) error { return r.store.BeginSlot(ctx, cfg.Source.Slot) },
		Logger: log,
	})
	if err != nil {
		// Config validation has parsed the URL; keep the stream without
		// the watch rather than refuse to start.
		log.Error().Err(err).Msg("source.standby_url: no standby watch")
		return
	}
	sc.Standby = watch
	sc.StandbySlots = ledger.NewSlots(r.standbyPool, url, cfg.Source.Slot)
}

// relayTerms builds the parts of each leadership term from what run
// wired: the leader lock (ledger), a fresh engine over the store and the
// sinks, the replication source and the claim path.
type relayTerms struct{ *relayRun }

var _ supervisor.Terms = relayTerms{}

func (r relayTerms) Leader(ctx context.Context) (supervisor.Leadership, error) {
	cfg := r.cfg
	l, err := ledger.AcquireLeader(ctx, cfg.DatabaseURL.Reveal(), cfg.Source.Slot, r.log)
	if err != nil {
		return nil, err
	}
	r.log.Info().Str("slot", cfg.Source.Slot).Str("owner", r.owner).Msg("leader for the slot")
	return l, nil
}

func (r relayTerms) Engine() (*relay.Engine, error) {
	cfg := r.cfg
	// A term's stream writes its outcomes to one server only
	// (docs/failover.md).
	r.store.BeginTerm()
	return relay.NewEngine(relay.EngineConfig{
		Routes: r.routes,
		Policy: relay.Policy{
			InlineAttempts: cfg.Delivery.InlineAttempts,
			MaxAttempts:    cfg.Delivery.MaxAttempts,
			Backoff:        durations(cfg.Delivery.Backoff),
			LaneBlockMax:   time.Duration(cfg.Delivery.LaneBlockMax),
		},
		Unordered:        cfg.Delivery.Ordering == config.OrderingNone,
		MaxInFlightBytes: int64(cfg.Delivery.MaxInFlightBytes),
		Stream:           r.store,
		Claim:            r.store,
		Owner:            r.owner, // the claim path holds this owner's lock
		ClaimLease:       time.Duration(cfg.Source.LockTimeout),
		// A replication session's wait for settlement ends when the stall
		// detector would call the stream stalled.
		StallAfter: time.Duration(cfg.HTTP.StallAfter),
		Logger:     r.log,
		Feed:       r.feed,
		// The pauses live on the primary, beside the outbox (docs/sinks.md,
		// "Pause and resume").
		Pauses: admin.NewPauseReader(r.pool, r.tables.Outbox),
	})
}

func (r relayTerms) Stream(e *relay.Engine) (supervisor.Runner, error) {
	cfg := r.cfg
	r.log.Info().Str("slot", cfg.Source.Slot).Str("outbox", r.tables.Outbox.String()).Int("sinks", len(r.routes)).Msg("relay running")
	streamURL := cfg.DatabaseURL.Reveal()
	var primary replication.Primary
	if r.standbyPool != nil {
		streamURL, primary = cfg.Source.StandbyURL.Reveal(), r.store
	}
	return replication.New(replication.Config{
		ConnString: streamURL,
		Primary:    primary,
		// The session waits this long for the standby to replay the
		// primary's position before making a slot there.
		StandbyCatchUp: time.Duration(cfg.Source.StandbyMaxLag),
		Slot:           cfg.Source.Slot,
		Publication:    cfg.Source.Publication,
		Outbox:         r.tables.Outbox,
		Consumer:       e.Stream(),
		Checkpoint:     r.store,
		HandOver:       r.store,
		StreamFrom:     r.store.StreamFrom,
		WaitSettled:    e.WaitSettled,
		StallAfter:     time.Duration(cfg.HTTP.StallAfter), // bounds a slot's creation
		Logger:         r.log,
	})
}

func (r relayTerms) Claim(e *relay.Engine, all bool) (supervisor.Runner, error) {
	cfg := r.cfg
	cc := claim.Config{
		Engine:       e,
		Store:        r.store,
		All:          all,
		BatchSize:    cfg.Source.BatchSize,
		PollInterval: time.Duration(cfg.Source.PollInterval),
		LockTimeout:  time.Duration(cfg.Source.LockTimeout),
		SweepAfter:   time.Duration(cfg.Source.SweepAfter),
		Owner:        r.owner,
		Logger:       r.log,
	}
	if cfg.Source.NotifyTrigger {
		cc.Notify = migrations.NotifyChannel(r.tables.Outbox)
	}
	return claim.New(cc)
}

// relayObserver tells the relay's metrics of the supervisor's moves, and
// resets the pool when the leader lock is lost.
type relayObserver struct {
	pool             *pgxpool.Pool
	decodesOnStandby bool // source.standby_url is set
}

var _ supervisor.Observer = relayObserver{}

func (o relayObserver) Mode(mode string) {
	relay.SetMode(mode)
	if !o.decodesOnStandby {
		return
	}
	onStandby := 0.0
	if mode == "replication" {
		onStandby = 1
	}
	replication.DecodingOnStandby.Set(onStandby)
}

func (relayObserver) Leading(leader bool) {
	if leader {
		relay.LeaderGauge.Set(1)
	} else {
		relay.LeaderGauge.Set(0)
	}
}

// LeadershipLost resets the pool: the lock connection failed, and the
// pool's connections may be as dead (a network that swallows packets keeps
// them open).
func (o relayObserver) LeadershipLost() { o.pool.Reset() }

func (relayObserver) StandbyMove(to string, err error) {
	reason := "healthy"
	if gone, ok := errors.AsType[*replication.StandbyUnavailableError](err); ok {
		reason = gone.Kind
	} else if err != nil {
		reason = "unavailable"
	}
	replication.StandbyMoves.WithLabelValues(to, reason).Inc()
}
