package webhook

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// post makes one request for d with body and, with format cloudevents, the
// attribute headers ce, and returns its classified outcome.
func (s *Sink) post(d *relay.Delivery, body []byte, ce []relay.Header) error {
	key := d.Event.EventKey
	id := IdempotencyKey(key, d.Replay)
	now := time.Now()
	target := s.url
	if s.urlTmpl != nil {
		var err error
		if target, err = s.urlTmpl.render(d.Event); err != nil {
			return relay.PermanentError(fmt.Errorf("webhook %s: event %q: %w", s.name, key, err))
		}
	}
	req, trace, err := s.newRequest(s.reqCtx, target, body)
	if err != nil {
		return err
	}
	h := req.Header
	h.Set("Webhook-Attempt", strconv.Itoa(d.Attempt))
	if headerSafe(key) {
		h.Set("Outbox-Event-Key", key)
	}
	// The producer's trace context, as stored: the same on every attempt.
	if tc := d.Event.Trace; tc.Traceparent != "" {
		h.Set("Traceparent", tc.Traceparent)
		if tc.Tracestate != "" {
			h.Set("Tracestate", tc.Tracestate)
		}
	}
	for _, a := range ce {
		h.Set(a.Name, a.Value)
	}
	if err := s.authenticate(req, id, now, body, jwt.MapClaims{"event_key": key}); err != nil {
		return err
	}
	label := fmt.Sprintf("event %q", key)
	resp, err := s.do(req, trace, label, d.Attempt, now)
	if err != nil {
		return err
	}
	defer drain(resp)
	return s.outcome(label, resp, now)
}

// newRequest builds a POST of body to target (the sink's URL) with the headers every
// request carries, and the trace that tells whether it was written. The
// request ends with parent (the sink's own requests: reqCtx, which Close
// cancels).
func (s *Sink) newRequest(parent context.Context, target string, body []byte) (*http.Request, *writeTrace, error) {
	trace := &writeTrace{}
	ctx := httptrace.WithClientTrace(parent, &httptrace.ClientTrace{
		ConnectStart: trace.connectStart,
		ConnectDone:  trace.connectDone,
		GotConn:      trace.gotConnection,
		WroteRequest: trace.wroteRequest,
	})
	// A *bytes.Reader: net/http knows it is in memory and writes the
	// headers and the body in one write (another reader type costs a
	// second write system call per request).
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(body))
	if err != nil {
		return nil, nil, relay.SinkDownError(fmt.Errorf("webhook %s: build request: %w", s.name, err), 0)
	}
	req.ContentLength = int64(len(body))
	// With GetBody nil net/http treats the POST as not replayable, despite
	// its Idempotency-Key, and never re-sends it on a reused connection
	// that closed after the write: a written request with no answer must
	// reach the engine as Unknown, not be repeated behind its back.
	req.GetBody = nil

	h := req.Header
	for name, values := range s.headers {
		h[name] = values
	}
	if h.Get("User-Agent") == "" {
		h.Set("User-Agent", userAgent)
	}
	h.Set("Content-Type", "application/json")
	return req, trace, nil
}

// authenticate sets the request's id and timestamp headers and its auth:
// the Standard Webhooks signature covers id, timestamp and the whole body;
// a JWT carries claims with iat and exp added.
func (s *Sink) authenticate(req *http.Request, id string, now time.Time, body []byte, claims jwt.MapClaims) error {
	ts := strconv.FormatInt(now.Unix(), 10)
	h := req.Header
	h.Set("Idempotency-Key", id)
	h.Set("Webhook-Id", id)
	h.Set("Webhook-Timestamp", ts)
	switch s.auth.Type {
	case AuthStandardWebhooks:
		sigs := make([]string, len(s.signKeys))
		for i, key := range s.signKeys {
			sigs[i] = sign(key, id, ts, body)
		}
		h.Set("Webhook-Signature", strings.Join(sigs, " "))
	case AuthJWT:
		claims["iat"] = now.Unix()
		claims["exp"] = now.Add(jwtLifetime).Unix()
		token, err := jwt.NewWithClaims(jwt.SigningMethodHS256, claims).SignedString([]byte(s.auth.Secret))
		if err != nil {
			return relay.SinkDownError(fmt.Errorf("webhook %s: sign JWT: %w", s.name, err), 0)
		}
		h.Set("Authorization", "Bearer "+token)
	case AuthHeader:
		h.Set(s.auth.Header, s.auth.Value)
	case AuthBasic:
		req.SetBasicAuth(s.auth.Username, s.auth.Password)
	}
	return nil
}

// do sends req and classifies a failure without an answer; label names
// what the request carries in errors and logs ("event \"k\"", "batch …").
// The caller closes the response it returns, with drain.
func (s *Sink) do(req *http.Request, trace *writeTrace, label string, attempt int, now time.Time) (*http.Response, error) {
	resp, err := s.client.Do(req)
	took := time.Since(now)
	if err != nil {
		if errors.As(err, new(*url.Error)) {
			// url.Error repeats the URL, whose query may hold a token.
			err = errors.Unwrap(err)
		}
		wrote, writeErr := trace.result()
		event := s.log.Debug().Str("request", label).Int("attempt", attempt).Dur("took", took).Err(err)
		if tlsRefused(err) {
			// The handshake failed, so no request reached the receiver,
			// even when (TLS 1.3) the client had already sent it before
			// the server refused its certificate. Every event would fail
			// alike: a sink-level failure.
			event.Msg("webhook TLS handshake failed")
			return nil, relay.SinkDownError(fmt.Errorf("webhook %s: TLS handshake failed: %w: check the sink's tls settings (ca_file, cert_file, key_file) and the receiver's certificate", s.name, err), 0)
		}
		// The client's timeout, equal to the dialer's, usually ends a
		// dial that never completes before the dialer does, so the error
		// is the client's, not the dial's: the trace tells.
		if unreachable(err) || trace.dialTimedOut(err) {
			// No connection, so nothing was sent; and the host does not
			// resolve, refuses or does not answer for every event alike:
			// a sink-level failure, which must not use up the events'
			// max_attempts while the receiver or its DNS is down.
			event.Msg("webhook receiver unreachable")
			return nil, relay.SinkDownError(fmt.Errorf("webhook %s: %s: cannot connect to the receiver: %w: check the sink's url and that the receiver is up", s.name, label, err), 0)
		}
		switch {
		case writeErr != nil:
			event.Msg("webhook request not completely written")
			return nil, relay.TransientError(fmt.Errorf("webhook %s: %s: request not completely written: %w", s.name, label, err), 0)
		case !wrote:
			// WroteRequest fires once the whole request (Content-Length
			// bytes) is written: before that the receiver cannot have a
			// complete request, so the event is safe to send again.
			event.Msg("webhook request not written")
			return nil, relay.TransientError(fmt.Errorf("webhook %s: %s: request not written: %w", s.name, label, err), 0)
		default:
			event.Bool("wrote", wrote).Msg("webhook request written, no response")
			return nil, relay.UnknownError(fmt.Errorf("webhook %s: %s: request written, no response: %w", s.name, label, err))
		}
	}
	s.log.Debug().Str("request", label).Int("attempt", attempt).Int("status", resp.StatusCode).Dur("took", took).Msg("webhook response")
	return resp, nil
}

// drain reads what is left of a response body, up to drainLimit, so its
// connection can be reused, and closes it.
func drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
	_ = resp.Body.Close()
}
