package admin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// The timeouts that bound faults that are not crashes
// (docs/operations-health.md, "Timeouts, fences and health"). The relay
// asks for its own TCP keepalives on its lock connections; the server's
// settings decide how long the sessions of a relay that vanished, or whose
// network swallows packets, keep what they hold. Each is a setting a
// session may change, so the fixes set them for the relay's role alone.

// Bounds doctor holds the settings to.
const (
	// maxWALSenderTimeout: above it, a walsender whose relay vanished
	// holds the slot (and a relay waits for a silent connection
	// mid-transaction) longer than the documented minute.
	maxWALSenderTimeout = time.Minute
	// minWALSenderTimeout: below it, the relay's own receive limit (at
	// least 10 s) is longer than the server's, and a slow network or a
	// large transaction ends healthy streams.
	minWALSenderTimeout = 10 * time.Second
	// maxKeepaliveDetection: above it, the server keeps the sessions of a
	// relay host that vanished (an unfinished transaction's row locks)
	// for too long.
	maxKeepaliveDetection = 2 * time.Minute
	// minIdleSessionTimeout: below it, idle_session_timeout ends the
	// relay's lock connections between their pings (every second, each
	// taking up to 2 s).
	minIdleSessionTimeout = 10 * time.Second
	// maxIdleInTransaction: the relay's transactions last milliseconds;
	// one left idle longer than this was left by a relay that is gone.
	maxIdleInTransaction = 10 * time.Minute
)

// readDuration reads a time setting of this session (as the relay's role
// sees it) in the unit pg_settings reports it in; missing reports a
// setting the server does not have.
func (d *diagnosis) readDuration(ctx context.Context, name string) (value time.Duration, missing bool, err error) {
	var setting int64
	var unit string
	err = d.conn.QueryRow(ctx, catalogSQL("DoctorDurationSetting"), name).Scan(&setting, &unit)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, true, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("read %s: %w", name, err)
	}
	switch unit {
	case "ms":
		return time.Duration(setting) * time.Millisecond, false, nil
	case "s":
		return time.Duration(setting) * time.Second, false, nil
	case "min":
		return time.Duration(setting) * time.Minute, false, nil
	}
	return 0, false, fmt.Errorf("read %s: unexpected unit %q", name, unit)
}

// roleSetFix is the statement that sets name for the relay's role alone.
func (d *diagnosis) roleSetFix(settings ...string) string {
	var b strings.Builder
	for i := 0; i+1 < len(settings); i += 2 {
		fmt.Fprintf(&b, "ALTER ROLE %s SET %s = '%s';\n", relay.QuoteIdentifier(d.role.name), settings[i], settings[i+1])
	}
	b.WriteString("-- applies to the relay's new sessions: restart the relay")
	return b.String()
}

// walSenderTimeout reports wal_sender_timeout: how long the server keeps a
// walsender whose relay stopped answering, and, since the relay's receive
// limit follows it, how long the relay waits for a silent replication
// connection mid-transaction.
func (d *diagnosis) walSenderTimeout(ctx context.Context) {
	if !d.cfg.Replication {
		return
	}
	const name = "wal_sender_timeout"
	timeout, missing, err := d.readDuration(ctx, name)
	switch {
	case err != nil:
		d.add(Fail, name, err.Error(), "")
		return
	case missing:
		return
	}
	fix := d.roleSetFix(name, "60s")
	switch {
	case timeout == 0:
		d.add(Warn, name, "0 (off): the server never ends a walsender whose relay vanished or whose network swallows packets, so it holds the slot until TCP gives up; "+
			"a new leader ends it, but the relay then waits up to 60 s for a silent replication connection mid-transaction", fix)
	case timeout > maxWALSenderTimeout:
		d.add(Warn, name, fmt.Sprintf("%s: a walsender whose relay vanished holds the slot that long, and the relay waits as long for a silent replication connection mid-transaction", timeout), fix)
	case timeout < minWALSenderTimeout:
		d.add(Warn, name, fmt.Sprintf("%s: shorter than the relay's own receive limit (10 s): a slow network or a large transaction ends healthy streams", timeout), d.roleSetFix(name, "30s"))
	default:
		d.add(OK, name, fmt.Sprintf("%s: the server ends a walsender whose relay stopped answering after that; the relay gives a silent replication connection up after %s mid-transaction, 6.5 s between transactions",
			timeout, max(timeout, minWALSenderTimeout)), "")
	}
}

// keepalives reads the server's TCP keepalives on this (the relay role's)
// connection and returns how long the server takes to notice that a relay
// host vanished, with a description; tcp is false on a Unix socket.
func (d *diagnosis) keepalives(ctx context.Context) (detect time.Duration, detail string, tcp bool, err error) {
	var idle, interval, count, userTimeout int64
	err = d.conn.QueryRow(ctx, catalogSQL("DoctorKeepalives")).
		Scan(&tcp, &idle, &interval, &count, &userTimeout)
	if err != nil || !tcp {
		return 0, "", tcp, err
	}
	// 0 is the operating system's default; SHOW reports the socket's own
	// values on a TCP connection, so a 0 here is unusual: take Linux's.
	if idle == 0 {
		idle = 7200
	}
	if interval == 0 {
		interval = 75
	}
	if count == 0 {
		count = 9
	}
	detect = time.Duration(idle+interval*count) * time.Second
	detail = fmt.Sprintf("idle %ds, interval %ds, count %d: the server notices a relay host that vanished after about %s", idle, interval, count, detect)
	if userTimeout > 0 {
		detail += fmt.Sprintf(" (tcp_user_timeout %s while it has data to send)", time.Duration(userTimeout)*time.Millisecond)
	}
	return detect, detail, true, nil
}

// vanishedSessions reports how long the sessions of a relay that vanished
// mid-transaction (its host gone, or its network swallowing packets) keep
// the rows they were updating: until the server's TCP keepalives notice,
// or idle_in_transaction_session_timeout ends them, whichever comes first.
// The relay's transactions last milliseconds. Either setting, for the
// relay's role, bounds it; both checks warn while neither does.
func (d *diagnosis) vanishedSessions(ctx context.Context) {
	detect, detail, tcp, err := d.keepalives(ctx)
	if err != nil {
		d.add(Fail, "tcp keepalives", fmt.Sprintf("read the keepalive settings: %v", err), "")
		return
	}
	const name = "idle_in_transaction_session_timeout"
	timeout, missing, err := d.readDuration(ctx, name)
	if err != nil {
		d.add(Fail, name, err.Error(), "")
		return
	}
	bounded := !missing && timeout > 0 && timeout <= maxIdleInTransaction
	slowKeepalives := tcp && detect > maxKeepaliveDetection
	keepaliveFix := d.roleSetFix("tcp_keepalives_idle", "5", "tcp_keepalives_interval", "2", "tcp_keepalives_count", "3")
	idleFix := d.roleSetFix(name, "1min")
	const consequence = "a relay that vanishes mid-transaction leaves its session holding the rows it was updating until then, though the relay's transactions last milliseconds " +
		"(setting either the keepalives or idle_in_transaction_session_timeout for the relay's role bounds it)"
	switch {
	case !tcp:
		d.add(Skip, "tcp keepalives", "connected over a Unix socket: keepalives do not apply", "")
	case slowKeepalives && !bounded:
		d.add(Warn, "tcp keepalives", detail+"; "+consequence+". The relay's lock connections ask for 5 s, 2 s and 3 already", keepaliveFix)
	default:
		d.add(OK, "tcp keepalives", detail, "")
	}
	shown := timeout.String()
	if timeout == 0 {
		shown = "0 (off)"
	}
	switch {
	case missing:
	case bounded:
		d.add(OK, name, shown, "")
	case slowKeepalives:
		d.add(Warn, name, shown+": "+consequence, idleFix)
	default:
		d.add(OK, name, shown+": TCP keepalives end a vanished relay's sessions soon enough", "")
	}
}

// idleSessionTimeout reports idle_session_timeout (PostgreSQL 14+), which
// would end the relay's lock connections if they idled longer than it
// between their pings.
func (d *diagnosis) idleSessionTimeout(ctx context.Context) {
	const name = "idle_session_timeout"
	timeout, missing, err := d.readDuration(ctx, name)
	switch {
	case err != nil:
		d.add(Fail, name, err.Error(), "")
	case missing:
	case timeout == 0:
		d.add(OK, name, "0 (off)", "")
	case timeout < minIdleSessionTimeout:
		d.add(Warn, name, fmt.Sprintf("%s: ends the relay's leader and owner lock connections when a ping is late (they ping every second, each ping allowed 2 s), which ends its leadership or its claims", timeout),
			d.roleSetFix(name, "0"))
	default:
		d.add(OK, name, fmt.Sprintf("%s: ends the relay's idle pool and LISTEN connections, which it opens again; it also ends the lock sessions of a relay cut off from the server after that long", timeout), "")
	}
}
