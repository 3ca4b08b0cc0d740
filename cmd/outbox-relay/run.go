package main

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/relay/claim"
	"github.com/outbox-relay/outbox-relay/relay/replication"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

func newRunCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "run",
		Short: "Run the relay daemon: stream the outbox to the sinks",
		Long: `Run streams outbox INSERTs from the replication slot to the configured sinks.
With no sinks configured it runs an embedded NATS server with JetStream and delivers there.
SIGTERM/SIGINT stop taking new events, finish in-flight ones, record their outcomes and
exit 0 within shutdown_timeout.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.loadConfig()
			if err != nil {
				return err
			}
			return runRelay(cmd.Context(), cfg, g.logger(cfg))
		},
	}
}

// relayRun is one running relay: what every leadership term shares.
type relayRun struct {
	cfg    *config.Config
	log    zerolog.Logger
	pool   *pgxpool.Pool
	tables config.Tables
	store  *ledger.Store
	routes []relay.Route
	owner  string
	health *health
	// sinksDown says why sinks that could not be opened are down (see
	// downSink); while there are any, /readyz answers 503 with it.
	sinksDown []string
}

// setReady marks the relay ready, unless a sink is down.
func (r *relayRun) setReady() {
	r.health.set(len(r.sinksDown) == 0, strings.Join(r.sinksDown, "; "))
}

// runRelay wires the configuration into a running relay and blocks until ctx
// is done. In replication and auto modes it first becomes the slot's leader
// (a standby waits, ready, until the leader goes); each leadership term runs
// a fresh engine and source and ends, on shutdown or lost leadership, in
// order: stop the source, drain the engine (outcomes written), then the
// sinks are closed.
func runRelay(ctx context.Context, cfg *config.Config, log zerolog.Logger) error {
	r := &relayRun{cfg: cfg, log: log, owner: claim.NewOwner(), health: &health{}}
	r.health.set(false, "starting")

	httpCtx, stopHTTP := context.WithCancel(context.WithoutCancel(ctx))
	defer stopHTTP()
	if _, err := serveHTTP(httpCtx, cfg.HTTP, r.health, log); err != nil {
		return err
	}

	pool, err := newPool(ctx, cfg.DatabaseURL.Reveal())
	if err != nil {
		return err
	}
	defer pool.Close()
	r.pool = pool

	if r.tables, err = resolveTables(ctx, pool, cfg.Tables()); err != nil {
		return err
	}
	if err := checkPrivileges(ctx, pool, r.tables, cfg.Source.Mode == config.SourceReplication); err != nil {
		return err
	}
	lcfg := ledger.DefaultConfig()
	lcfg.Outbox, lcfg.Ledger, lcfg.Checkpoint = r.tables.Outbox, r.tables.Ledger, r.tables.Checkpoint
	r.store = ledger.New(pool, lcfg)

	if len(cfg.Sinks) == 0 {
		s := config.DefaultSink(config.SinkNATS)
		s.Name = "nats"
		cfg.Sinks = []config.SinkConfig{s}
		log.Info().Msg("no sinks configured: delivering to an embedded NATS server with JetStream")
	}
	// Sinks are closed last, after the engine has drained, on a fresh context.
	r.routes, err = openSinks(ctx, cfg, log)
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, s := range r.routes {
			if err := s.Sink.Close(closeCtx); err != nil {
				log.Warn().Err(err).Str("sink", s.Sink.Name()).Msg("close sink")
			}
		}
	}()
	if err != nil {
		return err
	}
	relay.InitMetrics(r.routes)

	go r.refreshStats(httpCtx)
	retentionDone := make(chan struct{})
	go func() {
		defer close(retentionDone)
		runRetention(httpCtx, pool, r.tables, cfg, log)
	}()
	defer func() { stopHTTP(); <-retentionDone }()

	for _, rt := range r.routes {
		if down, ok := rt.Sink.(*downSink); ok {
			r.sinksDown = append(r.sinksDown, "sink "+down.name+" is down: "+down.err.Error())
		}
	}

	if cfg.Source.Mode == config.SourcePoll {
		// Claimers coordinate through the table (SKIP LOCKED), so every
		// instance polls; there is no leader.
		r.setReady()
		err := r.poll(ctx, 0)
		log.Info().Msg("relay stopped")
		return err
	}

	for {
		r.setReady()
		leader, err := ledger.AcquireLeader(ctx, cfg.DatabaseURL.Reveal(), cfg.Source.Slot, log)
		if err != nil {
			if ctx.Err() != nil {
				log.Info().Msg("relay stopped")
				return nil
			}
			return err
		}
		relay.LeaderGauge.Set(1)
		log.Info().Str("slot", cfg.Source.Slot).Str("owner", r.owner).Msg("leader for the slot")
		termCtx, endTerm := context.WithCancel(ctx)
		go func() {
			select {
			case <-leader.Lost():
				endTerm()
			case <-termCtx.Done():
			}
		}()
		err = r.lead(termCtx)
		endTerm()
		leader.Release()
		relay.LeaderGauge.Set(0)
		if ctx.Err() != nil {
			if err != nil && !errors.Is(err, context.Canceled) {
				return err
			}
			log.Info().Msg("relay stopped")
			return nil
		}
		if err != nil {
			return err
		}
		// Losing the lock means this process's link to the database is
		// suspect: give a healthy standby the first chance to take over.
		log.Warn().Msg("leadership lost: delivery stopped; standing by to take over again")
		select {
		case <-ctx.Done():
			log.Info().Msg("relay stopped")
			return nil
		case <-time.After(3 * time.Second):
		}
	}
}

// lead runs one leadership term until ctx ends: the stream, or in auto mode,
// while replication is impossible, the claim path over every row, trying to
// return to replication every source.replication_retry.
func (r *relayRun) lead(ctx context.Context) error {
	var pollingSince time.Time
	for {
		err := r.stream(ctx)
		var unavailable *replication.UnavailableError
		if ctx.Err() != nil || !errors.As(err, &unavailable) {
			return err
		}
		if r.cfg.Source.Mode == config.SourceReplication {
			return fmt.Errorf("replication is unavailable and source.mode is replication: %s", unavailable.Reason)
		}
		if pollingSince.IsZero() {
			pollingSince = time.Now()
			r.log.Warn().Str("reason", unavailable.Reason).Dur("retry_every", time.Duration(r.cfg.Source.ReplicationRetry)).
				Msg("replication unavailable: falling back to the claim path over every row")
		}
		watchCtx, stopWatch := context.WithCancel(ctx)
		go r.watchUnconsumedSlot(watchCtx, pollingSince)
		err = r.poll(ctx, time.Duration(r.cfg.Source.ReplicationRetry))
		stopWatch()
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			return nil
		}
		// Back to replication through the slot-creation hand-over: a slot
		// left from before polling is dropped, so the new one's snapshot
		// marks every row polling did not finish for the claim path.
		if err := r.dropSlot(ctx, "returning from poll mode to replication"); err != nil {
			r.log.Warn().Err(err).Msg("drop the old slot before returning to replication")
		}
	}
}

// newClaimer builds the claim path; all claims every due row (poll mode),
// otherwise only rows handed to it.
func (r *relayRun) newClaimer(all bool, engine *relay.Engine) (*claim.Claimer, error) {
	cfg := r.cfg
	pc := claim.Config{
		Pool:         r.pool,
		Outbox:       r.tables.Outbox,
		Ledger:       r.tables.Ledger,
		Routes:       r.routes,
		All:          all,
		Unordered:    cfg.Delivery.Ordering == config.OrderingNone,
		BatchSize:    cfg.Source.BatchSize,
		PollInterval: time.Duration(cfg.Source.PollInterval),
		LockTimeout:  time.Duration(cfg.Source.LockTimeout),
		MaxAttempts:  cfg.Delivery.MaxAttempts,
		Backoff:      durations(cfg.Delivery.Backoff),
		SweepAfter:   time.Duration(cfg.Source.SweepAfter),
		Owner:        r.owner,
		Logger:       r.log.With().Str("path", "claim").Logger(),
	}
	if cfg.Source.NotifyTrigger {
		pc.Notify = migrations.NotifyChannel(r.tables.Outbox)
	}
	if engine != nil {
		pc.OnAggregateSettled = engine.Undiverted
		pc.DivertSeq = engine.DivertSeq
	}
	return claim.New(pc)
}

// poll runs the claim path over every due row for d (0: until ctx ends).
func (r *relayRun) poll(ctx context.Context, d time.Duration) error {
	claimer, err := r.newClaimer(true, nil)
	if err != nil {
		return err
	}
	relay.SetMode("poll")
	if d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	r.log.Info().Msg("polling: the claim path takes every due row")
	if err := claimer.Run(ctx); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

// watchUnconsumedSlot checks the slot every few seconds while polling.
func (r *relayRun) watchUnconsumedSlot(ctx context.Context, since time.Time) {
	every := min(time.Duration(r.cfg.Source.SlotMaxUnconsumed)/2, 5*time.Second)
	tick := time.NewTicker(max(every, 100*time.Millisecond))
	defer tick.Stop()
	for {
		if err := r.dropUnconsumedSlot(ctx, since); err != nil && ctx.Err() == nil {
			r.log.Warn().Err(err).Msg("check the unconsumed slot")
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// dropUnconsumedSlot drops the relay's slot when it has not been consumed
// for slot_max_unconsumed or retains more than slot_max_retained: the table
// keeps the events, and an unconsumed slot would keep WAL without limit.
func (r *relayRun) dropUnconsumedSlot(ctx context.Context, since time.Time) error {
	var exists, active bool
	var retained int64
	err := r.pool.QueryRow(ctx, `SELECT count(*) > 0, coalesce(bool_or(active), false),
		coalesce(max(pg_current_wal_lsn() - restart_lsn), 0)::bigint FROM pg_replication_slots WHERE slot_name = $1`,
		r.cfg.Source.Slot).Scan(&exists, &active, &retained)
	if err != nil || !exists || active {
		return err
	}
	if time.Since(since) < time.Duration(r.cfg.Source.SlotMaxUnconsumed) && retained < int64(r.cfg.Source.SlotMaxRetained) {
		return nil
	}
	return r.dropSlot(ctx, fmt.Sprintf("not consumed for %s, retaining %d bytes of WAL", time.Since(since).Round(time.Second), retained))
}

// dropSlot drops the relay's own slot if it exists and nobody streams from it.
func (r *relayRun) dropSlot(ctx context.Context, why string) error {
	tag, err := r.pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, r.cfg.Source.Slot)
	if err == nil && tag.RowsAffected() > 0 {
		r.log.Warn().Str("slot", r.cfg.Source.Slot).Str("why", why).Msg("dropped the replication slot; the outbox table keeps the events")
	}
	return err
}

// stream runs the stream path and, beside it, the claim path over the rows
// the stream hands off, until ctx ends or replication fails.
func (r *relayRun) stream(ctx context.Context) error {
	cfg, log := r.cfg, r.log
	if pid, err := ledger.TerminateStaleWalsender(ctx, cfg.DatabaseURL.Reveal(), cfg.Source.Slot); err != nil {
		log.Warn().Err(err).Msg("could not check the slot for a stale walsender")
	} else if pid != 0 {
		log.Warn().Int32("pid", pid).Msg("ended a stale walsender still holding the slot (a former leader)")
	}

	names := make([]string, len(r.routes))
	for i, s := range r.routes {
		names[i] = s.Sink.Name()
	}
	engine, err := relay.NewEngine(relay.EngineConfig{
		Routes:         r.routes,
		Store:          r.store,
		Unordered:      cfg.Delivery.Ordering == config.OrderingNone,
		InlineAttempts: cfg.Delivery.InlineAttempts,
		MaxAttempts:    cfg.Delivery.MaxAttempts,
		Backoff:        durations(cfg.Delivery.Backoff),
		LaneBlockMax:   time.Duration(cfg.Delivery.LaneBlockMax),
		MarkDone:       cfg.Delivery.MarkDone == config.MarkDoneAsync,
		Holds:          r.store,
		Owner:          r.owner, // the claim path holds this owner's lock

		Logger: log,
	})
	if err != nil {
		return err
	}
	source, err := replication.New(replication.Config{
		ConnString:   cfg.DatabaseURL.Reveal(),
		Slot:         cfg.Source.Slot,
		Publication:  cfg.Source.Publication,
		Outbox:       r.tables.Outbox,
		Consumer:     engine,
		Checkpoint:   r.store,
		MarkForClaim: r.store.MarkForClaim,
		WaitSettled:  engine.WaitSettled,
		Logger:       log,
	})
	if err != nil {
		return err
	}

	engineCtx, stopEngine := context.WithCancel(context.WithoutCancel(ctx))
	defer stopEngine()
	engineDone := make(chan error, 1)
	go func() { engineDone <- engine.Run(engineCtx) }()

	claimer, err := r.newClaimer(false, engine)
	if err != nil {
		return err
	}
	claimCtx, stopClaimer := context.WithCancel(ctx)
	claimDone := make(chan error, 1)
	go func() { claimDone <- claimer.Run(claimCtx) }()
	defer func() { stopClaimer(); <-claimDone }()

	// Rows whose mark-done a crash lost are settled from the ledger beside
	// the stream, not before it: on a large backlog the pass takes seconds,
	// and streaming must not wait for bookkeeping. It skips rows the engine
	// is settling, and a row it misses stays pending until the next start.
	sweepDone := make(chan struct{})
	go func() {
		defer close(sweepDone)
		if n, err := r.store.MarkDeliveredDone(claimCtx, names); err != nil && claimCtx.Err() == nil {
			log.Warn().Err(err).Msg("mark rows the ledger shows delivered; they stay pending until the next start")
		} else if n > 0 {
			log.Info().Int64("rows", n).Msg("marked done: rows the ledger shows delivered to every sink")
		}
	}()
	defer func() { stopClaimer(); <-sweepDone }()

	relay.SetMode("replication")
	log.Info().Str("slot", cfg.Source.Slot).Str("outbox", r.tables.Outbox.String()).Int("sinks", len(r.routes)).Msg("relay running")
	srcErr := source.Run(ctx)

	// The source has stopped taking events; let in-flight ones finish and
	// their outcomes reach the database, then stop.
	drainCtx, cancel := context.WithTimeout(context.Background(), time.Duration(cfg.ShutdownTimeout))
	defer cancel()
	if err := engine.Drain(drainCtx); err != nil {
		log.Warn().Err(err).Msg("shutdown_timeout passed with events in flight; they will be re-streamed and checked against the ledger at the next start")
	}
	stopEngine()
	if err := <-engineDone; err != nil && srcErr == nil {
		srcErr = err
	}
	if srcErr != nil && !errors.Is(srcErr, context.Canceled) {
		return srcErr
	}
	return nil
}

// newPool opens the relay's connection pool. pgxpool's default (4, or the
// CPU count) is too small for the loops that share it — settlement,
// mark-done, checkpoints, the claim path, stats — and a checkpoint waiting
// for a connection stalls the stream; pool_max_conns in the URL still wins.
func newPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	if !strings.Contains(url, "pool_max_conns") {
		pcfg.MaxConns = 12
	}
	// The relay's statements are short and frequent; a plan that crosses
	// jit_above_cost (a batch of thousands of ids, the start-up pass over a
	// large backlog) spends half a second compiling, on the delivery path.
	// A jit setting in the URL (options=-cjit=on, or jit=on) still wins.
	if _, set := pcfg.ConnConfig.RuntimeParams["jit"]; !set && !strings.Contains(pcfg.ConnConfig.RuntimeParams["options"], "jit") {
		pcfg.ConnConfig.RuntimeParams["jit"] = "off"
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	return pool, nil
}

// refreshStats publishes the table gauges every 10 s: counting by status
// scans the table, so it never runs per scrape.
func (r *relayRun) refreshStats(ctx context.Context) {
	tick := time.NewTicker(10 * time.Second)
	defer tick.Stop()
	for {
		st, err := r.store.Stats(ctx, r.cfg.Source.Slot, time.Duration(r.cfg.Source.SweepAfter))
		if err == nil {
			st.Publish()
		} else if ctx.Err() == nil {
			r.log.Debug().Err(err).Msg("refresh outbox stats")
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// openSinks builds the configured sinks in order. On error it returns the
// sinks opened so far, for the caller to close.
func openSinks(ctx context.Context, cfg *config.Config, log zerolog.Logger) ([]relay.Route, error) {
	var routes []relay.Route
	for i, sc := range cfg.Sinks {
		slog := log.With().Str("sink", sc.Name).Logger()
		var sink relay.Sink
		switch sc.Type {
		case config.SinkWebhook:
			w := sc.Webhook
			tlsConfig, err := sc.TLS.ClientConfig()
			if err != nil {
				return routes, fmt.Errorf("sinks[%d] (%s): tls.%w", i, sc.Name, err)
			}
			s, err := webhook.New(webhook.Config{
				TLS:                 tlsConfig,
				Name:                sc.Name,
				URL:                 sc.URL,
				Timeout:             time.Duration(w.Timeout),
				Concurrency:         w.Concurrency,
				Headers:             w.Headers,
				Auth:                webhook.Auth{Type: string(w.Auth.Type), Secret: w.Auth.Secret.Reveal(), Header: w.Auth.Header, Value: w.Auth.Value.Reveal(), Username: w.Auth.Username, Password: w.Auth.Password.Reveal()},
				MaxBody:             int64(w.MaxBody),
				PermanentStatuses:   w.PermanentStatuses,
				Treat409AsDelivered: w.Treat409AsDelivered,
				Logger:              slog,
			})
			if err != nil {
				return routes, fmt.Errorf("sinks[%d] (%s): %w", i, sc.Name, err)
			}
			sink = s
		case config.SinkNATS:
			n := sc.NATS
			var opts []nats.Option
			if n.CredsFile != "" {
				opts = append(opts, nats.UserCredentials(n.CredsFile))
			}
			if n.NkeyFile != "" {
				opt, err := nats.NkeyOptionFromSeed(n.NkeyFile)
				if err != nil {
					return routes, fmt.Errorf("sinks[%d] (%s): nkey_file: %w", i, sc.Name, err)
				}
				opts = append(opts, opt)
			}
			if tok := n.Token.Reveal(); tok != "" {
				opts = append(opts, nats.Token(tok))
			}
			tlsConfig, err := sc.TLS.ClientConfig()
			if err != nil {
				return routes, fmt.Errorf("sinks[%d] (%s): tls.%w", i, sc.Name, err)
			}
			if tlsConfig != nil {
				opts = append(opts, nats.Secure(tlsConfig))
			}
			s, err := natssink.New(ctx, natssink.Config{
				Options: opts,
				Name:    sc.Name,
				URL:     sc.URL,
				DataDir: filepath.Join(cfg.DataDir, "nats"),
				Subject: n.Subject,
				Stream: natssink.StreamConfig{Name: n.Stream.Name, Subjects: n.Stream.Subjects,
					DuplicateWindow: time.Duration(n.Stream.DuplicateWindow), Create: n.Stream.Create, MaxMsgSize: int64(n.Stream.MaxMsgSize)},
				MaxPending: n.MaxPending,
				Logger:     slog,
			})
			if credentialsRefused(err) {
				down := newDownSink(sc.Name, fmt.Errorf("sinks[%d] (%s): %w", i, sc.Name, err))
				slog.Error().Err(down.err).Msg("sink is down: its events wait on the claim path; the other sinks run")
				sink = down
				break
			}
			if err != nil {
				return routes, fmt.Errorf("sinks[%d] (%s): %w", i, sc.Name, err)
			}
			if sc.URL == "" {
				slog.Info().Str("url", s.ClientURL()).Str("subscribe", fmt.Sprintf("nats sub --server %s '%s'", s.ClientURL(), firstOr(n.Stream.Subjects, ">"))).
					Msg("embedded NATS server with JetStream (single instance); subscribe to see events")
			}
			sink = s
		default:
			return routes, fmt.Errorf("sinks[%d] (%s): unknown type %q", i, sc.Name, sc.Type)
		}
		isHook := sc.Type == config.SinkWebhook
		routes = append(routes, relay.Route{Sink: sink, Events: sc.Events,
			Nudge: isHook && sc.Webhook.Body == config.BodyNudge,
			Hold:  isHook && sc.Webhook.OnUnknown == config.OnUnknownHold})
	}
	return routes, nil
}

// resolveTables schema-qualifies the outbox (the replication stream names
// relations by schema) and fails early when migrate has not run.
func resolveTables(ctx context.Context, pool *pgxpool.Pool, t config.Tables) (config.Tables, error) {
	var schema string
	err := pool.QueryRow(ctx, `SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.oid = to_regclass($1)`, t.Outbox.Quoted()).Scan(&schema)
	if errors.Is(err, pgx.ErrNoRows) {
		return t, fmt.Errorf("outbox table %s does not exist: run `outbox-relay migrate` first", t.Outbox)
	}
	if err != nil {
		return t, fmt.Errorf("look up outbox table %s: %w", t.Outbox, err)
	}
	t.Outbox.Schema = schema
	return t, nil
}

// checkPrivileges fails when the role lacks a privilege the delivery paths
// need (and, with replication, the REPLICATION attribute), naming each with
// its GRANT: without them run would start and then fail every claim or
// settlement, over and over.
func checkPrivileges(ctx context.Context, pool *pgxpool.Pool, t config.Tables, replication bool) error {
	tables, err := admin.Resolve(ctx, pool, admin.Tables{Outbox: t.Outbox, Ledger: t.Ledger, Checkpoint: t.Checkpoint})
	if err != nil {
		return err
	}
	if err := admin.CheckRunPrivileges(ctx, pool, tables, replication); err != nil {
		return fmt.Errorf("check the role's privileges: %w", err)
	}
	return nil
}

func durations(ds []config.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = time.Duration(d)
	}
	return out
}

func firstOr(list []string, def string) string {
	if len(list) > 0 {
		return list[0]
	}
	return def
}
