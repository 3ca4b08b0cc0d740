package main

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

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
			opts, err := natsClientOptions(sc)
			if err != nil {
				return routes, fmt.Errorf("sinks[%d] (%s): %w", i, sc.Name, err)
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

func firstOr(list []string, def string) string {
	if len(list) > 0 {
		return list[0]
	}
	return def
}

// natsClientOptions are the credentials and TLS a NATS sink connects with.
func natsClientOptions(sc config.SinkConfig) ([]nats.Option, error) {
	n := sc.NATS
	var opts []nats.Option
	if n.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(n.CredsFile))
	}
	if n.NkeyFile != "" {
		opt, err := nats.NkeyOptionFromSeed(n.NkeyFile)
		if err != nil {
			return nil, fmt.Errorf("nkey_file: %w", err)
		}
		opts = append(opts, opt)
	}
	if tok := n.Token.Reveal(); tok != "" {
		opts = append(opts, nats.Token(tok))
	}
	tlsConfig, err := sc.TLS.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("tls.%w", err)
	}
	if tlsConfig != nil {
		opts = append(opts, nats.Secure(tlsConfig))
	}
	return opts, nil
}
