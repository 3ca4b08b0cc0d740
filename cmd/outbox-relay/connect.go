package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// dbTarget names the role, server and database a connection string reaches,
// never its password: "relay@db.example:5432/app". Without a connection
// string it is what libpq's defaults and the PG* variables choose.
func dbTarget(connString string) string {
	cc, err := pgconn.ParseConfig(connString)
	if err != nil {
		return "(database_url does not parse)"
	}
	database := cc.Database
	if database == "" {
		database = cc.User // the server's default
	}
	return fmt.Sprintf("%s@%s:%d/%s", cc.User, cc.Host, cc.Port, database)
}

// connectFailure is a connection that failed: where to, the server's (or
// the network's) reason, and the fix. Its Unwrap is the driver's error.
type connectFailure struct {
	target, reason, fix string
	err                 error
}

func (e *connectFailure) Error() string {
	return fmt.Sprintf("connect to the database %s: %s\n  fix: %s", e.target, e.reason, e.fix)
}

func (e *connectFailure) Unwrap() error { return e.err }

// connectError explains err, a failed connection to cfg's database: the
// server's own refusal comes first (pgx reports every attempt, and with
// sslmode=prefer against a server without TLS the first one is "server
// refused TLS connection", whatever the real reason), then the fix, as
// doctor gives it. A configuration without a database URL is named as
// such, since libpq's defaults (localhost:5432, the OS user) chose the
// server.
func connectError(cfg *config.Config, err error) error {
	f := &connectFailure{target: configuredTarget(cfg), err: err}
	f.reason, f.fix = explainConnect(err, cfg.DatabaseURL.Reveal())
	if cfg.DatabaseURL == "" {
		f.fix = "set database_url, --database-url or DATABASE_URL to the relay's database; otherwise " + f.fix
	}
	return f
}

// configuredTarget is dbTarget of cfg's database, saying so when no
// database URL is configured and libpq's defaults chose it.
func configuredTarget(cfg *config.Config) string {
	target := dbTarget(cfg.DatabaseURL.Reveal())
	if cfg.DatabaseURL == "" {
		target += " (database_url is not set, nor --database-url or DATABASE_URL: libpq's defaults and the PG* variables chose it)"
	}
	return target
}

// explainConnect returns the reason and the fix for a failed connection.
func explainConnect(err error, connString string) (reason, fix string) {
	var user, host, database string
	if cc, perr := pgconn.ParseConfig(connString); perr == nil {
		user, host, database = cc.User, cc.Host, cc.Database
	}
	const generic = "check database_url, that the server is up and that pg_hba.conf admits this role from this host (outbox-relay doctor tells more)"
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		reason = fmt.Sprintf("%s (SQLSTATE %s)", pgErr.Message, pgErr.Code)
		switch {
		case pgErr.Code == "28P01": // invalid_password
			return reason, fmt.Sprintf("check the password of role %s in database_url (or database_url_file); in a URL, percent-encode @ : / ? # in it", user)
		case pgErr.Code == "3D000": // invalid_catalog_name
			return reason, fmt.Sprintf("database %s does not exist on this server: fix the database name in database_url", database)
		case pgErr.Code == "42501": // insufficient_privilege (CONNECT)
			return reason, fmt.Sprintf("GRANT CONNECT ON DATABASE %q TO %q;", database, user)
		case pgErr.Code == "53300": // too_many_connections
			return reason, "the server has no connection slot free: close idle sessions or raise max_connections"
		case pgErr.Code == "57P03": // cannot_connect_now
			return reason, "the server is starting, stopping or recovering: try again in a moment"
		case pgErr.Code == "28000" && strings.Contains(pgErr.Message, "pg_hba.conf"):
			fix, _ := admin.RefusalFix(admin.DetectProvider(admin.ServerMarkers{Host: host}), user, host, err)
			return reason, fix
		case pgErr.Code == "28000":
			return reason, fmt.Sprintf("role %s cannot log in here: fix the user in database_url, or CREATE ROLE %q LOGIN", user, user)
		}
		return reason, generic
	}
	var dnsErr *net.DNSError
	var opErr *net.OpError
	switch {
	case errors.As(err, &dnsErr):
		return fmt.Sprintf("host %s does not resolve", dnsErr.Name), "fix the host in database_url, or this machine's DNS"
	case errors.Is(err, context.DeadlineExceeded) || errors.As(err, &opErr) && opErr.Timeout():
		return "no answer before the connect timeout", "check the host and port in database_url, and that no firewall drops the connection"
	case errors.As(err, &opErr) && strings.Contains(opErr.Err.Error(), "refused"):
		return fmt.Sprintf("connection refused: nothing listens at %s", opErr.Addr), "check that PostgreSQL runs and listens there (listen_addresses, port), and the host and port in database_url"
	}
	return err.Error(), generic
}

// requireMigrated fails with the fix when the relay's tables are not in the
// database target names: migrate has not run there (or database_url points
// at another database). The tables must be resolved (admin.Resolve).
func requireMigrated(ctx context.Context, db admin.DB, t admin.Tables, target string) error {
	var outbox, ledger, checkpoint bool
	err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL`,
		t.Outbox.Quoted(), t.Ledger.Quoted(), t.Checkpoint.Quoted()).Scan(&outbox, &ledger, &checkpoint)
	if err != nil {
		return fmt.Errorf("look for the relay's tables: %w", err)
	}
	var missing []string
	for _, m := range []struct {
		ok   bool
		name string
	}{{outbox, t.Outbox.String()}, {ledger, t.Ledger.String()}, {checkpoint, t.Checkpoint.String()}} {
		if !m.ok {
			missing = append(missing, m.name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s has no %s: run `outbox-relay migrate` there first (as the outbox table's owner), or point database_url at the relay's database",
			target, strings.Join(missing, ", "))
	}
	return migrations.CheckSchema(ctx, db, migrations.Names{Outbox: t.Outbox, Checkpoint: t.Checkpoint})
}

// newPool opens the relay's connection pool. pgxpool's default (4, or the
// CPU count) is too small for the loops that share it — settlement,
// checkpoints, the claim path, stats — and a checkpoint waiting
// for a connection stalls the stream; pool_max_conns in the URL still wins.
func newPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	if !strings.Contains(url, "pool_max_conns") {
		pcfg.MaxConns = 12
	}
	pcfg.ConnConfig.DialFunc = relay.Dial
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = relay.ConnectTimeout
	}
	// A connection idle for a second is pinged before use; one that does
	// not answer within 2 s is dropped and another used, instead of a
	// statement waiting on a dead connection for its whole timeout.
	pcfg.PingTimeout = 2 * time.Second
	// The relay's statements are short and frequent; a plan that crosses
	// jit_above_cost (a batch of thousands of ids, the start-up pass over a
	// large backlog) spends half a second compiling, on the delivery path.
	// A jit setting in the URL (options=-cjit=on, or jit=on) still wins.
	if _, set := pcfg.ConnConfig.RuntimeParams["jit"]; !set && !strings.Contains(pcfg.ConnConfig.RuntimeParams["options"], "jit") {
		pcfg.ConnConfig.RuntimeParams["jit"] = "off"
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	return pool, nil
}
