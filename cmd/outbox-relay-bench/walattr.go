package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// WAL attribution: which part of the WAL written in a window the relay
// caused. pg_waldump prints one line per record, e.g.
//
//	rmgr: Heap        len (rec/tot):    122/   122, tx:        741, lsn: 0/01968D70, prev 0/01968D40, desc: UPDATE off 1 xmax 741 flags 0x10 ; new off 3 xmax 0, blkref #0: rel 1663/16384/16389 blk 0
//
// "tot" is the record's length with its full-page images, "rec" without
// them; "tx" is the transaction id (0 for records outside a transaction:
// pruning, checkpoints, running-xacts); the first block reference names the
// relation (tablespace/database/relfilenode) the record changes.

// walRecord is one pg_waldump line.
type walRecord struct {
	rmgr string // resource manager: Heap, Heap2, Btree, Transaction, XLOG, Standby, Sequence…
	kind string // first word of desc: INSERT, INSERT+INIT, UPDATE, HOT_UPDATE, COMMIT, FPI…
	rec  int    // bytes without full-page images
	tot  int    // bytes with them
	xid  uint32
	db   uint32 // database oid of the first block reference; 0: none
	rel  uint32 // its relfilenode; 0: the record names no relation
}

// parseWaldumpLine parses one line of pg_waldump's record output; ok is
// false for lines that are not records (pg_waldump prints nothing else
// without --stats, but a trailing error message is not a record).
func parseWaldumpLine(line string) (r walRecord, ok bool) {
	rest, ok := strings.CutPrefix(line, "rmgr: ")
	if !ok {
		return r, false
	}
	f := strings.Fields(rest)
	// f: Heap len (rec/tot): 122/ 122, tx: 741, lsn: … — the lengths may or
	// may not be split by spaces after the slash.
	if len(f) < 5 || f[1] != "len" || f[2] != "(rec/tot):" {
		return r, false
	}
	r.rmgr = f[0]
	lens := f[3]
	i := 4
	if strings.HasSuffix(lens, "/") {
		lens += f[4]
		i = 5
	}
	recS, totS, ok := strings.Cut(strings.TrimSuffix(lens, ","), "/")
	if !ok {
		return r, false
	}
	var err1, err2 error
	r.rec, err1 = strconv.Atoi(recS)
	r.tot, err2 = strconv.Atoi(totS)
	if err1 != nil || err2 != nil {
		return r, false
	}
	if i+1 < len(f) && f[i] == "tx:" {
		x, err := strconv.ParseUint(strings.TrimSuffix(f[i+1], ","), 10, 32)
		if err != nil {
			return r, false
		}
		r.xid = uint32(x)
	}
	_, desc, ok := strings.Cut(rest, "desc: ")
	if !ok {
		return r, true
	}
	r.kind, _, _ = strings.Cut(desc, " ")
	r.kind = strings.TrimSuffix(r.kind, ",")
	// The relation: the first block reference, or a sequence's "LOG rel".
	if j := strings.Index(desc, " rel "); j >= 0 {
		spec, _, _ := strings.Cut(desc[j+5:], " ")
		spec = strings.TrimSuffix(spec, ",")
		parts := strings.Split(spec, "/")
		if len(parts) == 3 {
			db, err1 := strconv.ParseUint(parts[1], 10, 32)
			rel, err2 := strconv.ParseUint(parts[2], 10, 32)
			if err1 == nil && err2 == nil {
				r.db, r.rel = uint32(db), uint32(rel)
			}
		}
	}
	return r, true
}

// relGroup is what a relation of the phase's database belongs to.
type relGroup int

const (
	relOther      relGroup = iota // catalog, or any relation the relay does not own
	relOutbox                     // the outbox table, its indexes, its TOAST table and index
	relLedger                     // the idempotency ledger
	relCheckpoint                 // relay_checkpoint
	relConflicts                  // the outbox's conflicts table
)

// walKind is where attributed WAL goes in the report.
type walKind int

const (
	walMarkDone   walKind = iota // outbox UPDATE (mark done, settle) and its index entries
	walLedger                    // idempotency ledger inserts and updates
	walCheckpoint                // relay_checkpoint
	walCommit                    // commit records of the relay's transactions
	walFPI                       // full-page images in the relay's records, FPI records on its tables
	walCleanup                   // pruning and vacuuming the dead outbox tuples the UPDATEs leave
	walOther                     // everything else not the application's: server records, catalog, vacuum bookkeeping
	walKinds
)

// walKindNames label the kinds in the report.
var walKindNames = [walKinds]string{
	walMarkDone:   "outbox UPDATE",
	walLedger:     "ledger",
	walCheckpoint: "checkpoint",
	walCommit:     "commits",
	walFPI:        "full-page images",
	walCleanup:    "outbox prune/vacuum",
	walOther:      "other",
}

// walAttribution is the WAL of a window by kind. Sizes are MAXALIGNed
// (8 bytes), as records are laid out in the WAL; the rest of the window's
// position delta is page headers.
type walAttribution struct {
	records int
	aligned int64 // every record, aligned
	app     int64 // the application's own outbox INSERT transactions (subtracted)
	appXids int
	kinds   [walKinds]int64
	// byRmgr is the same bytes (everything but the application's) by
	// resource manager, page images included.
	byRmgr map[string]int64
	// relayXids are transactions that wrote the relay's tables or updated
	// the outbox.
	relayXids int
}

// relay is the WAL attributed to the relay: everything but the
// application's inserts.
func (a walAttribution) relay() int64 {
	var n int64
	for _, v := range a.kinds {
		n += v
	}
	return n
}

func align8(n int) int64 { return int64((n + 7) &^ 7) }

// appRecord reports whether a record of an application transaction is
// part of its insert (rather than cleanup the insert happened to do).
func appRecord(r walRecord) bool {
	switch r.rmgr {
	case "Heap":
		return strings.HasPrefix(r.kind, "INSERT")
	case "Heap2":
		return strings.HasPrefix(r.kind, "MULTI_INSERT")
	case "Btree":
		return strings.HasPrefix(r.kind, "INSERT") || strings.HasPrefix(r.kind, "SPLIT") || r.kind == "NEWROOT"
	case "Sequence", "Transaction":
		return true
	case "XLOG":
		return strings.HasPrefix(r.kind, "FPI")
	}
	return false
}

// cleanupRecord reports whether a record removes dead tuples (what the
// relay's UPDATEs leave behind) rather than changing live data.
func cleanupRecord(r walRecord) bool {
	switch r.rmgr {
	case "Heap2":
		return r.kind == "PRUNE" || r.kind == "VACUUM"
	case "Btree":
		return r.kind == "VACUUM" || r.kind == "DELETE" || r.kind == "MARK_PAGE_HALFDEAD" || r.kind == "UNLINK_PAGE" || r.kind == "UNLINK_PAGE_META" || r.kind == "REUSE_PAGE"
	}
	return false
}

// attributeWAL splits records by kind. rels maps the relfilenodes of the
// phase's database db to their group. A transaction that inserts into the
// outbox heap is the application's: its inserts, index entries, commit and
// their full-page images are subtracted. Of the rest, records on the
// relay's tables and the outbox go to their kind (full-page images apart),
// commit records of transactions that wrote them to commits, and all else
// to other.
func attributeWAL(records []walRecord, db uint32, rels map[uint32]relGroup) walAttribution {
	a := walAttribution{byRmgr: map[string]int64{}}
	group := func(r walRecord) relGroup {
		if r.rel == 0 || r.db != db {
			return relOther
		}
		return rels[r.rel]
	}
	appXids := map[uint32]bool{}
	relayXids := map[uint32]bool{}
	for _, r := range records {
		if r.xid == 0 {
			continue
		}
		g := group(r)
		switch {
		case g == relOutbox && (r.rmgr == "Heap" && strings.HasPrefix(r.kind, "INSERT") || r.rmgr == "Heap2" && strings.HasPrefix(r.kind, "MULTI_INSERT")):
			appXids[r.xid] = true
		case g == relLedger || g == relCheckpoint || g == relConflicts,
			g == relOutbox && r.rmgr == "Heap" && (strings.HasPrefix(r.kind, "UPDATE") || strings.HasPrefix(r.kind, "HOT_UPDATE") || r.kind == "LOCK" || r.kind == "DELETE"):
			relayXids[r.xid] = true
		}
	}
	for x := range appXids {
		delete(relayXids, x) // a transaction that does both is the application's
	}
	a.appXids, a.relayXids = len(appXids), len(relayXids)
	for _, r := range records {
		a.records++
		size := align8(r.tot)
		a.aligned += size
		if appXids[r.xid] && appRecord(r) {
			a.app += size
			continue
		}
		a.byRmgr[r.rmgr] += size
		fpi := int64(r.tot - r.rec)
		body := size - fpi
		g := group(r)
		kind := walOther
		switch {
		case r.rmgr == "XLOG" && strings.HasPrefix(r.kind, "FPI") && g != relOther:
			kind, body, fpi = walFPI, size, 0
		case r.rmgr == "Transaction":
			if relayXids[r.xid] {
				kind = walCommit
			}
		case g == relOutbox && cleanupRecord(r):
			kind = walCleanup
		case g == relOutbox && relayXids[r.xid]:
			kind = walMarkDone
		case g == relLedger:
			kind = walLedger
		case g == relCheckpoint:
			kind = walCheckpoint
		}
		if kind == walOther {
			a.kinds[walOther] += size // a server record's images are the server's
			continue
		}
		a.kinds[kind] += body
		a.kinds[walFPI] += fpi
	}
	return a
}

// readWaldump parses pg_waldump's output.
func readWaldump(rd io.Reader) ([]walRecord, error) {
	var out []walRecord
	sc := bufio.NewScanner(rd)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	// Intern the few distinct rmgr and kind strings, so the records do not
	// hold on to their lines.
	names := map[string]string{}
	intern := func(s string) string {
		if v, ok := names[s]; ok {
			return v
		}
		s = strings.Clone(s)
		names[s] = s
		return s
	}
	for sc.Scan() {
		r, ok := parseWaldumpLine(sc.Text())
		if !ok {
			continue
		}
		r.rmgr, r.kind = intern(r.rmgr), intern(r.kind)
		out = append(out, r)
	}
	return out, sc.Err()
}

// waldump runs pg_waldump over [start, end) of the cluster's WAL and parses
// its records. pg_waldump reads the segment files directly: they must still
// be there (the write-back phase holds a physical slot over the window).
func (e *env) waldump(ctx context.Context, start, end string) ([]walRecord, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(e.bin, "pg_waldump"),
		"--path", filepath.Join(e.cluster.Dir(), "data", "pg_wal"), "--start", start, "--end", end)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: serverCredential(), Pdeathsig: syscall.SIGKILL}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("pg_waldump: %w", err)
	}
	records, rerr := readWaldump(stdout)
	if err := cmd.Wait(); err != nil {
		return records, fmt.Errorf("pg_waldump --start %s --end %s: %w: %s", start, end, err, bytes.TrimSpace(stderr.Bytes()))
	}
	return records, rerr
}
