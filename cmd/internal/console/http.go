package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path"
	"sync"
	"time"
)

// Bounds of the API's work on the database.
const (
	// readTimeout bounds a read (status, a page of dead letters, a lookup).
	readTimeout = 10 * time.Second
	// actionTimeout bounds an action; its batches commit one by one, and
	// running it again carries on.
	actionTimeout = 5 * time.Minute
	// cacheFor is how long a read's answer is served again.
	cacheFor = time.Second
	// maxBody bounds an action's request body.
	maxBody = 1 << 20
)

// apiError is an error with the HTTP status it answers.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func errorf(status int, format string, args ...any) error {
	return &apiError{status: status, msg: fmt.Sprintf(format, args...)}
}

// handlerFunc is an API handler; an error it returns is the answer.
type handlerFunc func(w http.ResponseWriter, r *http.Request) error

type accessKey struct{}

// requestAccess returns what the request's token allows (set by guard).
func requestAccess(r *http.Request) access {
	a, _ := r.Context().Value(accessKey{}).(access)
	return a
}

// guard wraps API handlers: each needs a token, and one that acts needs
// the admin token and a request from the console's own origin. Every
// refusal of an action is logged.
func (s *Server) guard(acts bool) func(h handlerFunc) http.Handler {
	origin := http.NewCrossOriginProtection()
	return func(h handlerFunc) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Cache-Control", "no-store")
			w.Header().Set("X-Content-Type-Options", "nosniff")
			if acts {
				// The API takes its token from a header, never a cookie, so
				// another site cannot act with it; a browser's request from
				// another site is refused all the same.
				if err := origin.Check(r); err != nil {
					s.logRefused(r, "a cross-site request")
					writeError(w, errorf(http.StatusForbidden, "cross-site request refused: actions are taken only from the console's own origin (Origin %q, Sec-Fetch-Site %q)",
						r.Header.Get("Origin"), r.Header.Get("Sec-Fetch-Site")))
					return
				}
			}
			a := s.tokenAccess(r)
			switch {
			case a == "":
				if acts {
					s.logRefused(r, "no valid token")
				}
				w.Header().Set("WWW-Authenticate", `Bearer realm="outbox-relay admin"`)
				writeError(w, errorf(http.StatusUnauthorized, "unauthorized: send Authorization: Bearer <token>, the http.admin_token (or http.admin_read_token to read only)"))
				return
			case acts && a != accessAdmin:
				s.logRefused(r, "the read-only token")
				writeError(w, errorf(http.StatusForbidden, "forbidden: the read-only token (http.admin_read_token) cannot %s; actions need http.admin_token", describe(r)))
				return
			}
			r = r.WithContext(context.WithValue(r.Context(), accessKey{}, a))
			if err := h(w, r); err != nil {
				writeError(w, err)
			}
		})
	}
}

// describe names the action a request asks for, for messages and logs.
func describe(r *http.Request) string {
	switch r.URL.Path {
	case "/api/v1/dead-letters/retry":
		return "retry dead letters"
	case "/api/v1/dead-letters/discard":
		return "discard dead letters"
	case "/api/v1/replay":
		return "replay events"
	}
	if name := r.PathValue("name"); name != "" {
		return path.Base(r.URL.Path) + " sink " + name
	}
	return r.Method + " " + r.URL.Path
}

// logRefused logs an action refused before it ran.
func (s *Server) logRefused(r *http.Request, why string) {
	s.log.Warn().Str("action", describe(r)).Str("from", r.RemoteAddr).Str("forwarded_for", r.Header.Get("X-Forwarded-For")).
		Str("refused", why).Msg("admin API: action refused")
}

// writeError answers err as {"error": "..."}: an apiError with its status,
// a timeout with 504, anything else with 500 (and a log line).
func writeError(w http.ResponseWriter, err error) {
	status := http.StatusInternalServerError
	var ae *apiError
	switch {
	case errors.As(err, &ae):
		status = ae.status
	case errors.Is(err, context.DeadlineExceeded):
		status = http.StatusGatewayTimeout
	}
	writeJSON(w, status, map[string]string{"error": err.Error()})
}

// writeJSON answers v as JSON.
func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		status, body = http.StatusInternalServerError, []byte(`{"error":"encode the answer"}`)
	}
	writeBody(w, status, append(body, '\n'))
}

func writeBody(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	w.Write(body)
}

// withDB runs f with the backend on a context bounded by timeout, once one
// of the API's two database slots is free. It answers 503 until the relay
// has connected (Attach).
func (s *Server) withDB(ctx context.Context, timeout time.Duration, f func(ctx context.Context, b *Backend) error) error {
	b := s.backend.Load()
	if b == nil {
		return errorf(http.StatusServiceUnavailable, "the relay is starting: it has not connected to the database yet; try again in a moment")
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	select {
	case s.dbWork <- struct{}{}:
		defer func() { <-s.dbWork }()
	case <-ctx.Done():
		return fmt.Errorf("wait for the admin API's database slot: %w", ctx.Err())
	}
	return f(ctx, b)
}

// responseCache keeps the answers of reads for cacheFor, so that several
// consoles polling cost the database what one does. An action empties it.
type responseCache struct {
	mu      sync.Mutex
	entries map[string]cached
}

type cached struct {
	at     time.Time
	status int
	body   []byte
}

// maxCached bounds the cache: past it, it starts afresh.
const maxCached = 256

// serveCached answers r with the answer cached for its URL and access, or
// with compute's, which it caches.
func (s *Server) serveCached(w http.ResponseWriter, r *http.Request, compute func() (any, error)) error {
	key := string(requestAccess(r)) + " " + r.URL.RequestURI()
	now := time.Now()
	c := &s.cache
	c.mu.Lock()
	e, ok := c.entries[key]
	c.mu.Unlock()
	if ok && now.Sub(e.at) < cacheFor {
		writeBody(w, e.status, e.body)
		return nil
	}
	v, err := compute()
	if err != nil {
		return err
	}
	body, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode the answer: %w", err)
	}
	body = append(body, '\n')
	c.mu.Lock()
	if c.entries == nil || len(c.entries) >= maxCached {
		c.entries = map[string]cached{}
	}
	c.entries[key] = cached{at: now, status: http.StatusOK, body: body}
	c.mu.Unlock()
	writeBody(w, http.StatusOK, body)
	return nil
}

// forget empties the cache: an action has changed what the reads show.
func (c *responseCache) forget() {
	c.mu.Lock()
	c.entries = nil
	c.mu.Unlock()
}

// decodeBody reads r's JSON body into v, refusing unknown fields.
func decodeBody(r *http.Request, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, maxBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return errorf(http.StatusBadRequest, "request body: %v", err)
	}
	if dec.More() {
		return errorf(http.StatusBadRequest, "request body: one JSON object expected")
	}
	return nil
}
