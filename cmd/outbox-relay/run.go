package main

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/cmd/internal/console"
	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
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
	lcfg := ledger.DefaultConfig()
	lcfg.Outbox, lcfg.Ledger, lcfg.Checkpoint = r.tables.Outbox, r.tables.Ledger, r.tables.Checkpoint
	lcfg.Unordered = cfg.Delivery.Ordering == config.OrderingNone
	lcfg.MaxInFlightBytes = int64(cfg.Delivery.MaxInFlightBytes)
	if r.store, err = ledger.New(pool, lcfg); err != nil {
		return err
	}
	relay.InitMetrics(r.routes)
	r.health.setSinksDown(sinksDown(r.routes))
	where := admin.Where{Slot: cfg.Source.Slot, LeaderKey: ledger.LeaderLockKey(cfg.Source.Slot)}
	if r.standbyPool != nil {
		where.Standby = r.standbyPool // the slot lives there (docs/standby.md)
	}
	var sinks []admin.Sink
	for _, rt := range r.routes {
		sinks = append(sinks, admin.Sink{Name: rt.Sink.Name(), Events: rt.Events, Filter: rt.Filter})
	}
	con.Attach(console.Backend{DB: pool, Tables: admin.Tables{Outbox: r.tables.Outbox, Ledger: r.tables.Ledger, Checkpoint: r.tables.Checkpoint, Sinks: sinks},
		Where: where, Health: r.health.view})

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

// statsRefresher is refreshStats; a test replaces it to see that the relay
// waits for it.
var statsRefresher = (*relayRun).refreshStats

// newPool opens the relay's connection pool. pgxpool's default (4, or the
// CPU count) is too small for the loops that share it — settlement,
// checkpoints, the claim path, stats — and a checkpoint waiting
// for a connection stalls the stream; pool_max_conns in the URL still wins.
func newPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	if !strings.Contains(url, "pool_max_conns") {
		pcfg.MaxConns = 12
	}
	pcfg.ConnConfig.DialFunc = relay.Dial
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = relay.ConnectTimeout
	}
	// A connection idle for a second is pinged before use; one that does
	// not answer within 2 s is dropped and another used, instead of a
	// statement waiting on a dead connection for its whole timeout.
	pcfg.PingTimeout = 2 * time.Second
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

// refreshStats publishes the table gauges every 10 s, or less often while
// counting takes long (statsPause): counting by status reads every row
// handed to the claim path, so it never runs per scrape
// (docs/operations.md, "Metrics").
func (r *relayRun) refreshStats(ctx context.Context) {
	for {
		start := time.Now()
		st, err := r.store.Stats(ctx, r.cfg.Source.Slot, time.Duration(r.cfg.Source.SweepAfter))
		if err == nil {
			st.Publish()
		} else if ctx.Err() == nil {
			r.log.Debug().Err(err).Msg("refresh outbox stats")
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(statsPause(time.Since(start))):
		}
	}
}

// statsPause is the wait after a refresh of the table gauges that took
// took: 10 s from its start, and at least 19 times as long as it took, so
// that counting occupies at most a twentieth of one connection. Behind a
// backlog of 200,000 handed-off rows a refresh took 1.8 s, every 10 s
// (make bench's slot-recreated, docs/performance.md).
func statsPause(took time.Duration) time.Duration {
	return max(10*time.Second-took, 19*took)
}

// msgIDScope is what scopes the NATS sinks' message ids to this deployment
// (docs/sinks.md, "Message ids"), read from the database once.
type msgIDScope struct {
	outbox     relay.QualifiedName // schema-qualified
	scopedFrom int64
	identity   admin.Identity
	// identityErr says why the database's identity is unknown; a sink
	// with msg_id_prefix does without it.
	identityErr error
}

// readMsgIDScope reads the scope when a NATS sink is configured.
func readMsgIDScope(ctx context.Context, pool *pgxpool.Pool, cfg *config.Config, outbox relay.QualifiedName) (msgIDScope, error) {
	scope := msgIDScope{outbox: outbox}
	if !slices.ContainsFunc(cfg.EffectiveSinks(), func(s config.SinkConfig) bool { return s.Type == config.SinkNATS }) {
		return scope, nil
	}
	var err error
	if scope.scopedFrom, err = admin.ReadMsgIDScope(ctx, pool, outbox); err != nil {
		return scope, err
	}
	scope.identity, scope.identityErr = admin.ReadIdentity(ctx, pool)
	return scope, nil
}

// deployment returns the Deployment of the NATS sink sc, the i-th: its
// msg_id_prefix, or else the ID derived from the database's identity.
func (s msgIDScope) deployment(i int, sc config.SinkConfig) (natssink.Deployment, error) {
	dep := natssink.Deployment{ID: sc.NATS.MsgIDPrefix, ScopedFrom: s.scopedFrom}
	if dep.ID != "" {
		return dep, nil
	}
	if s.identityErr != nil {
		return dep, fmt.Errorf("sinks[%d] (%s): %w: set sinks[%d].msg_id_prefix to an id no other deployment publishing into the stream uses (docs/sinks.md, \"Message ids\")",
			i, sc.Name, s.identityErr, i)
	}
	dep.ID = natssink.DeploymentID(s.identity.SystemIdentifier, s.identity.Database, s.outbox.Quoted())
	return dep, nil
}

// openSinks builds the configured sinks in order. On error it returns the
// sinks opened so far, for the caller to close.
func openSinks(ctx context.Context, cfg *config.Config, scope msgIDScope, log zerolog.Logger) ([]relay.Route, error) {
	var routes []relay.Route
	for i, sc := range cfg.EffectiveSinks() {
		// The sinks add their own "sink" field: they get log, and slog
		// is for the lines written here. A field added twice is a
		// duplicate JSON key, which log pipelines drop.
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
				Format:              string(sc.Format),
				CloudEventsSource:   sc.CloudEvents.Source,
				MaxBody:             int64(w.MaxBody),
				PermanentStatuses:   w.PermanentStatuses,
				Treat409AsDelivered: w.Treat409AsDelivered,
				Batch:               webhook.Batch{MaxEvents: w.Batch.MaxEvents, MaxWait: time.Duration(w.Batch.MaxWait), Ordered: w.Batch.Ordered},
				Logger:              log,
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
			dep, err := scope.deployment(i, sc)
			if err != nil {
				return routes, err
			}
			s, err := natssink.New(ctx, natssink.Config{
				Deployment: dep,
				Options:    opts,
				Name:       sc.Name,
				URL:        sc.URL,
				DataDir:    filepath.Join(cfg.DataDir, "nats"),
				Subject:    n.Subject,
				Stream: natssink.StreamConfig{Name: n.Stream.Name, Subjects: n.Stream.Subjects,
					DuplicateWindow: time.Duration(n.Stream.DuplicateWindow), Create: n.Stream.Create, MaxMsgSize: int64(n.Stream.MaxMsgSize)},
				MaxPending:        n.MaxPending,
				Format:            string(sc.Format),
				CloudEventsSource: sc.CloudEvents.Source,
				Logger:            log,
			})
			if err != nil {
				return routes, fmt.Errorf("sinks[%d] (%s): %w", i, sc.Name, err)
			}
			if sc.URL == "" {
				slog.Info().Str("url", s.ClientURL()).Str("subscribe", fmt.Sprintf("nats sub --server %s '%s'", s.ClientURL(), firstOr(n.Stream.Subjects, ">"))).
					Msg("embedded NATS server with JetStream (single instance); see its events with the nats CLI (github.com/nats-io/natscli)")
			}
			sink = s
		default:
			return routes, fmt.Errorf("sinks[%d] (%s): unknown type %q", i, sc.Name, sc.Type)
		}
		isHook := sc.Type == config.SinkWebhook
		rt := relay.Route{Sink: sink, Events: sc.Events, Filter: sc.CompiledFilter(),
			Nudge: isHook && sc.Webhook.Body == config.BodyNudge,
			Hold:  isHook && sc.Webhook.OnUnknown == config.OnUnknownHold}
		if rl := sc.RateLimit; rl.On() {
			// One limiter per sink for the process: every engine term and
			// both paths share it (docs/sinks.md, "Rate limits").
			rt.RateLimit = relay.NewRateLimit(rl.PerSecond, rl.Burst)
		}
		routes = append(routes, rt)
	}
	return routes, nil
}

// downReporter is a sink that can tell that it is down, and why, without
// being sent an event (natssink.Sink.Down).
type downReporter interface {
	Down() error
}

// sinksDown returns what /readyz says of the sinks: a line for each that is
// down now, naming it and why.
func sinksDown(routes []relay.Route) func() []string {
	return func() []string {
		var lines []string
		for _, rt := range routes {
			if d, ok := rt.Sink.(downReporter); ok {
				if err := d.Down(); err != nil {
					lines = append(lines, fmt.Sprintf("sink %s is down: %v", rt.Sink.Name(), err))
				}
			}
		}
		return lines
	}
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
