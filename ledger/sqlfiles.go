package ledger

import (
	"embed"
	"fmt"

	"github.com/outbox-relay/outbox-relay/relay"
)

// sqlFiles are the package's statements (docs/architecture.md, "SQL as
// named statements"), one file per subject.
//
//go:embed sql/*.sql
var sqlFiles embed.FS

// catalog are the statements on the server's catalogs and functions
// (sql/catalog.sql), which name none of the relay's tables: the same for
// every store, and for the leader lock, which has none.
var catalog = MustLoadStatements(sqlFiles, "sql/catalog.sql", sqlData{OwnerLockClass: OwnerLockClass})

// sqlData is what the statements are rendered with: the tables, quoted
// once, and the switches that choose an index, an order or a column list
// (claim_runs.sql). Its methods write the conditions several statements
// share, for a row alias, so that each is written once.
type sqlData struct {
	Outbox, Ledger, Checkpoint string
	// OutboxLiteral is the quoted outbox name as a string literal
	// (to_regclass).
	OutboxLiteral  string
	OwnerLockClass int
	ClaimRunRows   int

	// Unordered drops the claim's ordering check (ordering: none).
	Unordered bool
	// PollMode: the claim reads every due row (the claim index), not only
	// the rows diverted to the claim path (the diversion index).
	PollMode bool
	// Newest: the claim's window is the newest due rows, newest first.
	Newest bool
}

// Pending is Pending for the templates.
func (sqlData) Pending(o string) string { return Pending(o) }

// StreamOwned is StreamOwned for the templates.
func (sqlData) StreamOwned(o string) string { return StreamOwned(o) }

// Unsettled is Unsettled for the templates.
func (sqlData) Unsettled(o string) string { return Unsettled(o) }

// OwnerAlive is the SQL condition "the owner named by the SQL expression
// owner holds its owner lock in this database" (OwnerLockClass).
func (sqlData) OwnerAlive(owner string) string {
	return fmt.Sprintf(`EXISTS (
           SELECT FROM pg_locks AS k
            WHERE k.locktype = 'advisory' AND k.granted
              AND k.database = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
              AND k.classid = %d AND k.objid = hashtext(%s)::oid AND k.objsubid = 2)`, OwnerLockClass, owner)
}

// PayloadBytes is the SQL of the bytes, about, that row o's payload takes
// once read: the size of its jsonb uncompressed, which its text follows
// closely. The concatenation detoasts the value without printing it
// (octet_length(payload::text) would print it, a cost like the read's own
// on a large payload); '{}' adds nothing to an object.
func (sqlData) PayloadBytes(o string) string {
	return fmt.Sprintf(`COALESCE(pg_column_size(%s.payload || '{}'::jsonb), 0)::bigint`, o)
}

// render reads the statements once, for the tables t.
func render(t tables, claim claimOptions) statements {
	d := sqlData{
		Outbox: t.outbox, Ledger: t.ledger, Checkpoint: t.checkpoint,
		OutboxLiteral:  relay.QuoteLiteral(t.outbox),
		OwnerLockClass: OwnerLockClass,
		ClaimRunRows:   claimRunRows,
		Unordered:      claim.unordered,
	}
	st := MustLoadStatements(sqlFiles, "sql/*.sql", d)
	claimRuns := func(pollMode, newest bool) string {
		d := d
		d.PollMode, d.Newest = pollMode, newest
		return MustLoadStatements(sqlFiles, "sql/claim_runs.sql", d).Get("ClaimRuns")
	}
	return statements{
		scanStart:   st.Get("ScanStart"),
		scanTop:     st.Get("ScanTop"),
		scanRange:   st.Get("ScanRange"),
		scanRecheck: st.Get("ScanRecheck"),
		stream: streamStatements{
			deliveredNew: st.Get("StreamDeliveredNew"),
			delivered:    st.Get("DeliveredPairs"),
			done:         st.Get("StreamDone"),
			divert:       st.Get("StreamDivert"),
			deadLetter:   st.Get("StreamDeadLetter"),
			held:         st.Get("StreamHold"),
			unknown:      st.Get("StreamPairsUnknown"),
			release:      st.Get("ReleasePairs"),
			restreamed:   st.Get("Restreamed"),
			ledgerOf:     st.Get("LedgerPairs"),
			gone:         st.Get("StreamGone"),
			claimPairs:   st.Get("StreamClaimPairs"),
			diverted:     st.Get("DivertedAggregates"),
		},
		claim: claimStatements{
			claim:               [2]string{claimRuns(false, false), claimRuns(true, false)},
			newest:              claimRuns(false, true),
			ledgerPairs:         st.Get("LedgerPairs"),
			claimPairs:          st.Get("ClaimPairsTakeOver"),
			delivered:           st.Get("DeliveredOwnPairs"),
			release:             st.Get("ReleasePairs"),
			unknown:             st.Get("ClaimedPairsUnknown"),
			done:                st.Get("ClaimedDone"),
			failed:              st.Get("ClaimedFailed"),
			retry:               st.Get("ClaimedRetry"),
			held:                st.Get("ClaimedHeld"),
			missing:             st.Get("ClaimedMissing"),
			settled:             st.Get("SettledAggregates"),
			releaseOwned:        st.Get("ReleaseOwned"),
			extendRows:          st.Get("ExtendRowLeases"),
			extendClaims:        st.Get("ExtendPairClaims"),
			expireLeases:        st.Get("ExpireLeases"),
			repairDue:           st.Get("RepairDue"),
			lockOwner:           st.Get("LockOwner"),
			unlockOwner:         st.Get("UnlockOwner"),
			reconcileLock:       st.Get("ReconcileLock"),
			reconcileUnfinished: st.Get("ReconcileUnfinished"),
			reconcileDivert:     st.Get("ReconcileDivert"),
		},
		statsDiverted:        st.Get("StatsDiverted"),
		statsStatuses:        st.Get("StatsStatuses"),
		loadCheckpoint:       st.Get("LoadCheckpoint"),
		saveCheckpoint:       st.Get("SaveCheckpoint"),
		beginSlot:            st.Get("BeginSlot"),
		handedOver:           st.Get("HandedOver"),
		handoverDone:         st.Get("HandOverDone"),
		handOverRead:         st.Get("HandOverRead"),
		payloadSizes:         st.Get("PayloadSizes"),
		snapshotPending:      st.Get("SnapshotPending"),
		snapshotPendingAmong: st.Get("SnapshotPendingAmong"),
		maxID:                st.Get("MaxID"),
		snapshotEarly:        st.Get("SnapshotEarly"),
		divertByID:           st.Get("DivertByID"),
		setAsyncCommit:       setAsyncCommit,
		setSynchronousCommit: setSynchronousCommit,
		setPlanning:          setPlanning,
		setClaim:             setClaim,
	}
}
