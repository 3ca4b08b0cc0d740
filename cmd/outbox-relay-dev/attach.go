package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// names are the database objects the tour's relay uses.
type names struct {
	schema                              string // the tour's own schema; "" with the defaults
	outbox, ledger, checkpoint, publish string
	slot, publication                   string
}

// defaultNames are the relay's defaults (docs/configuration.md, "outbox"),
// used in a private cluster.
func defaultNames() names {
	return names{outbox: "integration_outbox", ledger: "integration_idempotency", checkpoint: "relay_checkpoint",
		publish: "outbox_publish", slot: "outbox_relay", publication: "outbox_relay"}
}

// devSchema names everything the tour creates in a database it attaches to.
const devSchema = "outbox_relay_dev"

// devNames are the tour's names in an attached database: its own schema
// for the tables and the publish function, its own publication and slot.
// None is a default the user's relay uses.
func devNames() names {
	q := func(name string) string { return devSchema + "." + name }
	return names{schema: devSchema, outbox: q("integration_outbox"), ledger: q("integration_idempotency"), checkpoint: q("relay_checkpoint"),
		publish: q("outbox_publish"), slot: devSchema, publication: devSchema}
}

// publishQuoted is the publish function as an SQL name.
func (n names) publishQuoted() string {
	return pgx.Identifier(strings.Split(n.publish, ".")).Sanitize()
}

// target names the role, server and database of url, never its password.
func target(url string) string {
	cc, err := pgconn.ParseConfig(url)
	if err != nil {
		return "(DATABASE_URL does not parse)"
	}
	database := cc.Database
	if database == "" {
		database = cc.User // the server's default
	}
	return fmt.Sprintf("%s@%s:%d/%s", cc.User, cc.Host, cc.Port, database)
}

// attached is a user's database the tour runs in, under names of its own.
type attached struct {
	url string
	n   names
	say sayer
	// streams is whether the relay can stream there (wal_level logical, a
	// role with REPLICATION); otherwise it polls.
	streams bool
}

// attach checks that the tour can run in the database at url without
// touching the user's events, says what it will create and what it leaves
// alone, then creates its schema. It refuses, creating nothing, when the
// role may not create a schema or another tour holds the slot. It says
// what the relay will do instead of streaming when wal_level or the role
// does not allow it.
func attach(ctx context.Context, url string, n names, say sayer) (*attached, error) {
	say("DATABASE_URL is set: attaching to %s (the password is not shown)", target(url))
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", target(url), err)
	}
	defer conn.Close(context.Background())

	var (
		role, database, walLevel       string
		replication, canCreate, exists bool
		ownsSchema                     bool
		slotActive                     bool
		slotPID                        *int32
	)
	err = conn.QueryRow(ctx, `SELECT current_user, current_database(), current_setting('wal_level'),
		(SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
		has_database_privilege(current_database(), 'CREATE'),
		EXISTS (SELECT FROM pg_namespace WHERE nspname = $1),
		EXISTS (SELECT FROM pg_namespace WHERE nspname = $1 AND pg_has_role(nspowner, 'USAGE')),
		coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = $2), false),
		(SELECT active_pid FROM pg_replication_slots WHERE slot_name = $2)`, n.schema, n.slot).
		Scan(&role, &database, &walLevel, &replication, &canCreate, &exists, &ownsSchema, &slotActive, &slotPID)
	if err != nil {
		return nil, fmt.Errorf("read what the role %s may do: %w", target(url), err)
	}

	say("make run leaves your events alone: it never reads or writes your outbox (integration_outbox), its ledger, or the slot outbox_relay")
	say("it creates these, and removes them when it stops:")
	say("    schema       %-18s its own outbox table, ledger, checkpoint and outbox_publish", n.schema)
	say("    publication  %-18s for its outbox table only", n.publication)
	say("    slot         %-18s logical replication; dropped on exit, so it never retains WAL", n.slot)
	say("if make run is killed before it removes them: %s", removeSQL(n))

	switch {
	case slotActive:
		pid := "?"
		if slotPID != nil {
			pid = fmt.Sprint(*slotPID)
		}
		return nil, fmt.Errorf("the slot %s is in use (walsender pid %s): another make run is attached to this database; stop it first", n.slot, pid)
	case exists && !ownsSchema:
		return nil, fmt.Errorf("a schema %s exists in %s and role %s does not own it: make run uses that name for its own objects and will not touch it", n.schema, database, role)
	case !exists && !canCreate:
		return nil, fmt.Errorf("role %s may not create the schema %s in database %s, so make run created nothing and stops: it never uses your own tables. "+
			"Grant it for the try-out (GRANT CREATE ON DATABASE %s TO %s;), use a role that may, or unset DATABASE_URL to run against a private PostgreSQL",
			role, n.schema, database, pgx.Identifier{database}.Sanitize(), pgx.Identifier{role}.Sanitize())
	}

	a := &attached{url: url, n: n, say: say, streams: true}
	if walLevel != "logical" {
		a.streams = false
		say("wal_level is %s on this server: the relay cannot stream, so it polls its outbox every second instead (what follows is the claim path)", walLevel)
		say("    to see the stream: ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL")
	}
	if !replication {
		a.streams = false
		say("role %s has no REPLICATION attribute: the relay cannot stream, so it polls its outbox every second instead", role)
		say("    to see the stream: ALTER ROLE %s REPLICATION;", pgx.Identifier{role}.Sanitize())
	}
	if _, err := conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{n.schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create schema %s: %w", n.schema, err)
	}
	if exists {
		say("schema %s was there already (a make run that was stopped hard?): using it", n.schema)
	} else {
		say("created schema %s", n.schema)
	}
	return a, nil
}

// removeSQL is the SQL that removes what the tour creates in n.
func removeSQL(n names) string {
	return fmt.Sprintf("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '%s'; DROP PUBLICATION IF EXISTS %s; DROP SCHEMA IF EXISTS %s CASCADE;",
		n.slot, pgx.Identifier{n.publication}.Sanitize(), pgx.Identifier{n.schema}.Sanitize())
}

// remove drops the slot (once its walsender has gone), the publication and
// the schema with everything in it. The relay must have stopped. It is safe
// to repeat.
func (a *attached) remove(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, a.url)
	if err != nil {
		return fmt.Errorf("remove the tour's objects (%s): connect: %w", removeSQL(a.n), err)
	}
	defer conn.Close(context.Background())
	// The relay has stopped; its walsender may take a moment to go.
	for active := true; active; {
		err := conn.QueryRow(ctx, `SELECT coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = $1), false)`, a.n.slot).Scan(&active)
		if err != nil {
			break
		}
		if active {
			select {
			case <-ctx.Done():
				active = false
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	var errs []error
	for _, sql := range []string{
		`SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '` + a.n.slot + `'`,
		"DROP PUBLICATION IF EXISTS " + pgx.Identifier{a.n.publication}.Sanitize(),
		"DROP SCHEMA IF EXISTS " + pgx.Identifier{a.n.schema}.Sanitize() + " CASCADE",
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", sql, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("remove the tour's objects: %w", err)
	}
	a.say("removed the slot %s, the publication %s and the schema %s", a.n.slot, a.n.publication, a.n.schema)
	return nil
}
