package admin

import (
	"embed"
	"fmt"
	"sync"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

// sqlFiles holds the package's statements, one `-- name:` each
// (docs/architecture.md, "SQL as named statements").
//
//go:embed sql/*.sql
var sqlFiles embed.FS

// sqlNames is the data the statements are rendered with: the configured
// tables and those migrations derive from the outbox's name, each quoted
// once, and the conditions package ledger and this package define once,
// rendered from an alias. Nothing else is rendered: every value is a
// parameter.
type sqlNames struct {
	Outbox, Ledger, Checkpoint string
	// Pauses, NotifyState, Versions and MsgIDScope sit beside the outbox
	// (migrations.SinkPausesTable, NotifyStateTable, VersionTable,
	// MsgIDScopeTable).
	Pauses, NotifyState, Versions, MsgIDScope string
}

func newSQLNames(t Tables) sqlNames {
	return sqlNames{
		Outbox:      t.Outbox.Quoted(),
		Ledger:      t.Ledger.Quoted(),
		Checkpoint:  t.Checkpoint.Quoted(),
		Pauses:      migrations.SinkPausesTable(t.Outbox).Quoted(),
		NotifyState: migrations.NotifyStateTable(t.Outbox).Quoted(),
		Versions:    migrations.VersionTable(t.Outbox).Quoted(),
		MsgIDScope:  migrations.MsgIDScopeTable(t.Outbox).Quoted(),
	}
}

// Pending is ledger.Pending of the row aliased o.
func (sqlNames) Pending(o string) string { return ledger.Pending(o) }

// StreamOwned is ledger.StreamOwned of the row aliased o.
func (sqlNames) StreamOwned(o string) string { return ledger.StreamOwned(o) }

// Unsettled is ledger.Unsettled of the row aliased o.
func (sqlNames) Unsettled(o string) string { return ledger.Unsettled(o) }

// StatusOf is the SQL expression of the row aliased o's status, a NULL
// status read as pending (ledger.Pending): the row's one state
// (docs/schema.md, "A row's states").
func (sqlNames) StatusOf(o string) string {
	return fmt.Sprintf("CASE WHEN %s THEN 'pending' ELSE %s.status END", ledger.Pending(o), o)
}

// WaitsForEarlier is the SQL condition "the row aliased o waits behind an
// earlier event of its aggregate": a lower id of the same aggregate that
// is unsettled (ledger.Unsettled) — the claim query's ordering check
// (docs/architecture.md, "the claim path"), which a row blocked so cannot
// pass: it is not a row the claim path could take.
func (n sqlNames) WaitsForEarlier(o string) string {
	return fmt.Sprintf(`(%[1]s.aggregate_type IS NOT NULL AND %[1]s.aggregate_id IS NOT NULL AND EXISTS (
           SELECT FROM %[2]s AS p
            WHERE p.aggregate_type = %[1]s.aggregate_type AND p.aggregate_id = %[1]s.aggregate_id AND p.id < %[1]s.id
              AND %[3]s))`, o, n.Outbox, ledger.Unsettled("p"))
}

// loaded holds the statements rendered per set of names: a process works
// on one configuration's tables, the tests on a few.
var loaded sync.Map // sqlNames → ledger.Statements

// statements returns the package's statements rendered for t's tables,
// rendering them on first use.
func statements(t Tables) ledger.Statements {
	n := newSQLNames(t)
	if s, ok := loaded.Load(n); ok {
		return s.(ledger.Statements)
	}
	s, _ := loaded.LoadOrStore(n, ledger.MustLoadStatements(sqlFiles, "sql/*.sql", n))
	return s.(ledger.Statements)
}

// sql returns the statement name rendered for t's tables.
func (t Tables) sql(name string) string { return statements(t).Get(name) }

// outboxSQL returns the statement name for the tables beside outbox (the
// ledger and checkpoint are not rendered into such a statement).
func outboxSQL(outbox relay.QualifiedName, name string) string {
	return Tables{Outbox: outbox}.sql(name)
}

// catalogSQL returns a statement that names no table of the relay: it
// reads the server's catalogs and settings.
func catalogSQL(name string) string { return Tables{}.sql(name) }
