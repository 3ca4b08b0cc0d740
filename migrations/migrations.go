// Package migrations holds the relay's schema as embedded SQL and applies it
// with jackc/tern, rendered for the table names in the configuration.
//
// Each outbox table has its own version record (a tern version table named
// after it), so two relays with different outbox tables can share a database.
// Migrations are idempotent and never change existing rows. DDL that needs a
// strong lock runs with a short lock_timeout and is retried, so writers queue
// behind it for at most that long; indexes on the outbox are built
// CONCURRENTLY, and an INVALID index left by a failed build is dropped and
// rebuilt.
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"strings"
	"text/template"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/tern/v2/migrate"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

//go:embed sql/*.sql
var sqlFiles embed.FS

// Names are the database objects the migrations create or adopt. Unqualified
// names resolve like any SQL name: an existing relation is found through the
// search_path, a new one is created in current_schema().
type Names struct {
	Outbox          relay.QualifiedName
	Ledger          relay.QualifiedName
	Checkpoint      relay.QualifiedName
	Conflicts       relay.QualifiedName
	PublishFunction relay.QualifiedName
	Publication     string
}

// DefaultNames returns the default names (docs/configuration.md, "outbox").
func DefaultNames() Names {
	return Names{
		Outbox:          relay.QualifiedName{Name: "integration_outbox"},
		Ledger:          relay.QualifiedName{Name: "integration_idempotency"},
		Checkpoint:      relay.QualifiedName{Name: "relay_checkpoint"},
		Conflicts:       relay.QualifiedName{Name: "integration_outbox_conflicts"},
		PublishFunction: relay.QualifiedName{Name: "outbox_publish"},
		Publication:     "outbox_relay",
	}
}

// Options configure Migrate. Zero values take the defaults in brackets.
type Options struct {
	Names Names

	// LockTimeout bounds each wait for a lock that would queue writers [1s].
	LockTimeout time.Duration

	// Timeout bounds the total time spent retrying lock timeouts [10m].
	Timeout time.Duration

	// NotifyTrigger installs the poll-mode wake-up (source.notify_trigger);
	// false removes it if an earlier run installed it.
	NotifyTrigger bool

	Logger zerolog.Logger
}

// Result says what Migrate did.
type Result struct {
	// From and To are the schema versions before and after.
	From, To int32
	// Applied names the migrations run, in order.
	Applied []string
	// Retries counts attempts that ended in a lock timeout.
	Retries int
	// PublicationCreated is true when the publication did not exist and was created.
	PublicationCreated bool
	// PublicationSkipped, when not empty, says why the publication was not
	// created and which statement the table owner must run.
	PublicationSkipped string
	// NotifyTrigger is "installed" or "removed" when this run changed it.
	NotifyTrigger string
	// Adopted is true when this run took an existing outbox table as it
	// was (migration 001 creates the table only when it is absent).
	Adopted bool
}

// ShapeError reports an existing outbox table the relay cannot use: every
// difference from the shape it needs, each with the statement that fixes
// it. Migrate never changes an existing column, so the table's owner runs
// them.
type ShapeError struct {
	Table    string
	Problems []ShapeProblem
}

// ShapeProblem is one difference of an existing outbox table from the shape
// the relay needs.
type ShapeProblem struct {
	Column string
	Reason string // "is missing", "has type text, want jsonb", …
	// Fix is the SQL that resolves it, for the table's owner to run.
	Fix string
	// Rewrites is true when Fix rewrites the table under a lock that
	// blocks its writers until it ends (ALTER COLUMN … TYPE).
	Rewrites bool
}

func (e *ShapeError) Error() string {
	var b strings.Builder
	if len(e.Problems) == 1 {
		fmt.Fprintf(&b, "table %s differs from the shape the relay needs: ", e.Table)
	} else {
		fmt.Fprintf(&b, "table %s differs from the shape the relay needs in %d ways:", e.Table, len(e.Problems))
	}
	rewrites := false
	for _, p := range e.Problems {
		if len(e.Problems) > 1 {
			b.WriteString("\n  ")
		}
		fmt.Fprintf(&b, "column %q %s", p.Column, p.Reason)
		rewrites = rewrites || p.Rewrites
	}
	b.WriteString("\nmigrate never changes an existing column: as the table's owner run\n")
	for _, p := range e.Problems {
		b.WriteString("  " + strings.ReplaceAll(p.Fix, "\n", "\n  ") + "\n")
	}
	if rewrites {
		b.WriteString("(ALTER COLUMN … TYPE rewrites the table, and its writers wait until it ends: run it at a quiet time)\n")
	}
	b.WriteString("then migrate again")
	return b.String()
}

// Migrate brings the schema for opts.Names up to date on conn. It is safe to
// repeat: a second run changes nothing. Concurrent runs serialise on tern's
// advisory lock. It returns a *ShapeError when an existing outbox table lacks
// a column the relay needs, and the last lock-timeout error when opts.Timeout
// passes while writers' locks keep DDL waiting.
func Migrate(ctx context.Context, conn *pgx.Conn, opts Options) (Result, error) {
	opts = withDefaults(opts)
	log := opts.Logger

	names, err := resolve(ctx, conn, opts.Names)
	if err != nil {
		return Result{}, err
	}
	data := templateData(names, opts.LockTimeout)

	var res Result
	deadline := time.Now().Add(opts.Timeout)
	for {
		err := migrateOnce(ctx, conn, names, data, &res, log)
		if err == nil {
			break
		}
		if !isLockTimeout(err) || time.Now().After(deadline) {
			return res, err
		}
		res.Retries++
		wait := retryDelay(res.Retries)
		log.Warn().Err(err).Int("attempt", res.Retries).Dur("retry_in", wait).
			Msg("migration waited longer than lock_timeout behind another transaction; retrying")
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(wait):
		}
	}

	if err := checkShape(ctx, conn, names.Outbox); err != nil {
		return res, err
	}
	if err := ensurePublication(ctx, conn, names, opts, &res); err != nil {
		return res, err
	}
	if err := ensureNotifyTrigger(ctx, conn, names.Outbox, opts, &res); err != nil {
		return res, err
	}
	return res, nil
}

// NotifyChannel is the channel the poll-mode wake-up trigger notifies and
// the claim path listens on.
func NotifyChannel(outbox relay.QualifiedName) string {
	return derivedName(outbox.Name, "_relay_wakeup")
}

// NotifyTriggerName is the name of the poll-mode wake-up trigger on outbox.
func NotifyTriggerName(outbox relay.QualifiedName) string {
	return derivedName(outbox.Name, "_relay_notify")
}

// notifyTrigger names the trigger and its function.
func notifyTrigger(outbox relay.QualifiedName) (trigger string, function relay.QualifiedName) {
	name := NotifyTriggerName(outbox)
	return name, outbox.Sibling(name)
}

// ensureNotifyTrigger installs or removes the statement-level wake-up
// trigger. It is FOR EACH STATEMENT with an empty payload: a per-row NOTIFY
// would make every producer's commit queue on the cluster-wide notify lock.
// CREATE/DROP TRIGGER take a lock that conflicts with inserts, so both run
// with the short lock_timeout and retry.
func ensureNotifyTrigger(ctx context.Context, conn *pgx.Conn, outbox relay.QualifiedName, opts Options, res *Result) error {
	trigger, function := notifyTrigger(outbox)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = $2)`,
		outbox.Quoted(), trigger).Scan(&exists); err != nil {
		return fmt.Errorf("look up trigger %s: %w", trigger, err)
	}
	var stmts []string
	switch {
	case opts.NotifyTrigger && !exists:
		body := fmt.Sprintf("\nBEGIN\n    PERFORM pg_notify(%s, '');\n    RETURN NULL;\nEND\n", relay.QuoteLiteral(NotifyChannel(outbox)))
		tag := "$relay$"
		for i := 1; strings.Contains(body, tag); i++ {
			tag = fmt.Sprintf("$relay%d$", i)
		}
		stmts = []string{
			fmt.Sprintf(`CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %s%s%s`, function.Quoted(), tag, body, tag),
			fmt.Sprintf(`CREATE TRIGGER %s AFTER INSERT ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s()`,
				relay.QuoteIdentifier(trigger), outbox.Quoted(), function.Quoted()),
		}
		res.NotifyTrigger = "installed"
	case !opts.NotifyTrigger && exists:
		stmts = []string{
			fmt.Sprintf(`DROP TRIGGER IF EXISTS %s ON %s`, relay.QuoteIdentifier(trigger), outbox.Quoted()),
			fmt.Sprintf(`DROP FUNCTION IF EXISTS %s()`, function.Quoted()),
		}
		res.NotifyTrigger = "removed"
	default:
		return nil
	}
	deadline := time.Now().Add(opts.Timeout)
	for attempt := 1; ; attempt++ {
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+relay.QuoteLiteral(fmt.Sprintf("%dms", opts.LockTimeout.Milliseconds()))); err != nil {
				return err
			}
			for _, stmt := range stmts {
				if _, err := tx.Exec(ctx, stmt); err != nil {
					return err
				}
			}
			return nil
		})
		if err == nil {
			opts.Logger.Info().Str("trigger", trigger).Str("channel", NotifyChannel(outbox)).Msg("notify trigger " + res.NotifyTrigger)
			return nil
		}
		if !isLockTimeout(err) || time.Now().After(deadline) {
			res.NotifyTrigger = ""
			return fmt.Errorf("notify trigger on %s: %w", outbox, err)
		}
		res.Retries++
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(retryDelay(attempt)):
		}
	}
}

func withDefaults(opts Options) Options {
	if opts.LockTimeout <= 0 {
		opts.LockTimeout = time.Second
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Minute
	}
	return opts
}

// migrateOnce runs one tern pass: the repair of INVALID indexes, then every
// migration not yet applied.
func migrateOnce(ctx context.Context, conn *pgx.Conn, names Names, data map[string]any, res *Result, log zerolog.Logger) error {
	if err := dropInvalidIndexes(ctx, conn, names.Outbox, data, log); err != nil {
		return err
	}
	m, err := migrate.NewMigrator(ctx, conn, versionTable(names.Outbox).Quoted())
	if err != nil {
		return fmt.Errorf("prepare version table: %w", err)
	}
	if err := load(m, names, data); err != nil {
		return err
	}
	from, err := m.GetCurrentVersion(ctx)
	if err != nil {
		return fmt.Errorf("read schema version: %w", err)
	}
	if res.Retries == 0 {
		res.From = from
	}
	// Migration 001 takes an existing table as it is: say so, rather than
	// "applying" it, which reads as if it created the table.
	adopting := false
	if from == 0 {
		if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", names.Outbox.Quoted()).Scan(&adopting); err != nil {
			return fmt.Errorf("look up %s: %w", names.Outbox, err)
		}
		res.Adopted = adopting
	}
	m.OnStart = func(seq int32, name, _, _ string) {
		if seq == 1 && adopting {
			log.Info().Int32("version", seq).Str("migration", name).Str("table", names.Outbox.String()).
				Msg("adopting the existing table: its rows and its own indexes stay as they are")
			return
		}
		log.Info().Int32("version", seq).Str("migration", name).Str("table", names.Outbox.String()).Msg("applying migration")
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate %s: %w", names.Outbox, err)
	}
	res.To = int32(len(m.Migrations))
	res.Applied = res.Applied[:0]
	for _, mig := range m.Migrations[res.From:res.To] {
		res.Applied = append(res.Applied, mig.Name)
	}
	return nil
}

// sqlMigrations are the migrations after 001 (a Go step), in order.
var sqlMigrations = []string{
	"002_relay_columns.sql",
	"003_relay_indexes.sql",
	"004_ledger.sql",
	"005_outbox_publish.sql",
	"006_replays.sql",
	"007_handover_record.sql",
	"008_trace_context.sql",
	"009_delivered_record.sql",
	"010_handoff_index.sql",
	"011_fold_delivered_record.sql",
	"012_event_key_bound.sql",
	"013_unsettled_index.sql",
	"014_msgid_scope.sql",
	"015_notify_state.sql",
	"016_sink_pauses.sql",
}

// Latest returns the schema version a fully migrated outbox table has: the
// number of migrations, which is what the version table holds after migrate.
func Latest() int32 { return int32(1 + len(sqlMigrations)) }

// CheckSchema returns an error saying to run migrate when the relay's
// tables are not what this build needs: the checkpoint's hand-over record
// (007), the stream's old record of delivery folded into the ledger's
// rows' status and gone (011), the order index that holds rows with a
// NULL status (013), which the claim's ordering check is planned on, and
// the message ids' scope (014). It reads only the catalogs, which every
// role may, so the run role needs no grant on the version table.
func CheckSchema(ctx context.Context, db querier, n Names) error {
	var handover, oldRecord, unsettled, scope bool
	err := db.QueryRow(ctx, `SELECT
		EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'handover_lsn' AND NOT attisdropped),
		to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL, to_regclass($4) IS NOT NULL`,
		n.Checkpoint.Quoted(), DeliveredTable(n.Outbox).Quoted(), unsettledIndex(n.Outbox).Quoted(), MsgIDScopeTable(n.Outbox).Quoted()).Scan(&handover, &oldRecord, &unsettled, &scope)
	if err != nil {
		return fmt.Errorf("inspect the relay's tables: %w", err)
	}
	if !handover || oldRecord || !unsettled || !scope {
		return fmt.Errorf("the relay's tables for %s are older than this relay (schema version %d): run outbox-relay migrate", n.Outbox, Latest())
	}
	return nil
}

// VersionTable returns the tern version table that records the schema
// version of outbox's migrations, in the outbox's schema. Pass a
// schema-qualified outbox: an unqualified one gives an unqualified name,
// resolved through the search_path.
func VersionTable(outbox relay.QualifiedName) relay.QualifiedName { return versionTable(outbox) }

// load renders the embedded SQL for these names. The outbox table itself is a
// Go step: it is created only when absent, with its indexes built plainly
// because nothing can be writing to a table that did not exist.
func load(m *migrate.Migrator, names Names, data map[string]any) error {
	render := func(file string) (string, error) {
		b, err := sqlFiles.ReadFile("sql/" + file)
		if err != nil {
			return "", err
		}
		t, err := template.New(file).Option("missingkey=error").Parse(string(b))
		if err != nil {
			return "", fmt.Errorf("parse %s: %w", file, err)
		}
		var sb strings.Builder
		if err := t.Execute(&sb, data); err != nil {
			return "", fmt.Errorf("render %s: %w", file, err)
		}
		return sb.String(), nil
	}

	createOutbox, err := render("001_outbox_table.sql")
	if err != nil {
		return err
	}
	m.Migrations = append(m.Migrations, &migrate.Migration{
		Sequence: 1,
		Name:     "001_outbox_table",
		UpFunc: func(ctx context.Context, conn *pgx.Conn) error {
			var exists bool
			if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", names.Outbox.Quoted()).Scan(&exists); err != nil {
				return fmt.Errorf("look up %s: %w", names.Outbox, err)
			}
			if exists {
				return checkShape(ctx, conn, names.Outbox)
			}
			if _, err := conn.Exec(ctx, createOutbox); err != nil {
				return fmt.Errorf("create %s: %w", names.Outbox, err)
			}
			return nil
		},
	})

	for _, file := range sqlMigrations {
		up, err := render(file)
		if err != nil {
			return err
		}
		m.AppendMigration(strings.TrimSuffix(file, ".sql"), up, "")
	}
	return nil
}

// templateData quotes every name once; templates only ever see SQL-safe text.
func templateData(n Names, lockTimeout time.Duration) map[string]any {
	// The function body is dollar-quoted; pick a tag no name contains, so a
	// hostile name cannot end the body early.
	tag := "$relay$"
	all := n.Outbox.Quoted() + n.Conflicts.Quoted() + n.PublishFunction.Quoted()
	for i := 1; strings.Contains(all, tag); i++ {
		tag = fmt.Sprintf("$relay%d$", i)
	}
	return map[string]any{
		"Outbox":                n.Outbox.Quoted(),
		"Ledger":                n.Ledger.Quoted(),
		"Checkpoint":            n.Checkpoint.Quoted(),
		"Conflicts":             n.Conflicts.Quoted(),
		"PublishFunction":       n.PublishFunction.Quoted(),
		"StatusIndex":           relay.QuoteIdentifier(derivedName(n.Outbox.Name, "_status_available_at_created_at_idx")),
		"AggregateIndex":        relay.QuoteIdentifier(derivedName(n.Outbox.Name, "_aggregate_created_at_idx")),
		"OrderIndexName":        relay.QuoteIdentifier(orderIndex(n.Outbox).Name),
		"ClaimIndexName":        relay.QuoteIdentifier(claimIndex(n.Outbox).Name),
		"ConflictsKeyIndexName": relay.QuoteIdentifier(derivedName(n.Conflicts.Name, "_event_key_idx")),
		"Delivered":             DeliveredTable(n.Outbox).Quoted(),
		"MsgIDScope":            MsgIDScopeTable(n.Outbox).Quoted(),
		"NotifyState":           NotifyStateTable(n.Outbox).Quoted(),
		"SinkPauses":            SinkPausesTable(n.Outbox).Quoted(),
		"DeadLetterIndexName":   relay.QuoteIdentifier(deadLetterIndex(n.Outbox).Name),
		"DivertedIndexName":     relay.QuoteIdentifier(divertedIndex(n.Outbox).Name),
		"UnsettledIndexName":    relay.QuoteIdentifier(unsettledIndex(n.Outbox).Name),
		"OrderIndex":            orderIndex(n.Outbox).Quoted(),
		"KeyBoundTrigger":       relay.QuoteIdentifier(keyBound(n.Outbox).Name),
		"KeyBoundFunction":      keyBound(n.Outbox).Quoted(),
		"MaxEventKeyBytes":      relay.MaxEventKeyBytes,
		"LockTimeout":           relay.QuoteLiteral(fmt.Sprintf("%dms", lockTimeout.Milliseconds())),
		"OutboxLiteral":         relay.QuoteLiteral(n.Outbox.Quoted()),
		"PublishLiteral5":       relay.QuoteLiteral(n.PublishFunction.Quoted() + "(text, text, text, text, jsonb)"),
		"PublishLiteral6":       relay.QuoteLiteral(n.PublishFunction.Quoted() + "(text, text, text, text, jsonb, jsonb)"),
		"Tag":                   tag,
	}
}

// orderIndex is 003's partial index of the unsettled rows by aggregate,
// which unsettledIndex replaces (013).
func orderIndex(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_order_idx"))
}

// unsettledIndex is the partial index that answers "is a lower id of this
// aggregate still unsettled?" for the claim path's ordering check and a
// new slot's hand-over: the rows pending (a NULL status included),
// processing or held, by aggregate.
func unsettledIndex(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_unsettled_idx"))
}

// claimIndex is the partial index that serves the claim query.
func claimIndex(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_claim_idx"))
}

// divertedIndex is the partial index of the rows diverted to the claim path.
func divertedIndex(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_handoff_idx"))
}

// keyBound names the trigger that refuses an event_key longer than the
// ledger holds, and its function (012).
func keyBound(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_key_bound"))
}

// DeliveredTable is the stream's old record of delivery for outbox (009): the
// ids of the rows the stream delivered to every routed sink, beside the
// outbox in its schema. Migration 011 folds it into the rows' status and
// drops it.
func DeliveredTable(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_delivered"))
}

// MsgIDScopeTable holds, in one row, the first id of outbox whose NATS
// message id carries the deployment's identity (014): the events before it
// keep the bare key an earlier version published them under. It is beside
// the outbox, in its schema.
func MsgIDScopeTable(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_msgid_scope"))
}

// NotifyStateTable holds the dead-letter notifier's mark per sink (015),
// beside the outbox, in its schema.
func NotifyStateTable(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_notify"))
}

// SinkPausesTable holds one row per paused sink (016), beside the outbox,
// in its schema.
func SinkPausesTable(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_pauses"))
}

// deadLetterIndex is the partial index of the failed and held rows in the
// order they were settled, which the dead-letter notifier reads (015).
func deadLetterIndex(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_dead_idx"))
}

// versionTable holds the schema version of one outbox table's migrations.
func versionTable(outbox relay.QualifiedName) relay.QualifiedName {
	return outbox.Sibling(derivedName(outbox.Name, "_relay_version"))
}

// derivedName appends suffix to base, shortening base (and adding a hash of
// it, so two long names stay distinct) to fit PostgreSQL's 63-byte limit.
func derivedName(base, suffix string) string {
	const max = 63
	if len(base)+len(suffix) <= max {
		return base + suffix
	}
	h := fnv.New32a()
	h.Write([]byte(base))
	hash := fmt.Sprintf("_%08x", h.Sum32())
	keep := max - len(suffix) - len(hash)
	for keep > 0 && !utf8.RuneStart(base[keep]) {
		keep--
	}
	return base[:keep] + hash + suffix
}

// resolve schema-qualifies every relation name: an existing relation keeps the
// schema the search_path finds it in; a new one goes to current_schema().
// Everything rendered afterwards names one schema explicitly, so the function
// body does not depend on the caller's search_path.
func resolve(ctx context.Context, conn *pgx.Conn, n Names) (Names, error) {
	var current *string
	if err := conn.QueryRow(ctx, "SELECT current_schema()").Scan(&current); err != nil {
		return n, fmt.Errorf("read current_schema: %w", err)
	}
	// Relations are found with to_regclass, the function by its signature.
	const findRelation = `SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.oid = to_regclass($1)`
	const findFunction = `SELECT n.nspname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE p.oid = to_regprocedure($1 || '(text, text, text, text, jsonb)')`
	one := func(name *relay.QualifiedName, find string) error {
		if name.Schema != "" {
			return nil
		}
		var schema string
		err := conn.QueryRow(ctx, find, name.Quoted()).Scan(&schema)
		switch {
		case err == nil:
			name.Schema = schema
		case !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("look up %s: %w", name, err)
		case current != nil:
			name.Schema = *current
		default:
			return fmt.Errorf("create %s: no schema has been selected to create in (search_path is empty); qualify the name as schema.%s", name, name.Name)
		}
		return nil
	}
	for _, p := range []*relay.QualifiedName{&n.Outbox, &n.Ledger, &n.Checkpoint, &n.Conflicts} {
		if err := one(p, findRelation); err != nil {
			return n, err
		}
	}
	if err := one(&n.PublishFunction, findFunction); err != nil {
		return n, err
	}
	return n, nil
}

// dropInvalidIndexes removes the relay's own indexes that a failed
// CREATE INDEX CONCURRENTLY left INVALID; IF NOT EXISTS would skip them.
func dropInvalidIndexes(ctx context.Context, conn *pgx.Conn, outbox relay.QualifiedName, data map[string]any, log zerolog.Logger) error {
	for _, idx := range []relay.QualifiedName{orderIndex(outbox), claimIndex(outbox), divertedIndex(outbox), unsettledIndex(outbox), deadLetterIndex(outbox)} {
		var invalid bool
		err := conn.QueryRow(ctx, `SELECT NOT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass($1)`, idx.Quoted()).Scan(&invalid)
		if errors.Is(err, pgx.ErrNoRows) || !invalid {
			continue
		}
		if err != nil {
			return fmt.Errorf("check index %s: %w", idx, err)
		}
		log.Warn().Str("index", idx.String()).Msg("dropping INVALID index left by an interrupted concurrent build; it will be rebuilt")
		if _, err := conn.Exec(ctx, "SET lock_timeout = "+data["LockTimeout"].(string)); err != nil {
			return err
		}
		if _, err := conn.Exec(ctx, "DROP INDEX CONCURRENTLY IF EXISTS "+idx.Quoted()); err != nil {
			return fmt.Errorf("drop invalid index %s: %w", idx, err)
		}
	}
	return nil
}

// querier is the part of *pgx.Conn (and pgx.Tx) the checks use.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// column is what the relay needs of one outbox column. Text columns accept
// varchar too; the rest must be exact, because the relay relies on their
// semantics (jsonb equality, timestamptz in UTC). seed is the column's
// definition in the seed shape (sql/001_outbox_table.sql), which the fix
// for a missing column adds.
type column struct {
	name  string
	types []string
	seed  string
}

var outboxColumns = []column{
	{"id", []string{"bigint", "integer"}, "bigserial PRIMARY KEY"},
	{"event_type", []string{"text", "character varying"}, "text"},
	{"aggregate_type", []string{"text", "character varying"}, "text"},
	{"aggregate_id", []string{"text", "character varying"}, "text"},
	{"event_key", []string{"text", "character varying"}, "text"},
	{"payload", []string{"jsonb"}, "jsonb"},
	{"status", []string{"text", "character varying"}, "text DEFAULT 'pending'"},
	{"attempts", []string{"integer", "bigint", "smallint"}, "int DEFAULT 0"},
	{"available_at", []string{"timestamp with time zone"}, "timestamptz DEFAULT now()"},
	{"locked_at", []string{"timestamp with time zone"}, "timestamptz"},
	{"locked_by", []string{"text", "character varying"}, "text"},
	{"last_error", []string{"text", "character varying"}, "text"},
	{"created_at", []string{"timestamp with time zone"}, "timestamptz DEFAULT now()"},
	{"processed_at", []string{"timestamp with time zone"}, "timestamptz"},
}

// sqlType is the name a fix uses for one of the catalog's type names.
func sqlType(catalog string) string {
	switch catalog {
	case "timestamp with time zone":
		return "timestamptz"
	case "integer":
		return "int"
	}
	return catalog
}

// columnFix returns the statement that gives outbox the column c needs,
// which has catalog type have ("" when the column is missing).
func columnFix(outbox relay.QualifiedName, c column, have string) string {
	alter := "ALTER TABLE " + outbox.Quoted()
	col := relay.QuoteIdentifier(c.name)
	if have == "" {
		fix := fmt.Sprintf("%s ADD COLUMN %s %s;", alter, col, c.seed)
		if c.name == "event_key" {
			fix += fmt.Sprintf("\n-- give every row its unique key, then:\n%s;", uniqueKeyIndex(outbox))
		}
		return fix
	}
	want := sqlType(c.types[0])
	using := col + "::" + want
	if have == "timestamp without time zone" {
		// The stored values have no zone: they are read as UTC.
		using = col + " AT TIME ZONE 'UTC'"
	}
	return fmt.Sprintf("%s ALTER COLUMN %s TYPE %s USING %s;", alter, col, want, using)
}

// uniqueKeyIndex is the statement that gives event_key the unique index the
// relay needs, built without blocking writers.
func uniqueKeyIndex(outbox relay.QualifiedName) string {
	return fmt.Sprintf("CREATE UNIQUE INDEX CONCURRENTLY %s ON %s (event_key)",
		relay.QuoteIdentifier(derivedName(outbox.Name, "_event_key_key")), outbox.Quoted())
}

// checkShape returns a *ShapeError listing every column the relay cannot
// use (missing, or of another type), and the missing unique index on
// event_key alone (outbox_publish's ON CONFLICT and the ledger both key on
// it), each with its fix.
func checkShape(ctx context.Context, conn querier, outbox relay.QualifiedName) error {
	rows, err := conn.Query(ctx, `
		SELECT a.attname, regexp_replace(format_type(a.atttypid, a.atttypmod), '\(.*\)', '')
		  FROM pg_attribute a
		 WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped`, outbox.Quoted())
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", outbox, err)
	}
	have := map[string]string{}
	for rows.Next() {
		var name, typ string
		if err := rows.Scan(&name, &typ); err != nil {
			return err
		}
		have[name] = typ
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read columns of %s: %w", outbox, err)
	}
	if len(have) == 0 {
		return fmt.Errorf("table %s does not exist", outbox)
	}
	shape := &ShapeError{Table: outbox.String()}
	for _, c := range outboxColumns {
		typ, ok := have[c.name]
		if !ok {
			shape.Problems = append(shape.Problems, ShapeProblem{Column: c.name, Reason: "is missing", Fix: columnFix(outbox, c, "")})
			continue
		}
		found := false
		for _, want := range c.types {
			found = found || typ == want
		}
		if !found {
			shape.Problems = append(shape.Problems, ShapeProblem{Column: c.name,
				Reason:   fmt.Sprintf("has type %s, want %s", typ, strings.Join(c.types, " or ")),
				Fix:      columnFix(outbox, c, typ),
				Rewrites: true})
		}
	}
	if _, ok := have["event_key"]; !ok {
		// The missing column's fix builds the index too.
		return shape
	}
	var unique bool
	err = conn.QueryRow(ctx, `
		SELECT EXISTS (
		  SELECT 1 FROM pg_index i
		    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
		   WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indisvalid
		     AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL
		     AND a.attname = 'event_key')`, outbox.Quoted()).Scan(&unique)
	if err != nil {
		return fmt.Errorf("check unique event_key on %s: %w", outbox, err)
	}
	if !unique {
		shape.Problems = append(shape.Problems, ShapeProblem{Column: "event_key", Reason: "has no unique index or constraint of its own",
			Fix: uniqueKeyIndex(outbox) + ";"})
	}
	if len(shape.Problems) > 0 {
		return shape
	}
	return nil
}

// ensurePublication creates the publication when it is absent. Only the
// table's owner may; any other role gets a message naming the statement to
// run, and migrate goes on. An existing publication must publish inserts of
// the table: otherwise Migrate fails with the fix, because the relay would
// stream nothing.
func ensurePublication(ctx context.Context, conn *pgx.Conn, names Names, opts Options, res *Result) error {
	create := fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert')",
		relay.QuoteIdentifier(names.Publication), names.Outbox.Quoted())

	var exists, covers, inserts bool
	err := conn.QueryRow(ctx, `
		SELECT true,
		       EXISTS (SELECT 1 FROM pg_publication_rel r WHERE r.prpubid = p.oid AND r.prrelid = to_regclass($2))
		         OR p.puballtables,
		       p.pubinsert
		  FROM pg_publication p WHERE p.pubname = $1`, names.Publication, names.Outbox.Quoted()).Scan(&exists, &covers, &inserts)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("look up publication %s: %w", names.Publication, err)
	}
	if exists {
		switch {
		case !covers:
			return fmt.Errorf("publication %s exists but does not include %s; as the table owner run: ALTER PUBLICATION %s ADD TABLE %s",
				names.Publication, names.Outbox, relay.QuoteIdentifier(names.Publication), names.Outbox.Quoted())
		case !inserts:
			return fmt.Errorf("publication %s does not publish inserts; run: ALTER PUBLICATION %s SET (publish = 'insert')",
				names.Publication, relay.QuoteIdentifier(names.Publication))
		}
		return nil
	}

	deadline := time.Now().Add(opts.Timeout)
	for attempt := 1; ; attempt++ {
		_, err = conn.Exec(ctx, "SET lock_timeout = "+relay.QuoteLiteral(fmt.Sprintf("%dms", opts.LockTimeout.Milliseconds())))
		if err == nil {
			_, err = conn.Exec(ctx, create)
		}
		// Reported in Result, which the caller prints: a log line here
		// too showed each of them twice.
		if err == nil {
			res.PublicationCreated = true
			_, err = conn.Exec(ctx, "RESET lock_timeout")
			return err
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
			res.PublicationSkipped = fmt.Sprintf("publication %s not created: %s; as the owner of %s run: %s",
				names.Publication, pgErr.Message, names.Outbox, create)
			return nil
		}
		if !isLockTimeout(err) || time.Now().After(deadline) {
			return fmt.Errorf("create publication %s: %w", names.Publication, err)
		}
		res.Retries++
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(retryDelay(attempt)):
		}
	}
}

// isLockTimeout reports an error worth retrying: a lock_timeout (55P03) or a
// deadlock victim (40P01) while waiting for writers.
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "55P03" || pgErr.Code == "40P01")
}

// retryDelay grows from 200 ms to 5 s, with jitter so that two migrators do
// not retry in step.
func retryDelay(attempt int) time.Duration {
	d := 200 * time.Millisecond << min(attempt-1, 5)
	d = min(d, 5*time.Second)
	return d + rand.N(d/4+1)
}
