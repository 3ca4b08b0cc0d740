package main

import (
	"context"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// The PostgreSQL processes whose CPU the write-back phase tells apart, from
// pg_stat_activity's backend_type, application_name and datname.
const (
	pgWalsender = "walsender"      // the relay's walsender (decoding)
	pgRelay     = "relay backends" // the relay's query connections: write-back, checkpoint, locks, stats
	pgApp       = "application"    // the benchmark's load and monitor connections (application_name outbox-relay-bench…)
	pgFloor     = "floor walsender"
	pgServer    = "server" // checkpointer, walwriter, autovacuum, other databases' backends…
)

// benchAppName prefixes the application_name of every connection the
// benchmark opens, so its backends are not taken for the relay's.
const benchAppName = "outbox-relay-bench"

// classifyBackend says which group a PostgreSQL process of pg_stat_activity
// belongs to; db is the phase's database.
func classifyBackend(backendType, app, datname, db string) string {
	switch {
	case backendType == "walsender" && strings.HasPrefix(app, benchAppName):
		return pgFloor
	case strings.HasPrefix(app, benchAppName):
		return pgApp
	case backendType == "walsender" && datname == db:
		return pgWalsender
	case backendType == "client backend" && datname == db:
		return pgRelay
	}
	return pgServer
}

// backendCPU is one PostgreSQL process's CPU over a window.
type backendCPU struct {
	class      string
	start      uint64 // start time in /proc, to tell a reused pid apart
	base, last time.Duration
}

// backendSampler measures the CPU of each PostgreSQL process over a window,
// by class: it lists the processes from pg_stat_activity every half second
// and reads their CPU from /proc. A process that exits within the window
// loses what it used since the last sample; its CPU is still in the
// postgres tree's total (the postmaster reaps it), reported as unattributed.
type backendSampler struct {
	conn *pgx.Conn
	db   string

	mu    sync.Mutex
	procs map[int]*backendCPU

	cancel context.CancelFunc
	done   chan struct{}
}

// startBackendSampler takes the first sample (the base of every process
// alive now) and keeps sampling until finish. conn must not be used by
// anything else meanwhile.
func startBackendSampler(ctx context.Context, conn *pgx.Conn, db string) (*backendSampler, error) {
	s := &backendSampler{conn: conn, db: db, procs: map[int]*backendCPU{}, done: make(chan struct{})}
	if err := s.sample(ctx, true); err != nil {
		return nil, err
	}
	ctx, s.cancel = context.WithCancel(ctx)
	go func() {
		defer close(s.done)
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				_ = s.sample(ctx, false) // a missed sample only loses precision
			}
		}
	}()
	return s, nil
}

// sample reads every PostgreSQL process's CPU; first marks the window's
// start (a process seen later started within the window: base 0).
func (s *backendSampler) sample(ctx context.Context, first bool) error {
	rows, err := s.conn.Query(ctx, `SELECT pid, coalesce(backend_type, ''), coalesce(application_name, ''), coalesce(datname, '') FROM pg_stat_activity`)
	if err != nil {
		return err
	}
	type proc struct {
		pid               int
		typ, app, datname string
	}
	var list []proc
	for rows.Next() {
		var p proc
		if err := rows.Scan(&p.pid, &p.typ, &p.app, &p.datname); err != nil {
			return err
		}
		list = append(list, p)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range list {
		cpu, start, ok := readProcCPU(p.pid)
		if !ok {
			continue
		}
		b := s.procs[p.pid]
		if b == nil || b.start != start {
			b = &backendCPU{class: classifyBackend(p.typ, p.app, p.datname, s.db), start: start}
			if first {
				b.base = cpu
			}
			s.procs[p.pid] = b
		}
		b.last = cpu
	}
	return nil
}

// finish takes a last sample, stops sampling and returns each class's CPU
// over the window.
func (s *backendSampler) finish(ctx context.Context) map[string]time.Duration {
	s.cancel()
	<-s.done
	_ = s.sample(ctx, false)
	out := map[string]time.Duration{}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range s.procs {
		out[b.class] += b.last - b.base
	}
	return out
}

// readProcCPU returns a process's CPU time, from /proc/PID/schedstat
// (nanoseconds on the CPU) or else /proc/PID/stat (utime+stime in ticks),
// and its start time.
func readProcCPU(pid int) (time.Duration, uint64, bool) {
	t, ok := readProcTimes(pid)
	if !ok {
		return 0, 0, false
	}
	if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/schedstat"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			if ns, err := strconv.ParseInt(f[0], 10, 64); err == nil {
				return time.Duration(ns), t.start, true
			}
		}
	}
	return time.Duration(t.own) * time.Second / clockTicks, t.start, true
}

// Statement kinds of pg_stat_statements' entries for the relay's database.
const (
	stmtOutbox     = "outbox UPDATE"
	stmtLedger     = "ledger"
	stmtCheckpoint = "checkpoint"
	stmtReads      = "reads"
	stmtTx         = "BEGIN/COMMIT"
	stmtOther      = "other"
	stmtApp        = "application INSERT"
)

// stmtKinds is the order of the kinds in the report.
var stmtKinds = []string{stmtOutbox, stmtLedger, stmtCheckpoint, stmtReads, stmtTx, stmtOther}

// writeTarget finds the tables a statement writes: INSERT INTO t, UPDATE t,
// DELETE FROM t (with or without schema and quotes).
var writeTarget = regexp.MustCompile(`(?i)\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+((?:"[^"]+"|[\w$]+)(?:\.(?:"[^"]+"|[\w$]+))?)`)

// statementKind classifies a normalized statement by the first table it
// writes, else by its first word.
func statementKind(query string) string {
	for _, m := range writeTarget.FindAllStringSubmatch(query, -1) {
		verb := strings.ToUpper(strings.Fields(m[1])[0])
		name := m[2]
		if i := strings.LastIndexByte(name, '.'); i >= 0 {
			name = name[i+1:]
		}
		name = strings.ToLower(strings.Trim(name, `"`))
		switch name {
		case "skip", "set", "of", "nowait": // FOR UPDATE SKIP LOCKED, DO UPDATE SET, FOR UPDATE OF
			continue
		case "integration_outbox":
			if verb == "INSERT" {
				return stmtApp
			}
			return stmtOutbox
		case "integration_idempotency":
			return stmtLedger
		case "relay_checkpoint":
			return stmtCheckpoint
		}
		return stmtOther
	}
	word := strings.ToUpper(strings.Fields(query + " x")[0])
	switch word {
	case "BEGIN", "COMMIT", "ROLLBACK", "START", "END", "SAVEPOINT", "RELEASE":
		return stmtTx
	case "SELECT", "WITH", "VALUES", "TABLE":
		return stmtReads
	}
	return stmtOther
}

// stmtTotals is what pg_stat_statements counted for one kind.
type stmtTotals struct {
	calls  int64
	execMS float64 // total_exec_time: time in the executor, waits included
}

// readStatements sums pg_stat_statements' entries of database db by kind.
func readStatements(ctx context.Context, conn *pgx.Conn, db string) (map[string]stmtTotals, error) {
	rows, err := conn.Query(ctx, `SELECT s.query, s.calls, s.total_exec_time
  FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1`, db)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]stmtTotals{}
	for rows.Next() {
		var q string
		var calls int64
		var ms float64
		if err := rows.Scan(&q, &calls, &ms); err != nil {
			return nil, err
		}
		k := statementKind(q)
		t := out[k]
		t.calls += calls
		t.execMS += ms
		out[k] = t
	}
	return out, rows.Err()
}
