package main

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// The relay's tables under their default names (what `outbox-relay migrate`
// creates in the benchmark's databases), with the group their WAL goes to.
var relayTables = []struct {
	name  string
	group relGroup
}{
	{"integration_outbox", relOutbox},
	{"integration_idempotency", relLedger},
	{"relay_checkpoint", relCheckpoint},
	{"integration_outbox_conflicts", relConflicts},
}

// relayRelations maps the relfilenodes of the relay's tables, their
// indexes, TOAST tables and TOAST indexes to their group, and returns the
// database's oid (pg_waldump names relations tablespace/database/relfilenode).
func relayRelations(ctx context.Context, conn *pgx.Conn) (uint32, map[uint32]relGroup, error) {
	var dbOID uint32
	if err := conn.QueryRow(ctx, `SELECT oid FROM pg_database WHERE datname = current_database()`).Scan(&dbOID); err != nil {
		return 0, nil, err
	}
	rels := map[uint32]relGroup{}
	for _, t := range relayTables {
		rows, err := conn.Query(ctx, `WITH t AS (SELECT oid, reltoastrelid FROM pg_class WHERE oid = to_regclass($1))
SELECT pg_relation_filenode(r.oid) FROM (
  SELECT oid FROM t
  UNION ALL SELECT i.indexrelid FROM pg_index i, t WHERE i.indrelid = t.oid
  UNION ALL SELECT reltoastrelid FROM t WHERE reltoastrelid <> 0
  UNION ALL SELECT i.indexrelid FROM pg_index i, t WHERE t.reltoastrelid <> 0 AND i.indrelid = t.reltoastrelid) AS r(oid)`, t.name)
		if err != nil {
			return 0, nil, err
		}
		nodes, err := pgx.CollectRows(rows, pgx.RowTo[*uint32])
		if err != nil {
			return 0, nil, fmt.Errorf("relfilenodes of %s: %w", t.name, err)
		}
		for _, n := range nodes {
			if n != nil {
				rels[*n] = t.group
			}
		}
	}
	return dbOID, rels, nil
}

// writeBackWindow is one measured window of the write-back phase.
type writeBackWindow struct {
	label    string
	startLSN string
	sampler  *backendSampler
	meter    *cpuMeter
}

// writeBackResult is what a window measured.
type writeBackResult struct {
	events   int
	delta    int64 // bytes of WAL between the window's start and end
	records  int
	wal      walAttribution
	backends map[string]time.Duration
	stmts    map[string]stmtTotals // nil without pg_stat_statements
	usage    cpuUsage
	note     string // what the window could not wait for
}

// writeBackConns are the write-back phase's own connections: to database
// postgres (LSNs, slots, pg_stat_statements), for the backend sampler (its
// own, as the sampler queries from a goroutine), and to the phase's
// database (row state), all named benchAppName so that their backends are
// not counted as the relay's.
type writeBackConns struct {
	mon, sampler, db *pgx.Conn
}

func (c writeBackConns) close() {
	for _, conn := range []*pgx.Conn{c.mon, c.sampler, c.db} {
		if conn != nil {
			conn.Close(context.Background())
		}
	}
}

// connectBench opens a connection named benchAppName + " monitor" that
// pg_stat_statements does not track.
func (e *env) connectBench(ctx context.Context, url string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["application_name"] = benchAppName + " monitor"
	if e.pgss {
		cfg.RuntimeParams["pg_stat_statements.track"] = "none"
	}
	return pgx.ConnectConfig(ctx, cfg)
}

// begin starts a window: its WAL position, the statement counters and the
// backend sampler. The caller sets w.meter once the relay runs.
func (e *env) beginWriteBack(ctx context.Context, c writeBackConns, db, label string) (*writeBackWindow, error) {
	w := &writeBackWindow{label: label}
	if e.pgss {
		if _, err := c.mon.Exec(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
			return nil, err
		}
	}
	if err := c.mon.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&w.startLSN); err != nil {
		return nil, err
	}
	var err error
	w.sampler, err = startBackendSampler(ctx, c.sampler, db)
	return w, err
}

// endWriteBack waits until the relay has written back the window's events
// (no row pending, the slot confirmed past lastLSN; at most a minute), ends
// the window and attributes its WAL with pg_waldump.
func (e *env) endWriteBack(ctx context.Context, c writeBackConns, w *writeBackWindow, db, slot, lastLSN string, events int) (writeBackResult, error) {
	res := writeBackResult{events: events}
	deadline := time.Now().Add(time.Minute)
	// Every delivered row ends 'done', written in its settlement
	// (docs/operations.md).
	query := `SELECT EXISTS (SELECT FROM integration_outbox o WHERE o.status = 'pending')`
	for {
		var pending, confirmed bool
		if err := c.db.QueryRow(ctx, query).Scan(&pending); err != nil {
			return res, err
		}
		if err := c.mon.QueryRow(ctx, `SELECT coalesce(confirmed_flush_lsn >= $2::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $1`,
			slot, lastLSN).Scan(&confirmed); err != nil {
			return res, fmt.Errorf("slot %s: %w", slot, err)
		}
		if !pending && confirmed {
			break
		}
		if time.Now().After(deadline) {
			res.note = fmt.Sprintf("written back only in part after a minute (rows still pending: %v; slot confirmed past the last insert: %v)", pending, confirmed)
			break
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	var endLSN string
	if err := c.mon.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&endLSN); err != nil {
		return res, err
	}
	res.usage = w.meter.stop()
	res.backends = w.sampler.finish(ctx)
	if e.pgss {
		var err error
		if res.stmts, err = readStatements(ctx, c.mon, db); err != nil {
			return res, fmt.Errorf("pg_stat_statements: %w", err)
		}
	}
	// pg_waldump reads the files: wait until the end is flushed (the WAL
	// writer does it within wal_writer_delay).
	for flushed := false; !flushed; {
		if err := c.mon.QueryRow(ctx, `SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn`, endLSN).Scan(&flushed); err != nil {
			return res, err
		}
		if !flushed {
			time.Sleep(50 * time.Millisecond)
		}
	}
	if err := c.mon.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint`, endLSN, w.startLSN).Scan(&res.delta); err != nil {
		return res, err
	}
	dbOID, rels, err := relayRelations(ctx, c.db)
	if err != nil {
		return res, err
	}
	e.say("write-back: %s: pg_waldump %s → %s (%.1f MB)", w.label, w.startLSN, endLSN, float64(res.delta)/1e6)
	records, err := e.waldump(ctx, w.startLSN, endLSN)
	if err != nil {
		return res, err
	}
	res.records = len(records)
	res.wal = attributeWAL(records, dbOID, rels)
	return res, nil
}

// phaseWriteBack measures what the relay writes to the primary per
// delivered event, both sinks on: WAL by kind (pg_waldump over the window,
// the application's INSERT transactions subtracted) and PostgreSQL CPU by
// process (the relay's walsender, its query connections), with the
// statements' execution time by kind from pg_stat_statements. Two windows
// on one database: the relay draining -writeback-n queued events, then
// -rate events/s for -writeback-duration. A physical slot holds the WAL
// until pg_waldump has read it (docs/performance.md, "What the relay
// writes back, per event").
func phaseWriteBack(ctx context.Context, e *env, r *report) error {
	phase, db := "write-back", "bench_write_back"
	s := relaySetup{name: phase, webhook: true}
	cfg, done, err := e.setUpRelay(ctx, db, &s)
	if err != nil {
		return err
	}
	defer done()
	url := s.url
	var c writeBackConns
	defer c.close()
	if c.mon, err = e.connectBench(ctx, e.cluster.URL("postgres")); err != nil {
		return err
	}
	if c.sampler, err = e.connectBench(ctx, e.cluster.URL("postgres")); err != nil {
		return err
	}
	if c.db, err = e.connectBench(ctx, url); err != nil {
		return err
	}
	if e.pgss {
		// Before the relay connects: the setting applies to new sessions.
		if _, err := c.mon.Exec(ctx, `ALTER DATABASE `+db+` SET pg_stat_statements.track = 'top'`); err != nil {
			return err
		}
	}
	walSlot := db + "_wal"
	if _, err := c.mon.Exec(ctx, `SELECT pg_create_physical_replication_slot($1, true)`, walSlot); err != nil {
		return fmt.Errorf("physical slot to keep the window's WAL: %w", err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := c.mon.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, walSlot); err != nil {
			e.say("warning: drop slot %s: %v", walSlot, err)
		}
	}()
	e.say("%s: creating slot %s (start the relay, stop it with SIGTERM)", phase, s.slot())
	if err := e.createSlot(ctx, s, cfg); err != nil {
		return err
	}

	// Window 1: a drain of queued events.
	n := e.o.writeBackN
	dt := newTracker("wb-d-", n)
	e.recv.cur.Store(dt)
	defer e.recv.cur.Store(nil)
	dsub, err := e.subscribe(s, dt)
	if err != nil {
		return err
	}
	defer dsub.Unsubscribe()
	e.say("%s: inserting %d rows (%d per transaction) with the relay stopped", phase, n, e.o.drainBatch)
	if err := e.bulkInsert(ctx, url, dt.prefix, n, e.o.drainBatch, 4); err != nil {
		return err
	}
	if err := e.quiet(ctx, phase+" (drain)", r, e.roots(nil)); err != nil {
		return err
	}
	drainLabel := fmt.Sprintf("drain of %s queued events", thousands(n))
	w, err := e.beginWriteBack(ctx, c, db, drainLabel)
	if err != nil {
		return err
	}
	rp, err := e.startRelay(s, cfg)
	if err != nil {
		return err
	}
	defer rp.Stop(30 * time.Second)
	w.meter = startCPU(e.roots(rp))
	if err := e.waitArrived(ctx, rp, dt, n, 2*time.Minute); err != nil {
		return err
	}
	drain, err := e.endWriteBack(ctx, c, w, db, s.slot(), w.startLSN, n)
	if err != nil {
		return err
	}
	addWriteBack(r, e, phase, drainLabel, drain)

	// Window 2: the steady load.
	d := e.o.writeBackDuration
	st := newTracker("wb-s-", int(e.o.rate*d.Seconds()))
	e.recv.cur.Store(st)
	ssub, err := e.subscribe(s, st)
	if err != nil {
		return err
	}
	defer ssub.Unsubscribe()
	pool, err := e.newLoadPool(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := e.quiet(ctx, phase+" (steady)", r, e.roots(rp)); err != nil {
		return err
	}
	steadyLabel := fmt.Sprintf("%s events/s for %.0f s", thousands(int(e.o.rate)), d.Seconds())
	if w, err = e.beginWriteBack(ctx, c, db, steadyLabel); err != nil {
		return err
	}
	w.meter = startCPU(e.roots(rp))
	e.say("%s: %.0f events/s for %s, one event per transaction", phase, e.o.rate, d)
	load, err := e.runLoad(ctx, pool, "", st, e.o.rate, d)
	if err != nil {
		return err
	}
	var lastLSN string
	if err := c.mon.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lastLSN); err != nil {
		return err
	}
	if err := e.waitArrived(ctx, rp, st, load.sent, time.Minute); err != nil {
		return err
	}
	steady, err := e.endWriteBack(ctx, c, w, db, s.slot(), lastLSN, load.sent)
	if err != nil {
		return err
	}
	addWriteBack(r, e, phase, steadyLabel, steady)
	if err := rp.Stop(30 * time.Second); err != nil {
		e.say("warning: %v", err)
	}
	return nil
}

// writeBackMethod says how the write-back rows are measured and where they
// fall short.
const writeBackMethod = "Write-back: each window runs from its WAL insert position at the start to the position once every event has arrived at both sinks, " +
	"no row is pending and the relay's slot has confirmed past the window's last insert. pg_waldump reads that WAL (a physical slot keeps it); each record is " +
	"charged by the relation of its first block reference (the relfilenodes of the outbox, the ledger, relay_checkpoint and the conflicts table, with their indexes " +
	"and TOAST) and its transaction: a transaction that inserts into the outbox heap is the application's, and its inserts, index entries, commit and their page " +
	"images are not counted. Of the rest: outbox UPDATE = heap updates/locks and index entries on the outbox by other transactions (mark done, settle); ledger, " +
	"checkpoint = everything on those tables; commits = commit records of transactions that wrote the relay's tables or updated the outbox; full-page images = " +
	"the images in those records and FPI records on those tables; outbox prune/vacuum = removing the dead tuples the UPDATEs leave (prune, vacuum, index " +
	"deletion); other = everything else in the window (the server's own records, catalog, vacuum's visibility map, the conflicts table). Sizes are 8-byte aligned " +
	"as in the WAL; page headers are the rest of the position delta. Limits: WAL the relay writes after the window (a late checkpoint row) is missed; full-page " +
	"images depend on whether a server checkpoint fell in the window (a short window often has none, a production server pays them on the first change of each " +
	"page after each checkpoint). PostgreSQL CPU: every process of pg_stat_activity is read from /proc (schedstat) every half second and classed by backend_type, " +
	"application_name and database (the benchmark names its own connections outbox-relay-bench…); a process that exits within the window loses its last half " +
	"second (counted as not attributed). The statements' times come from pg_stat_statements, loaded in this cluster and tracking only the write-back database " +
	"(track = top there, none elsewhere); they are execution times, waits included, not CPU."

// fmtBytes formats a per-event byte count: whole bytes, a decimal below 10.
func fmtBytes(b float64) string {
	if b < 10 {
		return fmt.Sprintf("%.1f", b)
	}
	return thousands(int(b + 0.5))
}

// waitArrived waits until the first n events of t have arrived at both
// sinks.
func (e *env) waitArrived(ctx context.Context, rp *harness.Relay, t *tracker, n int, stall time.Duration) error {
	last, lastCount := time.Now(), int64(-1)
	for t.nats.unique.Load() < int64(n) || t.hook.unique.Load() < int64(n) {
		if progress := t.nats.unique.Load() + t.hook.unique.Load(); progress > lastCount {
			last, lastCount = time.Now(), progress
		}
		if rp.Exited() {
			return rp.Failure()
		}
		if time.Since(last) > stall {
			return fmt.Errorf("no progress for %s: NATS %d of %d, webhook %d (log %s)", stall, t.nats.unique.Load(), n, t.hook.unique.Load(), rp.LogPath())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

// addWriteBack adds a window's rows: WAL per delivered event by kind, and
// PostgreSQL and relay CPU per delivered event.
func addWriteBack(r *report, e *env, phase, label string, res writeBackResult) {
	r.method(writeBackMethod)
	n := float64(res.events)
	if n <= 0 {
		return
	}
	a := res.wal
	per := func(b int64) float64 { return float64(b) / n }
	total := per(a.relay())
	parts := make([]string, 0, walKinds)
	for k := range walKinds {
		parts = append(parts, walKindNames[k]+" "+fmtBytes(per(a.kinds[k])))
	}
	rmgrs := slices.Sorted(maps.Keys(a.byRmgr))
	slices.SortStableFunc(rmgrs, func(x, y string) int { return cmp.Compare(a.byRmgr[y], a.byRmgr[x]) })
	byRmgr := make([]string, 0, len(rmgrs))
	for _, m := range rmgrs {
		byRmgr = append(byRmgr, m+" "+fmtBytes(per(a.byRmgr[m])))
	}
	headers := max(res.delta-a.aligned, 0)
	txPerEvent := "—"
	if a.relayXids > 0 {
		txPerEvent = fmt.Sprintf("%.1f", n/float64(a.relayXids))
	}
	value := fmt.Sprintf("%s B (%s; by resource manager: %s). Not counted: the application's own INSERTs %s B/event (%s transactions), page headers %s B/event. Window: %.1f MB of WAL, %s records; the relay wrote in %s transactions (%s events each)",
		fmtBytes(total), strings.Join(parts, ", "), strings.Join(byRmgr, ", "), fmtBytes(per(a.app)), thousands(a.appXids), fmtBytes(per(headers)), float64(res.delta)/1e6,
		thousands(res.records), thousands(a.relayXids), txPerEvent)
	if res.note != "" {
		value += "; " + res.note
	}
	r.add(phase, "WAL the relay writes per delivered event, both sinks: "+label, value, "—", "info", res.usage)

	us := func(d time.Duration) float64 { return d.Seconds() / n * 1e6 }
	var classified time.Duration
	for _, d := range res.backends {
		classified += d
	}
	pgTotal := time.Duration(res.usage.groups["postgres"] * res.usage.wall.Seconds() * float64(time.Second))
	relayBackends := us(res.backends[pgRelay])
	value = fmt.Sprintf("%.1f µs in the relay's query connections; %.1f µs in its walsender (decoding); the benchmark's connections (the application's INSERTs, monitoring) %.1f µs; server processes (checkpointer, WAL writer, autovacuum…) %.1f µs; not attributed (exited processes, the postmaster) %.1f µs",
		relayBackends, us(res.backends[pgWalsender]), us(res.backends[pgApp]), us(res.backends[pgServer]), us(max(pgTotal-classified, 0)))
	if res.stmts != nil {
		parts = parts[:0]
		for _, k := range stmtKinds {
			t := res.stmts[k]
			parts = append(parts, fmt.Sprintf("%s %.1f µs (%s calls)", k, t.execMS*1e3/n, thousands(int(t.calls))))
		}
		value += ". Execution time of the relay's statements per event (pg_stat_statements; waits included, COMMIT waits for the WAL flush): " + strings.Join(parts, ", ")
	} else {
		value += ". By statement: n/a (pg_stat_statements is not installed)"
	}
	r.add(phase, "PostgreSQL CPU per delivered event, the relay's query connections: "+label, value, "—", "info", res.usage)

	// The relay's CPU target is the steady phases' (both sinks, no
	// monitoring of the write-back beside it).
	relay := res.usage.groups["relay"] * res.usage.wall.Seconds() / n * 1e6
	r.add(phase, "relay CPU per delivered event: "+label, fmt.Sprintf("%.0f µs", relay), "—", "info", res.usage)
	r.addCPU(phase+" ("+label+")", res.usage, "")
}
