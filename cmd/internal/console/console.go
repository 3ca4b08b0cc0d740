// Package console serves the relay's admin API (JSON, /api/v1) and the
// console, one page embedded in the binary that uses it (/console/), on
// the relay's HTTP listener (docs/operations.md, "Console and admin API").
//
// The API only binds operations to HTTP: each operation is the one the
// command line runs (ledger/admin: the status of the relays, dead letters,
// retry, discard, replay, event lookup), and the live feed and the flow
// come from the relay's memory (relay.Feed, the metrics registry). Both
// need a bearer token (http.admin_token, or http.admin_read_token for
// reading only); without http.admin_token nothing is served. Actions are
// POSTs, refused from another site, and logged with what they changed and
// who asked. Reads of the database are bounded (indexes, id ranges, one
// second's cache, two at a time) and never scan the outbox.
package console

import (
	"context"
	"crypto/subtle"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Config configures the API and the console.
type Config struct {
	// AdminToken grants every operation; ReadToken, when set, only the
	// reads (GET). Without AdminToken the server serves nothing.
	AdminToken, ReadToken string
	// Feed is the relay's live feed; nil: /api/v1/feed answers 503.
	Feed *relay.Feed
	// Gatherer is the metrics registry the flow is read from
	// [prometheus.DefaultGatherer].
	Gatherer prometheus.Gatherer
	// Done, once closed, ends the live feeds: the HTTP server is shutting
	// down and would otherwise wait for them.
	Done   <-chan struct{}
	Logger zerolog.Logger
}

// Backend is what the operations need of the running relay: its pool, the
// tables with the sinks, where its slot and leader lock are, and its
// health. Attach gives it once the relay has connected.
type Backend struct {
	DB     admin.DB
	Tables admin.Tables
	Where  admin.Where
	// Health reports whether the relay is ready and why not, and why it is
	// stalled ("" when it is not); nil: nothing to report.
	Health func() Health
}

// Health is the relay's own view of itself, as /readyz and /healthz say it.
type Health struct {
	Ready    bool   `json:"ready"`
	NotReady string `json:"not_ready,omitempty"`
	Stalled  string `json:"stalled,omitempty"`
	// SinksDown says, a line per sink, why a sink is down: the relay
	// delivers to the others, and its events wait on the claim path.
	SinksDown []string `json:"sinks_down,omitempty"`
}

// Server serves the admin API and the console.
type Server struct {
	cfg     Config
	log     zerolog.Logger
	backend atomic.Pointer[Backend]
	series  series
	cache   responseCache
	// dbWork bounds the API's statements in flight, so that the console
	// never takes more than two of the pool's connections from delivery.
	dbWork chan struct{}
	feeds  atomic.Int32
}

// New returns a server for cfg. It serves nothing until Register; its
// database operations answer 503 until Attach.
func New(cfg Config) *Server {
	if cfg.Gatherer == nil {
		cfg.Gatherer = prometheus.DefaultGatherer
	}
	return &Server{cfg: cfg, log: cfg.Logger, dbWork: make(chan struct{}, 2)}
}

// Enabled reports whether the API and the console are on: an admin token
// is configured.
func (s *Server) Enabled() bool { return s.cfg.AdminToken != "" }

// Attach gives the server the running relay's backend.
func (s *Server) Attach(b Backend) { s.backend.Store(&b) }

// Register adds the API's and the console's routes to mux; without an
// admin token it adds none, and every path of theirs is a 404.
func (s *Server) Register(mux *http.ServeMux) {
	if !s.Enabled() {
		return
	}
	read, act := s.guard(false), s.guard(true)
	mux.Handle("GET /api/v1/status", read(s.handleStatus))
	mux.Handle("GET /api/v1/events", read(s.handleEvent))
	mux.Handle("GET /api/v1/events/{key...}", read(s.handleEvent))
	mux.Handle("GET /api/v1/dead-letters", read(s.handleDeadLetters))
	mux.Handle("POST /api/v1/dead-letters/retry", act(s.handleChange(admin.ActionRetry)))
	mux.Handle("POST /api/v1/dead-letters/discard", act(s.handleChange(admin.ActionDiscard)))
	mux.Handle("POST /api/v1/replay", act(s.handleChange(admin.ActionReplay)))
	mux.Handle("POST /api/v1/sinks/{name}/pause", act(s.handlePause(true)))
	mux.Handle("POST /api/v1/sinks/{name}/resume", act(s.handlePause(false)))
	mux.Handle("GET /api/v1/feed", read(s.handleFeed))
	mux.Handle("/api/", read(func(w http.ResponseWriter, r *http.Request) error {
		return errorf(http.StatusNotFound, "no such endpoint: %s %s (docs/operations.md, \"Console and admin API\", lists them)", r.Method, r.URL.Path)
	}))
	mux.Handle("GET /console/", pageHandler())
	mux.Handle("GET /console", http.RedirectHandler("/console/", http.StatusMovedPermanently))
}

// Run samples the relay's metrics every few seconds, for the flow over
// the last minutes the status shows, until ctx ends.
func (s *Server) Run(ctx context.Context) {
	t := time.NewTicker(sampleEvery)
	defer t.Stop()
	for {
		if x, err := gather(s.cfg.Gatherer, time.Now()); err == nil {
			s.series.add(x)
		} else {
			s.log.Debug().Err(err).Msg("console: read the metrics")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// access is what a request's token allows.
type access string

const (
	accessAdmin access = "admin"
	accessRead  access = "read"
)

// tokenAccess returns what the request's bearer token allows, or "". Both
// comparisons take the same time whatever the mismatch.
func (s *Server) tokenAccess(r *http.Request) access {
	scheme, got, _ := strings.Cut(r.Header.Get("Authorization"), " ")
	if !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	got = strings.TrimSpace(got)
	isAdmin := subtle.ConstantTimeCompare([]byte(got), []byte(s.cfg.AdminToken))
	isRead := subtle.ConstantTimeCompare([]byte(got), []byte(s.cfg.ReadToken)) & boolInt(s.cfg.ReadToken != "")
	switch {
	case isAdmin == 1:
		return accessAdmin
	case isRead == 1:
		return accessRead
	}
	return ""
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
