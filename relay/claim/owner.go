package claim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

const (
	// ownerPingEvery is how often the owner-lock connection is checked.
	ownerPingEvery = time.Second
	// pingTimeout bounds one check; a connection that does not answer is
	// taken as lost, and with it the lock.
	pingTimeout = 3 * time.Second
	// keepalive is TCP's on the dedicated connections (SPEC §5 HA): a dead
	// peer is noticed after about idle + interval × count = 11 s.
	keepaliveIdle, keepaliveInterval, keepaliveCount = 5 * time.Second, 2 * time.Second, 3
)

// ErrOwnerTaken is returned by Run when another live session holds the
// owner lock of Config.Owner (or of an id with the same hash).
var ErrOwnerTaken = errors.New("owner lock is held by another session")

// connect opens a dedicated connection (not from the pool) with TCP
// keepalives on both ends, named purpose in pg_stat_activity unless the
// configuration names it.
func (c *Claimer) connect(ctx context.Context, purpose string) (*pgx.Conn, error) {
	cc := c.cfg.Pool.Config().ConnConfig.Copy()
	if cc.RuntimeParams == nil {
		cc.RuntimeParams = map[string]string{}
	}
	if cc.RuntimeParams["application_name"] == "" {
		cc.RuntimeParams["application_name"] = "outbox-relay " + purpose
	}
	// The server's side of the keepalive: it ends the session, and frees
	// the owner lock, soon after this host disappears.
	cc.RuntimeParams["tcp_keepalives_idle"] = fmt.Sprint(keepaliveIdle.Seconds())
	cc.RuntimeParams["tcp_keepalives_interval"] = fmt.Sprint(keepaliveInterval.Seconds())
	cc.RuntimeParams["tcp_keepalives_count"] = fmt.Sprint(keepaliveCount)
	timeout := cc.ConnectTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	dialer := &net.Dialer{Timeout: timeout, KeepAliveConfig: net.KeepAliveConfig{
		Enable: true, Idle: keepaliveIdle, Interval: keepaliveInterval, Count: keepaliveCount}}
	cc.DialFunc = dialer.DialContext
	return pgx.ConnectConfig(ctx, cc)
}

// lockOwner opens the owner-lock connection and takes the owner lock on it.
func (c *Claimer) lockOwner(ctx context.Context) (*pgx.Conn, error) {
	conn, err := c.connect(ctx, "owner lock")
	if err != nil {
		return nil, fmt.Errorf("claim path: connect for the owner lock: %w", err)
	}
	// Once sent, the query runs to its answer even if ctx ends: a query cut
	// short leaves pgx closing the session in the background, holding the
	// lock if the server granted it, and a Claimer started next with this
	// owner (auto mode falling back to polling) would find it taken. With
	// the answer, Run releases a lock it got on its way out.
	lockCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pingTimeout)
	defer cancel()
	var locked bool
	if err := conn.QueryRow(lockCtx, c.sql.lockOwner, c.cfg.Owner).Scan(&locked); err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("claim path: take the owner lock of %s: %w", c.cfg.Owner, err)
	}
	if !locked {
		conn.Close(context.Background())
		return nil, fmt.Errorf("claim path: owner %s: %w", c.cfg.Owner, ErrOwnerTaken)
	}
	return conn, nil
}

// keepOwner checks the owner-lock connection every second until ctx is
// done, then unlocks and closes it. When the connection fails, claiming
// pauses (the lock went with the session, so other claimers may now return
// this owner's rows) and keepOwner reconnects and takes the lock again.
func (c *Claimer) keepOwner(ctx context.Context, conn *pgx.Conn) {
	defer func() {
		if conn == nil {
			return
		}
		closeCtx, cancel := context.WithTimeout(context.Background(), pingTimeout)
		defer cancel()
		_, _ = conn.Exec(closeCtx, c.sql.unlockOwner, c.cfg.Owner) // closing frees it anyway
		conn.Close(closeCtx)
	}()
	tick := time.NewTicker(ownerPingEvery)
	defer tick.Stop()
	failures := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if conn != nil {
			pingCtx, cancel := context.WithTimeout(ctx, pingTimeout)
			err := conn.Ping(pingCtx)
			cancel()
			if err == nil || ctx.Err() != nil {
				continue
			}
			c.ownerHeld.Store(false)
			c.log.Error().Err(err).Str("owner", c.cfg.Owner).
				Msg("lost the owner-lock connection: claiming paused; other relays may return this owner's rows")
			conn.Close(context.Background())
			conn = nil
		}
		next, err := c.lockOwner(ctx)
		if err != nil {
			failures++
			if failures == 1 || failures%30 == 0 {
				c.log.Error().Err(err).Int("attempts", failures).Msg("take the owner lock again; retrying every second")
			}
			continue
		}
		conn, failures = next, 0
		c.ownerHeld.Store(true)
		c.log.Info().Str("owner", c.cfg.Owner).Msg("owner lock taken again: claiming resumed")
		c.Kick()
	}
}

// listen LISTENs on Config.Notify on a dedicated connection and kicks the
// claim loop on every notification, until ctx is done. A failed
// connection is reopened with backoff; each (re)start kicks once, for
// notifications missed meanwhile.
func (c *Claimer) listen(ctx context.Context) {
	channel := relay.QuoteIdentifier(c.cfg.Notify)
	for attempt := 0; ; {
		conn, err := c.connect(ctx, "listen")
		if err == nil {
			if _, err = conn.Exec(ctx, "LISTEN "+channel); err == nil {
				if attempt > 0 {
					c.log.Info().Str("channel", c.cfg.Notify).Msg("listening again")
				}
				attempt = 0
				c.Kick()
				for {
					if _, err = conn.WaitForNotification(ctx); err != nil {
						break
					}
					c.Kick()
				}
			}
			closeCtx, cancel := context.WithTimeout(context.Background(), pingTimeout)
			conn.Close(closeCtx)
			cancel()
		}
		if ctx.Err() != nil {
			return
		}
		attempt++
		wait := min(retryDelay(attempt), 30*time.Second)
		c.log.Warn().Err(err).Str("channel", c.cfg.Notify).Dur("retry_in", wait).
			Msg("LISTEN connection failed; polling every poll_interval until it is back")
		if !sleep(ctx, wait) {
			return
		}
	}
}
