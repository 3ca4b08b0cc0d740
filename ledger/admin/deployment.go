package admin

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Identity is what tells one database from another among the relays that
// may publish into one NATS stream (docs/sinks.md, "Message ids").
type Identity struct {
	// SystemIdentifier is the database cluster's (pg_control_system()): a
	// promoted physical standby keeps it; a restored dump, a cluster made
	// by pg_upgrade and a new cluster get a new one.
	SystemIdentifier string
	Database         string
}

// ReadIdentity reads the identity of the database db is connected to. It
// fails naming pg_control_system() when the server does not tell its system
// identifier.
func ReadIdentity(ctx context.Context, db DB) (Identity, error) {
	var id Identity
	err := db.QueryRow(ctx, catalogSQL("Identity")).
		Scan(&id.SystemIdentifier, &id.Database)
	if err != nil {
		return id, fmt.Errorf("read the database cluster's system identifier (pg_control_system()): %w", err)
	}
	return id, nil
}

// ReadMsgIDScope returns the first id of outbox whose NATS message id
// carries the deployment, which migration 014 recorded: the events below it
// keep the bare key an earlier version published them under. Pass a
// schema-qualified outbox (Resolve). It fails naming the table and the fix
// when the row is missing.
func ReadMsgIDScope(ctx context.Context, db DB, outbox relay.QualifiedName) (int64, error) {
	scope := migrations.MsgIDScopeTable(outbox)
	var scopedFrom int64
	err := db.QueryRow(ctx, outboxSQL(outbox, "MsgIDScope")).Scan(&scopedFrom)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, fmt.Errorf("%s has no row: restore it (docs/schema.md, \"Upgrading\"): INSERT INTO %s (scoped_from) SELECT coalesce(max(id), 0) + 1 FROM %s",
			scope, scope.Quoted(), outbox.Quoted())
	case err != nil:
		return 0, fmt.Errorf("read the first outbox id whose NATS message id is scoped, from %s: %w", scope, err)
	}
	return scopedFrom, nil
}
