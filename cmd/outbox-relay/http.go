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
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

// health is what /healthz and /readyz report. Live means the process runs
// its loops and is not stalled (stall.go); ready means it can do its job
// now: streaming or polling as the leader, or waiting as a standby that can
// take over — and not stalled.
type health struct {
	ready   atomic.Bool
	reason  atomic.Value // string: why not ready
	stalled atomic.Value // string: why the relay is stalled, "" when it is not
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
// profiles under /debug/pprof/, behind the same token. wait returns once
// the server has shut down (ctx done) and its goroutines have ended.
func serveHTTP(ctx context.Context, hc config.HTTPConfig, h *health, log zerolog.Logger) (addr net.Addr, wait func(), err error) {
	ln, err := net.Listen("tcp", hc.Listen)
	if err != nil {
		return nil, nil, fmt.Errorf("http.listen %s: %w", hc.Listen, err)
	}
	if host, _, _ := net.SplitHostPort(hc.Listen); host != "127.0.0.1" && host != "localhost" && host != "::1" {
		log.Warn().Str("listen", ln.Addr().String()).Msg("the metrics and health endpoints listen beyond loopback")
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
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if reason := h.stalledReason(); reason != "" {
			http.Error(w, "not ready: stalled: "+reason, http.StatusServiceUnavailable)
			return
		}
		if h.ready.Load() {
			fmt.Fprintln(w, "ready")
			return
		}
		reason, _ := h.reason.Load().(string)
		http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	var wg sync.WaitGroup
	wg.Go(func() {
		<-ctx.Done()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(shutdownCtx)
	})
	wg.Go(func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error().Err(err).Msg("http server")
		}
	})
	log.Info().Str("listen", ln.Addr().String()).Msg("serving /metrics /healthz /readyz")
	return ln.Addr(), wg.Wait, nil
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
