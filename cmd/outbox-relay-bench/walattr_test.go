package main

import (
	"os"
	"strings"
	"testing"
)

// testdata/waldump-sample.txt is pg_waldump 15 over a window of a database
// migrated by `outbox-relay migrate`: two application INSERTs, the relay's
// kind of write-back (a ledger INSERT of four pairs, an UPDATE marking both
// rows done, a checkpoint upsert and update), a VACUUM of the outbox, and a
// third application INSERT. Relfilenodes (database 16384): outbox 16442
// (TOAST 16443, 16450; indexes 16444-16449), ledger 16451-16454,
// relay_checkpoint 16455-16458.
func sampleRels() map[uint32]relGroup {
	rels := map[uint32]relGroup{}
	for n := uint32(16442); n <= 16450; n++ {
		rels[n] = relOutbox
	}
	for n := uint32(16451); n <= 16454; n++ {
		rels[n] = relLedger
	}
	for n := uint32(16455); n <= 16458; n++ {
		rels[n] = relCheckpoint
	}
	return rels
}

func TestAttributeWAL_Sample(t *testing.T) {
	f, err := os.Open("testdata/waldump-sample.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	records, err := readWaldump(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(records) != 83 {
		t.Fatalf("parsed %d records, want 83", len(records))
	}
	a := attributeWAL(records, 16384, sampleRels())
	// Sizes are the records' tot rounded up to 8 (see the sample's lines).
	want := map[walKind]int64{
		walMarkDone:   2*136 + 2*(64+64+80+72), // two non-HOT UPDATEs, four index entries each
		walLedger:     4*96 + 96 + 4*64,        // four heap INSERTs, the index's new root, four entries
		walCheckpoint: 80 + 96 + 64 + 48 + 56 + 96,
		walCommit:     4 * 48, // transactions 754-757
		walFPI:        0,
		walCleanup:    64 + 6*56 + 56, // PRUNE, six index VACUUMs, heap VACUUM of the outbox
		// pg_class PRUNE (with its page image), RUNNING_XACTS, eight
		// pg_class INPLACE updates, four invalidation records, and the
		// outbox's visibility-map page (VISIBLE is vacuum bookkeeping,
		// not the relay's).
		walOther: 5120 + 56 + 8*192 + 376 + 384 + 80 + 96 + 8256,
	}
	for k := range walKinds {
		if a.kinds[k] != want[k] {
			t.Errorf("%s: %d bytes, want %d", walKindNames[k], a.kinds[k], want[k])
		}
	}
	// The three application transactions: the first also logs the id
	// sequence and the indexes' new roots.
	app := int64(104+120+6*96+(64+64+80+72+72+72)+48) + 2*(120+(64+64+80+72+72+72)+48)
	if a.app != app || a.appXids != 3 || a.relayXids != 4 {
		t.Errorf("application %d bytes in %d transactions, relay %d transactions; want %d in 3, 4", a.app, a.appXids, a.relayXids, app)
	}
	var byRmgr int64
	for _, v := range a.byRmgr {
		byRmgr += v
	}
	if byRmgr != a.relay() || a.byRmgr["Transaction"] != 4*48+376+80 {
		t.Errorf("by resource manager %v: sum %d, want %d; Transaction %d, want %d", a.byRmgr, byRmgr, a.relay(), a.byRmgr["Transaction"], 4*48+376+80)
	}
	if a.app+a.relay() != a.aligned {
		t.Errorf("application %d + relay %d != %d in all", a.app, a.relay(), a.aligned)
	}
}

// A mark-done UPDATE right after a checkpoint carries the page images of
// the heap page and of each index page it touches.
func TestAttributeWAL_FullPageImages(t *testing.T) {
	text := `rmgr: Heap        len (rec/tot):    127/   503, tx:        742, lsn: 0/01968FE8, prev 0/01968F70, desc: UPDATE off 2 xmax 742 flags 0x10 ; new off 4 xmax 0, blkref #0: rel 1663/16384/16389 blk 0 FPW
rmgr: Btree       len (rec/tot):     53/   173, tx:        742, lsn: 0/019691E0, prev 0/01968FE8, desc: INSERT_LEAF off 4, blkref #0: rel 1663/16384/16399 blk 1 FPW
rmgr: Transaction len (rec/tot):     46/    46, tx:        742, lsn: 0/01969500, prev 0/01969430, desc: COMMIT 2026-12-03 14:31:15.939006 UTC
rmgr: XLOG        len (rec/tot):     49/  8241, tx:          0, lsn: 0/01969530, prev 0/01969500, desc: FPI_FOR_HINT , blkref #0: rel 1663/16384/16407 blk 0 FPW
rmgr: XLOG        len (rec/tot):     49/  8241, tx:          0, lsn: 0/0196B568, prev 0/01969530, desc: FPI_FOR_HINT , blkref #0: rel 1663/16384/1259 blk 0 FPW
pg_waldump: error: error in WAL record at 0/196D5A0: invalid record length at 0/196D5D8: wanted 24, got 0
`
	records, err := readWaldump(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	if len(records) != 5 {
		t.Fatalf("parsed %d records, want 5", len(records))
	}
	rels := map[uint32]relGroup{16389: relOutbox, 16399: relOutbox, 16407: relLedger}
	a := attributeWAL(records, 16384, rels)
	// The UPDATE: 504 aligned, 376 of them the page image; the index
	// entry: 176, 120 of them the image. The hint-bit image of a ledger
	// page is the relay's; that of pg_class is not.
	if got, want := a.kinds[walMarkDone], int64(504-376+176-120); got != want {
		t.Errorf("outbox UPDATE %d, want %d", got, want)
	}
	if got, want := a.kinds[walFPI], int64(376+120+8248); got != want {
		t.Errorf("full-page images %d, want %d", got, want)
	}
	if a.kinds[walCommit] != 48 || a.kinds[walOther] != 8248 {
		t.Errorf("commits %d (want 48), other %d (want 8248)", a.kinds[walCommit], a.kinds[walOther])
	}
}

func TestParseWaldumpLine(t *testing.T) {
	for _, c := range []struct {
		name, line string
		want       walRecord
		ok         bool
	}{
		{"padded lengths", "rmgr: Sequence    len (rec/tot):     99/    99, tx:        752, lsn: 0/019AA0F0, prev 0/019A8CD8, desc: LOG rel 1663/16384/16388, blkref #0: rel 1663/16384/16388 blk 0",
			walRecord{rmgr: "Sequence", kind: "LOG", rec: 99, tot: 99, xid: 752, db: 16384, rel: 16388}, true},
		{"six-digit lengths", "rmgr: Heap2       len (rec/tot): 123456/123456, tx:          0, lsn: 0/019AB2D0, prev 0/019AB298, desc: MULTI_INSERT+INIT 61 tuples flags 0x02, blkref #0: rel 1663/5/16442 blk 7",
			walRecord{rmgr: "Heap2", kind: "MULTI_INSERT+INIT", rec: 123456, tot: 123456, db: 5, rel: 16442}, true},
		{"no relation", "rmgr: Standby     len (rec/tot):     50/    50, tx:          0, lsn: 0/01968F38, prev 0/01968F08, desc: RUNNING_XACTS nextXid 742 latestCompletedXid 741 oldestRunningXid 742",
			walRecord{rmgr: "Standby", kind: "RUNNING_XACTS", rec: 50, tot: 50}, true},
		{"not a record", "pg_waldump: error: error in WAL record at 0/196D5A0: invalid record length at 0/196D5D8: wanted 24, got 0", walRecord{}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, ok := parseWaldumpLine(c.line)
			if ok != c.ok || got != c.want {
				t.Errorf("got %+v %v, want %+v %v", got, ok, c.want, c.ok)
			}
		})
	}
}

// TestAttributeWAL_LedgerRows: the stream's delivered ledger rows (a row per
// event and sink, and its primary key entry) are the ledger's kind, and
// their transaction's commit is the relay's; they are not "other".
func TestAttributeWAL_LedgerRows(t *testing.T) {
	records := []walRecord{
		{rmgr: "Heap", kind: "INSERT", rec: 59, tot: 59, xid: 800, db: 16384, rel: 16470},       // a ledger row
		{rmgr: "Btree", kind: "INSERT_LEAF", rec: 64, tot: 64, xid: 800, db: 16384, rel: 16473}, // its primary key entry
		{rmgr: "Transaction", kind: "COMMIT", rec: 34, tot: 34, xid: 800},
	}
	a := attributeWAL(records, 16384, map[uint32]relGroup{16470: relLedger, 16473: relLedger})
	if got, want := a.kinds[walLedger], int64(64+64); got != want {
		t.Errorf("ledger %d, want %d", got, want)
	}
	if a.kinds[walCommit] != 40 || a.kinds[walOther] != 0 {
		t.Errorf("commits %d (want 40), other %d (want 0)", a.kinds[walCommit], a.kinds[walOther])
	}
}
