package admin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// PrivilegeError says what the role run connects as lacks, and the
// statements that grant it.
type PrivilegeError struct {
	Role string
	// Lacks lists what is missing: "SELECT on public.integration_outbox",
	// "USAGE on schema public", "the REPLICATION attribute".
	Lacks []string
	// Fix holds one statement per line.
	Fix []string
}

func (e *PrivilegeError) Error() string {
	return fmt.Sprintf("role %s lacks %s, which run needs; fix: %s (outbox-relay doctor checks everything run needs)",
		e.Role, strings.Join(e.Lacks, ", "), strings.Join(e.Fix, " "))
}

// CheckRunPrivileges checks that the role db connects as has what the
// delivery paths of run need — USAGE on each table's schema and the table
// privileges of NeededPrivileges without retention — and, with replication,
// the REPLICATION attribute. It returns a *PrivilegeError naming every
// missing privilege with its GRANT, or an error when it cannot tell. The
// tables must exist and be schema-qualified (Resolve). It only reads. A
// missing DELETE for retention is not checked: pruning reports it itself,
// and doctor lists it.
func CheckRunPrivileges(ctx context.Context, db DB, t Tables, replication bool) error {
	var role string
	var super, repl bool
	if err := db.QueryRow(ctx, `SELECT rolname, rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user`).
		Scan(&role, &super, &repl); err != nil {
		return fmt.Errorf("read the role's attributes: %w", err)
	}
	if super {
		return nil
	}
	q := relay.QuoteIdentifier(role)
	perr := &PrivilegeError{Role: role}
	if replication && !repl {
		perr.Lacks = append(perr.Lacks, "the REPLICATION attribute (for the replication connection)")
		perr.Fix = append(perr.Fix, fmt.Sprintf("ALTER ROLE %s WITH REPLICATION;", q))
	}
	var schemas []string
	for _, g := range NeededPrivileges(t, false) {
		var usage bool
		have := make([]bool, len(g.Privileges))
		dest := []any{&usage}
		cols := make([]string, len(g.Privileges))
		for i, p := range g.Privileges {
			cols[i] = fmt.Sprintf("has_table_privilege(c.oid, '%s')", p)
			dest = append(dest, &have[i])
		}
		err := db.QueryRow(ctx, `SELECT has_schema_privilege(c.relnamespace, 'USAGE'), `+strings.Join(cols, ", ")+`
			FROM pg_class c WHERE c.oid = to_regclass($1)`, g.Table.Quoted()).Scan(dest...)
		if errors.Is(err, pgx.ErrNoRows) {
			continue // no such table: run reports it (migrate first)
		}
		if err != nil {
			return fmt.Errorf("read the privileges on %s: %w", g.Table, err)
		}
		if !usage && !slices.Contains(schemas, g.Table.Schema) {
			schemas = append(schemas, g.Table.Schema)
			perr.Lacks = append(perr.Lacks, "USAGE on schema "+g.Table.Schema)
			perr.Fix = append(perr.Fix, fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s;", relay.QuoteIdentifier(g.Table.Schema), q))
		}
		var missing []string
		for i, p := range g.Privileges {
			if !have[i] {
				missing = append(missing, p)
			}
		}
		if len(missing) > 0 {
			perr.Lacks = append(perr.Lacks, strings.Join(missing, ", ")+" on "+g.Table.String())
			perr.Fix = append(perr.Fix, fmt.Sprintf("GRANT %s ON %s TO %s;", strings.Join(missing, ", "), g.Table.Quoted(), q))
		}
	}
	if len(perr.Lacks) > 0 {
		return perr
	}
	return nil
}
