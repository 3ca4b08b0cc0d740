package admin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/migrations"
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
	if err := db.QueryRow(ctx, catalogSQL("PrivilegesRole")).
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
		var (
			usage bool
			have  []bool
		)
		err := db.QueryRow(ctx, catalogSQL("PrivilegesOnTable"), g.Table.Quoted(), g.Privileges).Scan(&usage, &have)
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

// tablePrivileges is what the role may do with one table.
type tablePrivileges struct {
	table     relay.QualifiedName // schema-qualified
	need      []string
	have      map[string]bool
	schemaUse bool
	owner     string
	owns      bool // the role is, or is a member of, the owner
}

// allTablePrivileges are the privileges has_table_privilege knows besides
// MAINTAIN (17+).
var allTablePrivileges = []string{"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER"}

// NeededPrivileges returns the table privileges run needs, by table.
func NeededPrivileges(t Tables, retention bool) []TableGrant {
	outbox := []string{"SELECT", "UPDATE"}
	if retention {
		outbox = append(outbox, "DELETE")
	}
	rw := []string{"SELECT", "INSERT", "UPDATE", "DELETE"}
	// The paused sinks are read, never written, by run: the operator's
	// commands write them (docs/operations.md, "Pause and resume a sink").
	pauses := migrations.SinkPausesTable(t.Outbox)
	return []TableGrant{{t.Outbox, outbox}, {t.Ledger, rw}, {t.Checkpoint, rw}, {pauses, []string{"SELECT"}}}
}

// TableGrant is a set of privileges on one table.
type TableGrant struct {
	Table      relay.QualifiedName
	Privileges []string
}

// LeastPrivilegeRole returns the statements that create a role for run with
// exactly the rights it needs (docs/security.md, "a least-privilege role"): LOGIN and
// REPLICATION (unless the relay only polls), USAGE on the tables' schemas,
// and the table privileges of NeededPrivileges. The password is left for
// the reader to fill in.
func LeastPrivilegeRole(role string, t Tables, replication, retention bool) []string {
	attrs := "LOGIN"
	if replication {
		attrs += " REPLICATION"
	}
	q := relay.QuoteIdentifier(role)
	stmts := []string{fmt.Sprintf("CREATE ROLE %s %s PASSWORD '…';", q, attrs)}
	var schemas []string
	for _, g := range NeededPrivileges(t, retention) {
		if s := g.Table.Schema; s != "" && !slices.Contains(schemas, s) {
			schemas = append(schemas, s)
			stmts = append(stmts, fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s;", relay.QuoteIdentifier(s), q))
		}
	}
	for _, g := range NeededPrivileges(t, retention) {
		stmts = append(stmts, fmt.Sprintf("GRANT %s ON %s TO %s;", strings.Join(g.Privileges, ", "), g.Table.Quoted(), q))
	}
	return stmts
}

func (d *diagnosis) privileges(ctx context.Context) {
	role := relay.QuoteIdentifier(d.role.name)
	for _, g := range NeededPrivileges(d.tables, d.cfg.Retention) {
		if !d.exists[g.Table] {
			continue // reported by schema
		}
		p := tablePrivileges{table: g.Table, need: g.Privileges, have: map[string]bool{}}
		var vals []bool
		err := d.conn.QueryRow(ctx, catalogSQL("PrivilegesOnTableOwned"), g.Table.Quoted(), allTablePrivileges).
			Scan(&p.schemaUse, &p.owner, &p.owns, &vals)
		name := "privileges on " + g.Table.String()
		if err != nil {
			d.add(Fail, name, fmt.Sprintf("read privileges: %v", err), "")
			continue
		}
		for i, priv := range allTablePrivileges {
			p.have[priv] = vals[i]
		}
		d.privs = append(d.privs, p)

		var missing []string
		for _, priv := range g.Privileges {
			if !p.have[priv] {
				missing = append(missing, priv)
			}
		}
		var fix []string
		if !p.schemaUse {
			fix = append(fix, fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s;", relay.QuoteIdentifier(g.Table.Schema), role))
		}
		if len(missing) > 0 {
			fix = append(fix, fmt.Sprintf("GRANT %s ON %s TO %s;", strings.Join(missing, ", "), g.Table.Quoted(), role))
		}
		if len(fix) == 0 {
			d.add(OK, name, strings.Join(g.Privileges, ", "), "")
			continue
		}
		lacks := append([]string{}, missing...)
		if !p.schemaUse {
			lacks = append(lacks, "USAGE on schema "+g.Table.Schema)
		}
		why := ""
		if slices.Contains(missing, "DELETE") && g.Table == d.tables.Outbox {
			why = " (DELETE: retention.enabled prunes done rows)"
		}
		d.add(Fail, name, fmt.Sprintf("role %s lacks %s%s", d.role.name, strings.Join(lacks, ", "), why), strings.Join(fix, "\n"))
	}
}

// extraPrivileges warns about rights run has but does not need.
func (d *diagnosis) extraPrivileges() {
	r := d.role
	role := relay.QuoteIdentifier(r.name)
	var found, fix []string
	if r.super {
		found = append(found, "is a superuser (it may do anything, including dropping the outbox)")
	}
	var attrs []string
	for _, a := range []struct {
		has  bool
		name string
	}{{r.createRole, "CREATEROLE"}, {r.createDB, "CREATEDB"}, {r.bypass, "BYPASSRLS"}, {r.replication && !d.cfg.Replication, "REPLICATION"}} {
		if a.has {
			attrs = append(attrs, a.name)
		}
	}
	if len(attrs) > 0 && !r.super {
		found = append(found, "has "+strings.Join(attrs, ", "))
		fix = append(fix, fmt.Sprintf("ALTER ROLE %s WITH NO%s;", role, strings.Join(attrs, " NO")))
	}
	var owned []string
	for _, p := range d.privs {
		if p.owns {
			t := p.table.String()
			if p.owner != r.name {
				t += " (as a member of its owner " + p.owner + ")"
			}
			owned = append(owned, t)
			continue
		}
		if r.super {
			continue
		}
		var extra []string
		for _, priv := range allTablePrivileges {
			if p.have[priv] && !slices.Contains(p.need, priv) {
				extra = append(extra, priv)
			}
		}
		if len(extra) > 0 {
			found = append(found, fmt.Sprintf("has %s on %s", strings.Join(extra, ", "), p.table))
			fix = append(fix, fmt.Sprintf("REVOKE %s ON %s FROM %s;   -- or from the role or PUBLIC that grants it", strings.Join(extra, ", "), p.table.Quoted(), role))
		}
	}
	if len(owned) > 0 {
		found = append(found, fmt.Sprintf("owns %s (an owner may ALTER and DROP a table; only migrate needs that)", strings.Join(owned, ", ")))
	}
	if len(found) == 0 {
		d.add(OK, "least privilege", fmt.Sprintf("role %s has no rights beyond what run needs", r.name), "")
		return
	}
	if r.super || slices.ContainsFunc(d.privs, func(p tablePrivileges) bool { return p.owns }) {
		fix = append(fix, "-- run migrate as the table owner, and run as a role with only what it needs:")
		fix = append(fix, LeastPrivilegeRole("outbox_relay", d.tables, d.cfg.Replication, d.cfg.Retention)...)
	}
	d.add(Warn, "least privilege", fmt.Sprintf("role %s %s", r.name, strings.Join(found, "; ")), strings.Join(fix, "\n"))
}
