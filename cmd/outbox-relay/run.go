package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/cmd/internal/console"
	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

func newRunCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run the relay daemon: stream the outbox to the sinks",
		Long: `Run streams outbox INSERTs from the replication slot to the configured sinks.
It refuses to start without a sink: --embedded-nats (embedded_nats: true) adds one that
delivers to an embedded NATS server with JetStream, to try the relay out.
SIGTERM/SIGINT stop taking new events, finish in-flight ones, record their outcomes and
exit 0 within shutdown_timeout.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.loadConfig()
			if err != nil {
				return err
			}
			if len(cfg.EffectiveSinks()) == 0 {
				return usageError{g.noSinks()}
			}
			return runRelay(cmd.Context(), cfg, g.logger(cfg))
		},
	}
	cmd.Flags().BoolVar(&g.embeddedNATS, "embedded-nats", false, "add a sink named nats on an embedded NATS server with JetStream (embedded_nats: true): a try-out, single instance")
	return cmd
}

// noSinks says why run refuses a configuration without sinks, and what to
// do: the embedded NATS server is a choice, never a default
// (docs/configuration.md, "Where settings come from").
func (g *globals) noSinks() error {
	var where string
	switch path, from := g.configFile(); {
	case from == config.EnvConfigFile:
		where = fmt.Sprintf("%s (%s=%s)", path, config.EnvConfigFile, path)
	case path != "":
		where = path
	default:
		where = "the configuration (no file: neither --config nor " + config.EnvConfigFile + " names one)"
	}
	return fmt.Errorf("no sinks configured in %s: run would deliver nowhere. Add sinks (docs/configuration.md, \"sinks\"), "+
		"or pass --embedded-nats (embedded_nats: true) to try the relay with an embedded NATS server", where)
}

// relayRun is one running relay: what its terms share.
type relayRun struct {
	cfg    *config.Config
	log    zerolog.Logger
	pool   *pgxpool.Pool
	tables config.Tables
	store  *ledger.Store
	routes []relay.Route
	owner  string
	health *health
	// standbyPool reaches the standby the stream decodes on
	// (source.standby_url), for its slot's watchdog; nil without one.
	standbyPool *pgxpool.Pool
	// feed is the live feed of outcomes the admin API serves.
	feed *relay.Feed
}

// runRelay turns the configuration into a running relay and blocks until
// ctx is done: it opens the pool, the store and the sinks, and hands them to
// the supervisor (relay/supervisor), which runs the modes, leadership and
// each term.
func runRelay(ctx context.Context, cfg *config.Config, log zerolog.Logger) error {
	r := &relayRun{cfg: cfg, log: log, owner: ledger.NewOwner(), health: &health{}}
	r.health.set(false, "starting")
	if cfg.CPUScheduling != "" {
		log.Warn().Str("cpu_scheduling", cfg.CPUScheduling).
			Msg("cpu_scheduling is no longer used: the relay leaves the kernel's scheduling alone; remove the key (docs/configuration.md, \"Removed keys\")")
	}
	if cfg.Delivery.MarkDone == config.MarkDoneOff {
		log.Warn().Str("mark_done", string(cfg.Delivery.MarkDone)).
			Msg("delivery.mark_done: off is no longer supported: every row's status is written in the settlement that records its delivery (done, in the same transaction as its ledger rows); remove the key (docs/configuration.md, \"Removed keys\")")
	}

	// The endpoints serve from the start to the very end (probes during
	// start-up and the drain); the server has shut down when run returns.
	httpCtx, stopHTTP := context.WithCancel(relay.Detached(ctx, "the endpoints serve through the drain; stopHTTP ends them when run returns"))
	var con *console.Server
	r.feed, con = newConsole(httpCtx, cfg, log)
	_, waitHTTP, err := serveHTTP(httpCtx, cfg.HTTP, r.health, log, con.Register)
	if err != nil {
		stopHTTP()
		return err
	}
	defer func() { stopHTTP(); _ = waitHTTP() }()

	pool, err := newPool(ctx, cfg.DatabaseURL.Reveal())
	if err != nil {
		return err
	}
	defer pool.Close()
	r.pool = pool
	// The pool connects lazily: a refused connection would surface as the
	// first query's failure, under that query's name.
	if err := pool.Ping(ctx); err != nil {
		return connectError(cfg, err)
	}
	if cfg.DatabaseURL == "" {
		log.Info().Str("database", dbTarget("")).Msg("database_url is not set (nor --database-url, DATABASE_URL): libpq's defaults and the PG* variables chose the database")
	}
	if url := cfg.Source.StandbyURL.Reveal(); url != "" && cfg.Source.Mode != config.SourcePoll {
		// Connected lazily: the standby may be down at start, and auto mode
		// then delivers on the primary (docs/standby.md).
		if r.standbyPool, err = newPool(ctx, url); err != nil {
			return fmt.Errorf("source.standby_url: %w", err)
		}
		defer r.standbyPool.Close()
		log.Info().Str("standby", dbTarget(url)).Dur("standby_max_lag", time.Duration(cfg.Source.StandbyMaxLag)).
			Msg("decoding on a standby: the slot lives there; the ledger, the checkpoint and the claim path stay on the primary")
	}

	if r.tables, err = resolveTables(ctx, pool, cfg.Tables()); err != nil {
		return err
	}
	if err := migrations.CheckSchema(ctx, pool, migrations.Names{Outbox: r.tables.Outbox, Checkpoint: r.tables.Checkpoint}); err != nil {
		return err
	}
	if err := checkPrivileges(ctx, pool, r.tables, cfg.Source.Mode == config.SourceReplication); err != nil {
		return err
	}

	if err := fillCloudEventsSources(ctx, pool, cfg, r.tables.Outbox); err != nil {
		return err
	}
	scope, err := readMsgIDScope(ctx, pool, cfg, r.tables.Outbox)
	if err != nil {
		return err
	}
	// Sinks are closed last, after the engine has drained, on a fresh context.
	r.routes, err = openSinks(ctx, cfg, scope, log)
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
	if r.store, err = newStore(pool, r.tables, cfg); err != nil {
		return err
	}
	relay.InitMetrics(r.routes)
	r.health.setSinksDown(sinksDown(r.routes))
	con.Attach(r.consoleBackend())

	routes, stopTracing, err := traceDeliveries(ctx, r.routes, log)
	if err != nil {
		return err
	}
	defer stopTracing()
	r.routes = routes

	notifier, err := r.newNotifier(ctx)
	if err != nil {
		return err
	}
	if notifier != nil {
		defer notifier.close()
	}

	// The stall detector follows the supervisor's terms (stall.go).
	stall := newStallWatch(time.Duration(cfg.HTTP.StallAfter), r.health, log)
	sup, err := newSupervisor(r, stall)
	if err != nil {
		return err
	}
	// The relay's workers (relay.Group, docs/architecture.md "goroutines
	// and their owners"): the supervisor and, beside it, the table gauges,
	// retention and the stall detector. Each runs until ctx ends; one that
	// fails stops the others and the relay with its error. All have
	// returned before the pool closes and the sinks are closed (the
	// deferred calls above).
	workers, wctx := relay.NewGroup(ctx)
	workers.Go("table gauges", func(ctx context.Context) error { statsRefresher(r, ctx); return nil })
	if cfg.Retention.Enabled {
		workers.Go("retention", func(ctx context.Context) error {
			var standby admin.DB // the slot's server, decoding on a standby
			if r.standbyPool != nil {
				standby = r.standbyPool
			}
			return runRetention(ctx, pool, standby, r.tables, cfg, log)
		})
	}
	workers.Go("stall detector", func(ctx context.Context) error { stall.run(ctx); return nil })
	initVerifyMetrics()
	if cfg.Verify.Interval > 0 {
		workers.Go("verify", func(ctx context.Context) error { return runContinuousVerify(ctx, pool, r.tables, cfg, log) })
	}
	if con.Enabled() {
		workers.Go("console", func(ctx context.Context) error { con.Run(ctx); return nil })
	}
	if notifier != nil {
		workers.Go("notify", notifier.Run)
	}
	r.health.set(true, "")
	err = sup.Run(wctx)
	if werr := workers.Stop(); err == nil {
		err = werr
	}
	log.Info().Msg("relay stopped")
	return err
}

// newStore opens the ledger's store over pool for the resolved tables.
func newStore(pool *pgxpool.Pool, t config.Tables, cfg *config.Config) (*ledger.Store, error) {
	lcfg := ledger.DefaultConfig()
	lcfg.Outbox, lcfg.Ledger, lcfg.Checkpoint = t.Outbox, t.Ledger, t.Checkpoint
	lcfg.Unordered = cfg.Delivery.Ordering == config.OrderingNone
	lcfg.MaxInFlightBytes = int64(cfg.Delivery.MaxInFlightBytes)
	return ledger.New(pool, lcfg)
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
