package main

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/cmd/internal/console"
	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/relay"
)

// health is what /healthz and /readyz report. Live means the process runs
// its loops and is not stalled (stall.go); ready means it can do its job
// now: streaming or polling as the leader, or waiting as a standby that can
// take over — and not stalled. A sink that is down does not make the relay
// unready: it delivers to the others and its events wait on the claim path
// (docs/sinks.md, "A server down at start"); /readyz's body names it.
type health struct {
	ready   atomic.Bool
	reason  atomic.Value // string: why not ready
	stalled atomic.Value // string: why the relay is stalled, "" when it is not
	// sinksDown returns a line per sink that is down, saying why; nil
	// until the sinks are open.
	sinksDown atomic.Pointer[func() []string]
}

// setSinksDown sets where /readyz learns which sinks are down.
func (h *health) setSinksDown(f func() []string) { h.sinksDown.Store(&f) }

// downLines returns the lines naming the sinks that are down.
func (h *health) downLines() []string {
	if f := h.sinksDown.Load(); f != nil {
		return (*f)()
	}
	return nil
}

func (h *health) set(ready bool, reason string) {
	h.ready.Store(ready)
	h.reason.Store(reason)
}

// setStalled records why the relay is stalled ("" when it is not).
func (h *health) setStalled(reason string) { h.stalled.Store(reason) }

// stalledReason returns why the relay is stalled, or "".
func (h *health) stalledReason() string {
	reason, _ := h.stalled.Load().(string)
	return reason
}

// serveHTTP serves /metrics, /healthz and /readyz on hc.Listen until ctx is
// done. It listens on 127.0.0.1 by default; binding another address is
// logged, because the metrics name tables and sinks. With hc.MetricsToken
// set, /metrics answers 401 to a request without "Authorization: Bearer
// <token>"; the health endpoints stay open for probes. hc.Pprof adds the Go
// profiles under /debug/pprof/, behind the same token. routes add their
// own (the admin API and the console: cmd/internal/console). The server
// runs until ctx is done or stop is called; stop shuts it down and returns
// once its goroutines have ended (relay.Group), with the server's failure,
// if it failed.
func serveHTTP(ctx context.Context, hc config.HTTPConfig, h *health, log zerolog.Logger, routes ...func(*http.ServeMux)) (addr net.Addr, stop func() error, err error) {
	ln, err := net.Listen("tcp", hc.Listen)
	if err != nil {
		return nil, nil, fmt.Errorf("http.listen %s: %w", hc.Listen, err)
	}
	if host, _, _ := net.SplitHostPort(hc.Listen); host != "127.0.0.1" && host != "localhost" && host != "::1" {
		what := "the metrics and health endpoints listen"
		if hc.AdminToken != "" {
			what = "the metrics and health endpoints, the admin API and the console listen"
		}
		log.Warn().Str("listen", ln.Addr().String()).Msg(what + " beyond loopback")
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", requireBearer(hc.MetricsToken.Reveal(), promhttp.Handler()))
	if hc.Pprof {
		// The profiles show code paths and memory, as sensitive as the
		// metrics: the same token guards them.
		guard := func(h http.Handler) http.Handler { return requireBearer(hc.MetricsToken.Reveal(), h) }
		mux.Handle("GET /debug/pprof/", guard(http.HandlerFunc(pprof.Index)))
		mux.Handle("GET /debug/pprof/cmdline", guard(http.HandlerFunc(pprof.Cmdline)))
		mux.Handle("GET /debug/pprof/profile", guard(http.HandlerFunc(pprof.Profile)))
		mux.Handle("GET /debug/pprof/symbol", guard(http.HandlerFunc(pprof.Symbol)))
		mux.Handle("GET /debug/pprof/trace", guard(http.HandlerFunc(pprof.Trace)))
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if reason := h.stalledReason(); reason != "" {
			http.Error(w, "stalled: "+reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	// The first line is the verdict; each sink that is down adds a line
	// "sink NAME is down: WHY", whatever the status (a probe may ignore
	// or match them).
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		verdict, status := "ready", http.StatusOK
		if reason := h.stalledReason(); reason != "" {
			verdict, status = "not ready: stalled: "+reason, http.StatusServiceUnavailable
		} else if !h.ready.Load() {
			reason, _ := h.reason.Load().(string)
			verdict, status = "not ready: "+reason, http.StatusServiceUnavailable
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.WriteHeader(status)
		fmt.Fprintln(w, verdict)
		for _, line := range h.downLines() {
			fmt.Fprintln(w, line)
		}
	})
	for _, add := range routes {
		add(mux)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	web, _ := relay.NewGroup(ctx)
	web.Go("http server", func(context.Context) error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.Error().Err(err).Msg("http server")
			return err
		}
		return nil
	})
	web.Go("http shutdown", func(ctx context.Context) error {
		<-ctx.Done()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(shutdownCtx)
		return nil
	})
	log.Info().Str("listen", ln.Addr().String()).Msg("serving /metrics /healthz /readyz")
	return ln.Addr(), web.Stop, nil
}

// view is the relay's health as the admin API shows it.
func (h *health) view() console.Health {
	reason, _ := h.reason.Load().(string)
	v := console.Health{Ready: h.ready.Load(), Stalled: h.stalledReason(), SinksDown: h.downLines()}
	if !v.Ready {
		v.NotReady = reason
	}
	v.Ready = v.Ready && v.Stalled == ""
	return v
}

// requireBearer wraps next so that it answers 401 unless the request carries
// "Authorization: Bearer <token>"; an empty token requires nothing. The
// comparison takes the same time whatever the mismatch.
func requireBearer(token string, next http.Handler) http.Handler {
	if token == "" {
		return next
	}
	want := []byte(token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme, got, _ := strings.Cut(r.Header.Get("Authorization"), " ")
		if !strings.EqualFold(scheme, "Bearer") || subtle.ConstantTimeCompare([]byte(strings.TrimSpace(got)), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="metrics"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// newConsole returns the live feed of outcomes and the admin API with the
// console (docs/operations.md, "Console and admin API"), which serve while
// ctx lasts. Without http.admin_token the API and the console are off, and
// the log says how to turn them on.
func newConsole(ctx context.Context, cfg *config.Config, log zerolog.Logger) (*relay.Feed, *console.Server) {
	feed := relay.NewFeed(cfg.HTTP.FeedPayloads)
	con := console.New(console.Config{
		AdminToken: cfg.HTTP.AdminToken.Reveal(),
		ReadToken:  cfg.HTTP.AdminReadToken.Reveal(),
		Feed:       feed,
		Done:       ctx.Done(),
		Logger:     log,
	})
	if !con.Enabled() {
		log.Info().Msg("the admin API and the console are off: set http.admin_token (or http.admin_token_file) to serve them at /api/v1 and /console/ (docs/operations.md, \"Console and admin API\")")
	} else {
		log.Info().Bool("read_only_token", cfg.HTTP.AdminReadToken != "").Bool("feed_payloads", cfg.HTTP.FeedPayloads).
			Msg("the admin API and the console are on, behind http.admin_token: /api/v1 and /console/")
	}
	return feed, con
}

// consoleBackend is what the admin API reads and acts on: the primary's
// tables, the sinks, where the slot and the leader lock are, and the
// relay's health.
func (r *relayRun) consoleBackend() console.Backend {
	where := admin.Where{Slot: r.cfg.Source.Slot, LeaderKey: ledger.LeaderLockKey(r.cfg.Source.Slot)}
	if r.standbyPool != nil {
		where.Standby = r.standbyPool // the slot lives there (docs/standby.md)
	}
	var sinks []admin.Sink
	for _, rt := range r.routes {
		sinks = append(sinks, admin.Sink{Name: rt.Sink.Name(), Events: rt.Events, Filter: rt.Filter})
	}
	return console.Backend{DB: r.pool, Tables: admin.Tables{Outbox: r.tables.Outbox, Ledger: r.tables.Ledger, Checkpoint: r.tables.Checkpoint, Sinks: sinks},
		Where: where, Health: r.health.view}
}
