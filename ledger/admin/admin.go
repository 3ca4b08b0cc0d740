// Package admin holds the SQL behind the operator commands of outbox-relay:
// doctor's database checks, status, the lookup of one event, the
// dead-letter queue (dlq list, retry, discard), replay, and retention
// (pruning old rows).
//
// Every name comes from the configuration and is rendered with
// relay.QualifiedName.Quoted, so no name is ever read as SQL. Every status
// change is conditional on the status the operator saw (docs/operations.md): a row that
// moved on in the meantime is left alone and not counted. Changes that touch
// the outbox and the ledger together (retry, replay) are one statement per
// batch, so each batch is atomic.
package admin

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/relay"
)

// BatchSize is the number of rows the dlq and replay commands change per
// transaction: big enough to be quick, small enough that one transaction
// never locks or logs much.
const BatchSize = 1000

// CLIApplicationName is the application_name the operator commands connect
// with. status counts sessions named "outbox-relay…" as relays, except
// these.
const CLIApplicationName = "outbox-relay-cli"

// Tables names the relay's tables, as configured, and the sinks that route
// the record of delivery.
type Tables struct {
	Outbox, Ledger, Checkpoint relay.QualifiedName
	// Sinks are the configured sinks' names and event globs. A pending row
	// not handed off that the ledger shows delivered to every sink it is
	// routed to is done, its status not marked yet (mark_done: off, or the
	// marking trails): ledger.DeliveredEverywhere. Without them (a command
	// run without the configuration) only the status column counts.
	Sinks []ledger.Sink
}

// delivered is the SQL condition "the row aliased o is done, its status not
// marked yet": pending, not handed off, and delivered everywhere by the
// ledger (docs/operations.md, "what the relay writes back").
func (t Tables) delivered(o string) string {
	cond, err := ledger.DeliveredEverywhere(t.Ledger.Quoted(), t.Sinks, o)
	if err != nil {
		// The configuration was validated with the same globs; a glob the
		// ledger cannot render leaves only the status column.
		cond = "false"
	}
	return fmt.Sprintf("(%s AND %s)", ledger.StreamOwned(o), cond)
}

// waitsForEarlier is the SQL condition "the row aliased o waits behind an
// earlier event of its aggregate": a lower id of the same aggregate that
// is unsettled (ledger.Unsettled) and not delivered everywhere — the claim
// query's ordering check (docs/architecture.md, "the claim path"), which a
// row blocked so cannot pass: it is not a row the claim path could take.
func (t Tables) waitsForEarlier(o string) string {
	cond, err := ledger.DeliveredEverywhere(t.Ledger.Quoted(), t.Sinks, "p")
	if err != nil {
		cond = "false"
	}
	return fmt.Sprintf(`(%[1]s.aggregate_type IS NOT NULL AND %[1]s.aggregate_id IS NOT NULL AND EXISTS (
           SELECT FROM %[2]s AS p
            WHERE p.aggregate_type = %[1]s.aggregate_type AND p.aggregate_id = %[1]s.aggregate_id AND p.id < %[1]s.id
              AND %[4]s AND NOT %[3]s))`, o, t.Outbox.Quoted(), cond, ledger.Unsettled("p"))
}

// status is the SQL expression of the row aliased o's status, with rows the
// ledger shows delivered everywhere counted as done, and a NULL status as
// pending (ledger.Pending).
func (t Tables) status(o string) string {
	return fmt.Sprintf("CASE WHEN %s THEN 'done' WHEN %s THEN 'pending' ELSE %s.status END", t.delivered(o), ledger.Pending(o), o)
}

// DB is what the operations need of a database handle; *pgx.Conn,
// *pgxpool.Pool and pgx.Tx have it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Resolve schema-qualifies each table that exists, the way the search_path
// finds it, so that derived names (the version table) land in the same
// schema. A table that does not exist is returned as configured.
func Resolve(ctx context.Context, db DB, t Tables) (Tables, error) {
	for _, n := range []*relay.QualifiedName{&t.Outbox, &t.Ledger, &t.Checkpoint} {
		if n.Schema != "" {
			continue
		}
		var schema string
		err := db.QueryRow(ctx, `SELECT ns.nspname FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
			WHERE c.oid = to_regclass($1)`, n.Quoted()).Scan(&schema)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return t, fmt.Errorf("look up table %s: %w", n, err)
		default:
			n.Schema = schema
		}
	}
	return t, nil
}

// Batches splits ids into slices of at most size ids.
func Batches(ids []int64, size int) [][]int64 {
	var out [][]int64
	for len(ids) > size {
		out = append(out, ids[:size:size])
		ids = ids[size:]
	}
	if len(ids) > 0 {
		out = append(out, ids)
	}
	return out
}

// lockIDs returns the classid and objid under which pg_locks shows a
// session advisory lock taken with one bigint key (objsubid 1).
func lockIDs(key int64) (classid, objid uint32) {
	k := uint64(key)
	return uint32(k >> 32), uint32(k & 0xffffffff)
}
