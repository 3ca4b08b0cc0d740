// Package ledger holds every statement the relay runs on its tables
// (docs/schema.md): the idempotency ledger and the outbox rows' status as
// both paths settle them (stream.go, claim.go), a new slot's hand-over
// (handover.go), the slot's checkpoint (checkpoint.go), leadership
// (leader.go), the scans for stuck rows (scan.go) and upkeep (upkeep.go).
// Package ledger/admin holds the operator's statements (status, dlq,
// replay, verify).
//
// Every write is conditional on the row still being where the writer expects
// it (the stream's: StreamOwned; the claim's: processing and locked by the
// writer; the ledger's state), so every method
// is safe to call again after an error or a crash. Batches go to the server
// as arrays (unnest, = ANY): one statement per kind, never one round trip per
// event.
package ledger

import (
	"context"
	"fmt"
	"iter"
	"slices"
	"sync/atomic"

	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/relay"
)

var (
	_ relay.StreamStore = (*Store)(nil)
	_ relay.ClaimStore  = (*Store)(nil)
	_ relay.Checkpoint  = (*Store)(nil)
)

// maxIDsPerQuery bounds the arrays sent in one statement, so that a huge
// transaction re-streamed after a restart does not become one giant query.
const maxIDsPerQuery = 10_000

// Config names the tables and chooses the commit mode of the stream's writes.
type Config struct {
	// Outbox, Ledger and Checkpoint are the tables migrate created or
	// adopted. A name left empty takes its default (docs/configuration.md)
	// (integration_outbox, integration_idempotency, relay_checkpoint).
	Outbox, Ledger, Checkpoint relay.QualifiedName

	// AsyncCommit makes Settle commit with synchronous_commit = off. That is
	// safe because the relay acknowledges the slot only after a synchronous
	// checkpoint write, which flushes the WAL of every earlier commit; a
	// crash in between loses only settlements the slot will stream again.
	// DefaultConfig sets it.
	AsyncCommit bool

	// Unordered drops the ordering check (ordering: none).
	Unordered bool
	// MaxInFlightBytes is the engine's byte budget
	// (delivery.max_inflight_bytes) [relay.DefaultMaxInFlightBytes]: a
	// hand-over reads its rows in slices of relay.ReadBytes of it.
	MaxInFlightBytes int64
}

// DefaultConfig returns the default table names with AsyncCommit on.
func DefaultConfig() Config {
	n := migrations.DefaultNames()
	return Config{Outbox: n.Outbox, Ledger: n.Ledger, Checkpoint: n.Checkpoint, AsyncCommit: true}
}

// Store implements relay.Store and relay.Checkpoint over a connection pool,
// plus the slot-creation hand-over and the pre-send claims of sinks with
// on_unknown: hold. It is safe for concurrent use.
type Store struct {
	pool        *pgxpool.Pool
	asyncCommit bool
	sql         statements
	outbox      string // quoted, for the few statements built elsewhere
	origin      originState
	// decodingStandbySlot is the physical slot the standby the stream
	// decodes on streams through (SetDecodingStandby).
	decodingStandbySlot atomic.Pointer[string]
	scan                scanState
	// handingOver counts the slot hand-overs between OpenHandOver and
	// Close: the pending scan waits for them (scan.go).
	handingOver atomic.Int32
	tables      tables
	// readBytes is the most payload bytes one slice of a hand-over reads
	// (relay.ReadBytes).
	readBytes int64

	// claimCursor is where the claim's second window starts (Claim): a
	// hint, never a fact.
	claimCursor claimCursor
	// claimBacklog: the last claim's first window was full (Claim).
	claimBacklog atomic.Bool
}

// statements is every SQL text the Store runs, read from sql/*.sql and
// rendered once with the configured names quoted as identifiers (render).
type statements struct {
	stream streamStatements
	claim  claimStatements

	scanStart, scanTop, scanRange, scanRecheck string
	statsDiverted, statsStatuses               string

	loadCheckpoint string
	saveCheckpoint string

	handedOver           string
	beginSlot            string
	handoverDone         string
	snapshotPending      string
	snapshotPendingAmong string
	snapshotEarly        string
	maxID                string
	divertByID           string
	handOverRead         string
	payloadSizes         string
	setAsyncCommit       string
	setSynchronousCommit string
	setPlanning          string
	setClaim             string
}

// planTx turns sequential scans off for the rest of a transaction. Every
// statement the relay runs in one touches the rows of a batch, by key;
// on tables grown since their last ANALYZE, or with a plan cached while
// they were small, the planner chose to scan the whole outbox or ledger
// for them (docs/performance.md, "Plans that do not depend on
// statistics"). It is the planner's cost, not a ban: a statement with no
// index to use still scans. A turned-off plan type is a cost added to the
// plan's estimate, which can then pass jit_above_cost and have every
// execution compiled (1.5 s a claim with sorts off, planClaimTx), so JIT is
// off too, whatever the database URL says (the relay's pool turns it off
// unless the URL turns it on): the relay's statements touch a batch's rows,
// never enough for compiled expressions to pay.
const planTx = `set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)`

// planClaimTx also turns sorts off for a claim's transaction: its window
// (the due rows after its cursor, oldest or newest first) is read in the
// order of a partial index that holds only claimable rows (the diversion
// index, or the claim index in poll mode), where a scan stops after the
// window's rows. Before the table's first ANALYZE (where a relay attached
// to a freshly written backlog starts) the planner chose the seed's status
// index instead and sorted what it read: every pending row, the stream's
// too (docs/performance.md, "The claim's window"). The
// claim's other sorts (its aggregates' ranks and runs) have no unsorted
// alternative and are planned as before.
const planClaimTx = planTx + `, set_config('enable_sort', 'off', true), set_config('enable_incremental_sort', 'off', true)`

// Every transaction inTx runs (settlements, claims, ledger claims,
// checkpoints) starts with one of these statements. Each also turns
// sequential scans and JIT off for the transaction (planTx): its
// statements find their rows by key. The hand-over's own transactions (a
// whole-table pass) do not.
const (
	setAsyncCommit = `SELECT set_config('synchronous_commit', 'off', true), ` + planTx
	// Explicitly synchronous even where the role or database default is
	// off; a stricter server setting (remote_apply) is kept.
	setSynchronousCommit = `SELECT ` + planTx + `,
       CASE WHEN current_setting('synchronous_commit') <> 'remote_apply'
            THEN set_config('synchronous_commit', 'on', true) END`
	setPlanning = `SELECT ` + planTx
	// A claim commits without waiting for its WAL (Claim).
	setClaim = `SELECT set_config('synchronous_commit', 'off', true), ` + planClaimTx
)

// New returns a Store on pool. Empty names in cfg take the defaults; the
// names are quoted here, once, so no name is ever read as SQL.
func New(pool *pgxpool.Pool, cfg Config) (*Store, error) {
	def := DefaultConfig()
	if cfg.Outbox.Name == "" {
		cfg.Outbox = def.Outbox
	}
	if cfg.Ledger.Name == "" {
		cfg.Ledger = def.Ledger
	}
	if cfg.Checkpoint.Name == "" {
		cfg.Checkpoint = def.Checkpoint
	}
	t := tables{outbox: cfg.Outbox.Quoted(), ledger: cfg.Ledger.Quoted(), checkpoint: cfg.Checkpoint.Quoted()}
	if cfg.MaxInFlightBytes <= 0 {
		cfg.MaxInFlightBytes = relay.DefaultMaxInFlightBytes
	}
	return &Store{
		outbox:      cfg.Outbox.Quoted(),
		pool:        pool,
		asyncCommit: cfg.AsyncCommit,
		sql:         render(t, claimOptions{unordered: cfg.Unordered}),
		tables:      t,
		readBytes:   relay.ReadBytes(cfg.MaxInFlightBytes),
	}, nil
}

// tables are the relay's tables, quoted.
type tables struct {
	outbox, ledger, checkpoint string
}

// inTx runs, in one transaction, the statement that sets the commit mode
// (setCommit; empty keeps the server's default) and then the statements queue
// adds, all sent as one batch: one round trip besides BEGIN and COMMIT. results reads their results in order; the
// transaction commits only when every statement succeeded.
func (s *Store) inTx(ctx context.Context, setCommit string, queue func(*pgx.Batch), results func(pgx.BatchResults) error) error {
	b := &pgx.Batch{}
	if setCommit == "" {
		setCommit = s.sql.setPlanning
	}
	b.Queue(setCommit)
	queue(b)
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		br := tx.SendBatch(ctx, b)
		err := func() error {
			if _, err := br.Exec(); err != nil {
				return fmt.Errorf("set synchronous_commit and enable_seqscan: %w", err)
			}
			return results(br)
		}()
		if closeErr := br.Close(); err == nil {
			err = closeErr
		}
		return err
	})
}

// chunks splits ids into slices of at most maxIDsPerQuery.
func chunks(ids []int64) iter.Seq[[]int64] { return slices.Chunk(ids, maxIDsPerQuery) }

// querier is what reads need: a pool, a connection or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// step is one statement of a settlement transaction.
type step struct {
	kind string // for errors: "divert 3 rows"
	sql  string
	args []any
	// ids: the statement returns ids of rows it could not see.
	ids bool
	// check, when set, reads the statement's one row; an error rolls the
	// transaction back.
	check func(pgx.Row) error
}

func exec(kind, sql string, args ...any) step { return step{kind: kind, sql: sql, args: args} }
func ids(kind, sql string, args ...any) step {
	return step{kind: kind, sql: sql, args: args, ids: true}
}

// runSteps runs steps in one transaction and one round trip (besides BEGIN
// and COMMIT), after the statement that sets the commit mode (setCommit;
// empty keeps the server's default), and returns the ids the id-returning
// steps report. The transaction commits only when every step succeeded;
// an error names the failing step and, when a row's data was refused
// (rowDataStates), wraps relay.ErrRowData.
func (s *Store) runSteps(ctx context.Context, setCommit string, steps []step) ([]int64, error) {
	var out []int64
	err := s.inTx(ctx, setCommit, func(b *pgx.Batch) {
		for _, st := range steps {
			b.Queue(st.sql, st.args...)
		}
	}, func(br pgx.BatchResults) error {
		for _, st := range steps {
			if st.check != nil {
				if err := st.check(br.QueryRow()); err != nil {
					return fmt.Errorf("%s: %w", st.kind, err)
				}
				continue
			}
			if !st.ids {
				if _, err := br.Exec(); err != nil {
					return fmt.Errorf("%s: %w", st.kind, err)
				}
				continue
			}
			rows, err := br.Query()
			if err != nil {
				return fmt.Errorf("%s: %w", st.kind, err)
			}
			got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				return fmt.Errorf("%s: %w", st.kind, err)
			}
			out = append(out, got...)
		}
		return nil
	})
	if err != nil {
		return nil, rowDataError(err)
	}
	return out, nil
}

// hasSQLState reports whether PostgreSQL refused with SQLSTATE code.
func hasSQLState(err error, code string) bool {
	pgErr, ok := errors.AsType[*pgconn.PgError](err)
	return ok && pgErr.Code == code
}

// rowDataStates are the SQLSTATEs (a class of two characters, or one code)
// PostgreSQL raises because of one row's data: the same statement with
// that row left out succeeds, and with it succeeds never. The engine
// isolates such a row and writes it as a dead letter (relay.ErrRowData).
// Every other error is the server's or the connection's (08 connection,
// 40 serialization and deadlock, 53 disk full or out of memory, 55 lock
// not available, 57 shutdown or cancel, 42 a missing grant, XX an
// internal error): retried as it is, the rows beside it waiting.
var rowDataStates = []string{
	// data_exception: a value the column refuses (invalid UTF-8 or a NUL,
	// too long for a varchar, out of range).
	"22",
	// integrity_constraint_violation: a row a constraint refuses (the
	// table's own CHECK or NOT NULL, a key another row holds).
	"23",
	// program_limit_exceeded: an index entry or a row larger than a page
	// holds — the ledger's key longer than its btree takes (docs/schema.md,
	// "Key lengths"). The same code for an array too large is the batch's,
	// and the halves the engine then writes apart are small enough. The
	// rest of class 54 (too many columns or arguments, a statement too
	// complex) is the statement's, never a row's.
	"54000",
}

// rowDataError marks err with relay.ErrRowData when PostgreSQL refused a
// row's data (rowDataStates), as opposed to a connection or server
// failure.
func rowDataError(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	for _, state := range rowDataStates {
		if strings.HasPrefix(pgErr.Code, state) {
			return fmt.Errorf("%w: %w", relay.ErrRowData, err)
		}
	}
	return err
}
