// Package admin holds the SQL behind the operator commands of outbox-relay:
// doctor's database checks, status, the lookup of one event, the
// dead-letter queue (dlq list, retry, discard), replay, and retention
// (pruning old rows).
//
// Its statements are named, in sql/*.sql (docs/architecture.md, "SQL as
// named statements"). Every name comes from the configuration and is
// rendered with relay.QualifiedName.Quoted, so no name is ever read as SQL;
// every value is a parameter. Every status
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

// Tables names the relay's tables, as configured, and its sinks.
type Tables struct {
	Outbox, Ledger, Checkpoint relay.QualifiedName
	// Sinks are the configured sinks: status reports those that were down,
	// event which take an event. Nothing reads a row's state through them:
	// that is its status (docs/schema.md, "A row's states").
	Sinks []Sink
}

// Sink is a configured sink: its name (the ledger's action), the event
// globs it takes and its filter (sinks[].filter), if any.
type Sink struct {
	Name   string
	Events []string
	Filter relay.Filter
}

// Takes reports whether the sink takes ev, by the engine's one routing rule
// (relay.Route.Takes): ev must carry what the filter reads (the payload,
// the aggregate). An event the filter fails on is taken: its pair is
// dead-lettered with the error.
func (s Sink) Takes(ev *relay.Event) bool {
	takes, _ := (&relay.Route{Events: s.Events, Filter: s.Filter}).Takes(ev)
	return takes
}

// filtered reports whether a configured sink has a filter: then a reader
// that routes rows must read their payloads (relay.Route.Takes).
func (t Tables) filtered() bool {
	for _, s := range t.Sinks {
		if s.Filter != nil {
			return true
		}
	}
	return false
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
		err := db.QueryRow(ctx, catalogSQL("TableSchema"), n.Quoted()).Scan(&schema)
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
