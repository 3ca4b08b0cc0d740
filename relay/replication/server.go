package replication

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/relay"
)

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	_ = conn.Close(ctx)
}

// replicationConnectError turns the refusals that configuration must fix
// into an *UnavailableError.
func replicationConnectError(err error) error {
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		switch pgErr.Code {
		case "42501": // insufficient_privilege
			return &UnavailableError{
				Reason: "the role lacks the REPLICATION privilege (ALTER ROLE <role> WITH REPLICATION)",
				Err:    err,
			}
		case "28000": // invalid_authorization_specification: pg_hba.conf
			return &UnavailableError{
				Reason: "pg_hba.conf does not allow replication connections for this role and database (add a line for database \"replication\" or the database itself, then reload)",
				Err:    err,
			}
		}
	}
	return fmt.Errorf("connect for replication: %w", err)
}

// checkServer verifies what retrying cannot fix and returns
// wal_sender_timeout (0 when disabled) and server_version_num.
func (s *Source) checkServer(ctx context.Context, conn *pgx.Conn) (time.Duration, int, error) {
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return 0, 0, fmt.Errorf("read server_version_num: %w", err)
	}
	if s.cfg.Primary != nil {
		if err := s.checkStandby(ctx, conn, version); err != nil {
			return 0, 0, err
		}
	}
	timeout, err := s.checkPublication(ctx, conn)
	if err != nil {
		return 0, 0, err
	}
	return timeout, version, nil
}

// checkPublication checks wal_level and the publication, and returns
// wal_sender_timeout.
func (s *Source) checkPublication(ctx context.Context, conn *pgx.Conn) (time.Duration, error) {
	var walLevel, senderTimeout string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return 0, fmt.Errorf("show wal_level: %w", err)
	}
	if walLevel != "logical" {
		return 0, &UnavailableError{Reason: fmt.Sprintf(
			"wal_level is %q; logical replication needs wal_level = logical (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)", walLevel)}
	}
	if err := conn.QueryRow(ctx, "SHOW wal_sender_timeout").Scan(&senderTimeout); err != nil {
		return 0, fmt.Errorf("show wal_sender_timeout: %w", err)
	}
	timeout, err := parseServerDuration(senderTimeout)
	if err != nil {
		return 0, fmt.Errorf("wal_sender_timeout: %w", err)
	}

	var pubInsert, publishesOutbox bool
	err = conn.QueryRow(ctx, `
		SELECT p.pubinsert,
		       EXISTS (SELECT 1 FROM pg_publication_tables t
		                WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)
		  FROM pg_publication p
		 WHERE p.pubname = $1`,
		s.cfg.Publication, s.outbox.Schema, s.outbox.Name).Scan(&pubInsert, &publishesOutbox)
	create := fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert'), as the table owner, or run outbox-relay migrate",
		relay.QuoteIdentifier(s.cfg.Publication), s.outbox.Quoted())
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, &UnavailableError{Reason: fmt.Sprintf("publication %q does not exist (%s)", s.cfg.Publication, create)}
	case err != nil:
		return 0, fmt.Errorf("look up publication %q: %w", s.cfg.Publication, err)
	case !publishesOutbox:
		return 0, &UnavailableError{Reason: fmt.Sprintf("publication %q does not publish table %s (ALTER PUBLICATION %s ADD TABLE %s)",
			s.cfg.Publication, s.outbox, relay.QuoteIdentifier(s.cfg.Publication), s.outbox.Quoted())}
	case !pubInsert:
		return 0, &UnavailableError{Reason: fmt.Sprintf("publication %q does not publish inserts (ALTER PUBLICATION %s SET (publish = 'insert'))",
			s.cfg.Publication, relay.QuoteIdentifier(s.cfg.Publication))}
	}
	return timeout, nil
}

// parseServerDuration parses a time setting as SHOW prints it ("1min",
// "500ms", "0"); a bare number is in milliseconds, as for
// wal_sender_timeout.
func parseServerDuration(v string) (time.Duration, error) {
	v = strings.TrimSpace(v)
	i := 0
	for i < len(v) && (v[i] >= '0' && v[i] <= '9' || v[i] == '-') {
		i++
	}
	n, err := strconv.ParseInt(v[:i], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("invalid duration %q", v)
	}
	var unit time.Duration
	switch strings.TrimSpace(v[i:]) {
	case "", "ms":
		unit = time.Millisecond
	case "us":
		unit = time.Microsecond
	case "s":
		unit = time.Second
	case "min":
		unit = time.Minute
	case "h":
		unit = time.Hour
	case "d":
		unit = 24 * time.Hour
	default:
		return 0, fmt.Errorf("invalid duration %q", v)
	}
	if n <= 0 {
		return 0, nil
	}
	return time.Duration(n) * unit, nil
}
