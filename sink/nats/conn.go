package nats

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// The connection, and whether the sink can publish: a server that cannot be
// reached at start leaves the sink down until it can (docs/sinks.md, "A
// server down at start").

// Checks of the stream of a sink whose server was down at start (see
// awaitStream): each is bounded by streamCheckTimeout; after a failed one
// the next waits streamRecheckMin, doubling up to streamRecheckMax.
const (
	streamCheckTimeout = 10 * time.Second
	streamRecheckMin   = time.Second
	streamRecheckMax   = 30 * time.Second
	// firstErrorWait bounds New's wait for the client to report why its
	// first attempt to connect failed, which the client does on its own
	// goroutine right after: Down and the log then say why from the start.
	firstErrorWait = time.Second
)

// up marks the sink ready, its stream checked.
func (s *Sink) up(cfg Config, maxMsgSize int64) {
	s.maxMsgSize.Store(maxMsgSize)
	s.streamErr.Store(nil)
	s.ready.Store(true)
	s.log.Info().Str("url", s.ClientURL()).Str("stream", cfg.Stream.Name).Str("subject", cfg.Subject).
		Str("deployment", cfg.Deployment.ID).Int64("msg_id_scoped_from", cfg.Deployment.ScopedFrom).
		Int64("max_payload", s.nc.MaxPayload()).Int64("max_msg_size", maxMsgSize).
		Int("max_pending", cfg.MaxPending).Msg("nats sink ready")
}

// awaitStream readies a sink whose server was down at start: once the
// client is connected it checks the stream as New does; after a failed
// check (the stream missing or of the wrong shape: every event would fail
// alike, so the sink stays down) it logs the error with its fix and checks
// again after a pause that doubles from streamRecheckMin to
// streamRecheckMax. It returns once the check passes or ctx ends (Close).
func (s *Sink) awaitStream(ctx context.Context, cfg Config, pattern string) {
	pause := streamRecheckMin
	logged := ""
	for {
		if s.nc.IsConnected() {
			checkCtx, cancel := context.WithTimeout(ctx, streamCheckTimeout)
			maxMsgSize, err := s.ensureStream(checkCtx, cfg.Stream, cfg.Stream.Create, pattern)
			cancel()
			if err == nil {
				s.up(cfg, maxMsgSize)
				return
			}
			if ctx.Err() != nil {
				return
			}
			err = fmt.Errorf("nats sink %q: %w", cfg.Name, err)
			s.streamErr.Store(&err)
			if err.Error() != logged {
				logged = err.Error()
				s.log.Error().Err(err).Dur("next_check", pause).
					Msg("nats sink is down: its stream fails the check; its events wait on the claim path until it passes")
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(pause):
			}
			pause = min(2*pause, streamRecheckMax)
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-s.connected:
		case <-time.After(streamRecheckMax):
		}
	}
}

// Down returns nil while the sink can publish: connected, its stream
// checked. Otherwise it says why not, and Sends fail as SinkDown; after
// Close it returns ErrClosed. Safe for concurrent use.
func (s *Sink) Down() error {
	select {
	case <-s.closing:
		return ErrClosed
	default:
	}
	if st := s.nc.Status(); st != nats.CONNECTED {
		if err := s.connectErr.Load(); err != nil {
			return fmt.Errorf("nats connection to %s is %s: %w", s.url, st, *err)
		}
		return fmt.Errorf("nats connection to %s is %s", s.url, st)
	}
	if s.ready.Load() {
		return nil
	}
	if err := s.streamErr.Load(); err != nil {
		return *err
	}
	return fmt.Errorf("connected to %s; the stream is being checked", s.url)
}

// connect connects the client. With retry a server that cannot be reached
// leaves the client connecting in the background (the sink is down) instead
// of failing.
func (s *Sink) connect(url string, extra []nats.Option, retry bool) error {
	opts := []nats.Option{
		nats.Name("outbox-relay"),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(500 * time.Millisecond),
		nats.RetryOnFailedConnect(retry),
		// Fail publishes while disconnected instead of buffering them:
		// Send reports SinkDown and the engine diverts the event.
		nats.ReconnectBufSize(-1),
		// A connection that went silent (a black-holed route, a dead NAT
		// entry, a peer that vanished without a RST) stays CONNECTED until
		// these notice it: a third ping without a PONG marks it stale,
		// 10-15 s after the last PONG (nats.go's defaults take up to 6 min),
		// and the client reconnects, to another cluster server if it has
		// one. Publishes awaiting acks on it then end as Unknown. See
		// docs/jetstream-cluster.md.
		nats.PingInterval(pingInterval),
		nats.MaxPingsOutstanding(maxPingsOutstanding),
		// A write that blocks (the socket's buffers full of publishes to a
		// dead peer) holds the connection's lock and so the ping timer:
		// give up on it as nats-server's write_deadline does, not after
		// nats.go's default minute.
		nats.FlusherTimeout(flusherTimeout),
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			if nc.IsClosed() {
				return // Close, not an outage
			}
			s.log.Warn().Err(err).Msg("nats disconnected; reconnecting")
		}),
		// The first connection of a client that was down at start.
		nats.ConnectHandler(func(nc *nats.Conn) {
			s.onConnect()
			s.log.Info().Str("url", redactURL(nc.ConnectedUrl())).Msg("nats connected")
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			s.onConnect()
			s.log.Info().Str("url", redactURL(nc.ConnectedUrl())).Msg("nats reconnected")
		}),
		nats.ReconnectErrHandler(s.onConnectError),
		nats.ClosedHandler(func(*nats.Conn) {
			if s.released.Load() {
				return // Close, or New failed
			}
			s.log.Error().Err(s.Down()).Msg("nats sink stopped connecting: it stays down until the relay restarts")
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			s.log.Error().Err(err).Msg("nats error")
		}),
	}
	nc, err := nats.Connect(url, append(opts, extra...)...)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", redactURL(url), err)
	}
	s.nc = nc
	return nil
}

// onConnect clears the last failure to connect and wakes awaitStream.
func (s *Sink) onConnect() {
	s.connectErr.Store(nil)
	select {
	case s.connected <- struct{}{}:
	default:
	}
}

// onConnectError records a failed attempt to connect (at start, with
// retry, or to reconnect) for Down, and logs it while the sink has never
// been up (an outage after that is logged as the disconnection). Refused
// credentials get their fix: nats.go gives up after the same refusal twice,
// so the sink stays down until a restart.
func (s *Sink) onConnectError(_ *nats.Conn, err error) {
	if credentialsRefused(err) {
		err = fmt.Errorf("%w: the server refused the sink's credentials; fix them (token, token_file, creds_file, nkey_file or the user in url) and restart the relay", err)
	}
	last := s.connectErr.Swap(&err)
	s.failOnce.Do(func() { close(s.connectFailed) })
	// New logs the first failure; an outage after the sink was up is
	// logged as the disconnection.
	if last == nil || s.ready.Load() || (*last).Error() == err.Error() {
		return
	}
	s.log.Warn().Err(err).Str("url", s.url).Msg("nats sink cannot connect; its events wait on the claim path")
}

// credentialsRefused reports whether err is a NATS server refusing the
// client's credentials (wrong, expired or revoked).
func credentialsRefused(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired)
}

// redactURL hides the credentials (user, password or token) of each URL
// in a comma-separated list, for logs and error messages.
func redactURL(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		u, err := neturl.Parse(strings.TrimSpace(p))
		switch {
		case err != nil:
			parts[i] = "<unparsable url>"
		case u.User != nil:
			u.User = neturl.User("REDACTED")
			parts[i] = u.String()
		}
	}
	return strings.Join(parts, ",")
}
