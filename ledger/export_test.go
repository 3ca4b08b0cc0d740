package ledger

import (
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/relay"
)

// SetHandOverSlice sets how many rows a hand-over reads at a time,
// until restore.
func SetHandOverSlice(n int) (restore func()) {
	old := handOverSlice
	handOverSlice = n
	return func() { handOverSlice = old }
}

// ClaimStatement returns the claim query and its arguments, for EXPLAIN.
func (s *Store) ClaimStatement(limit int, owner string, all bool) (string, []any, error) {
	i := 0
	if all {
		i = 1
	}
	cursor := pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
	return s.sql.claim.claim[i], []any{limit, owner, cursor, int64(0), max(limit*claimWindowRows, 1000), relay.ReadBytes(relay.DefaultMaxInFlightBytes)}, nil
}

// ClaimNewestStatement returns the claim of the newest due diversions
// first (Claim's share for the aggregates the stream diverts) and its
// arguments, for EXPLAIN.
func (s *Store) ClaimNewestStatement(limit int, owner string) (string, []any, error) {
	cursor := pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
	return s.sql.claim.newest, []any{limit, owner, cursor, int64(0), max(limit*claimWindowRows, 1000), relay.ReadBytes(relay.DefaultMaxInFlightBytes)}, nil
}

// LedgerPairsStatement returns the read of the ledger's pairs of some event
// keys (the claim path's and the stream's), for EXPLAIN.
func (s *Store) LedgerPairsStatement() string { return s.sql.claim.ledgerPairs }

// BatchStatement is one statement the delivery path runs on a batch, with
// arguments for a batch of ids (their rows' event keys are keys), for
// EXPLAIN.
type BatchStatement struct {
	Name string
	SQL  string
	Args []any
	// InTx: the relay runs it in a transaction, after TxSetting.
	InTx bool
}

// TxSetting is the statement that begins each of the relay's transactions
// (here the synchronous kind).
func (s *Store) TxSetting() string { return s.sql.setSynchronousCommit }

// BatchStatements returns the statements the stream and the claim path
// run per batch: ids are outbox rows, keys their event keys; every pair is
// (key, action).
func (s *Store) BatchStatements(ids []int64, keys, aggregates []string, action, owner string) []BatchStatement {
	n := len(ids)
	actions, texts, zeros, avail := make([]string, n), make([]string, n), make([]int32, n), make([]*time.Time, n)
	delays, types := make([]int64, n), make([]string, len(aggregates))
	for i := range actions {
		actions[i], texts[i] = action, "x"
	}
	for i := range types {
		types[i] = "order"
	}
	st, cl := s.sql.stream, s.sql.claim
	return []BatchStatement{
		{"stream deliveredNew", st.deliveredNew, []any{keys, actions}, true},
		{"stream delivered", st.delivered, []any{keys, actions}, true},
		{"stream divert", st.divert, []any{ids, avail, texts, zeros}, true},
		{"stream deadLetter", st.deadLetter, []any{ids, texts, zeros}, true},
		{"stream held", st.held, []any{ids, texts, zeros}, true},
		{"stream unknown", st.unknown, []any{keys, actions, texts}, true},
		{"stream release", st.release, []any{keys, actions, owner}, true},
		{"stream restreamed", st.restreamed, []any{ids}, false},
		{"stream ledgerOf", st.ledgerOf, []any{keys}, false},
		{"stream claimPairs", st.claimPairs, []any{keys, actions, owner}, true},
		{"stream done", st.done, []any{ids}, true},
		{"claim ledgerPairs", cl.ledgerPairs, []any{keys}, false},
		{"claim claimPairs", cl.claimPairs, []any{keys, actions, owner, int64(30000)}, true},
		{"claim delivered", cl.delivered, []any{keys, actions, owner}, true},
		{"claim release", cl.release, []any{keys, actions, owner}, true},
		{"claim unknown", cl.unknown, []any{keys, actions, texts, delays, owner}, true},
		{"claim done", cl.done, []any{ids, owner}, true},
		{"claim failed", cl.failed, []any{ids, texts, zeros, owner}, true},
		{"claim retry", cl.retry, []any{ids, delays, texts, zeros, owner}, true},
		{"claim held", cl.held, []any{ids, texts, zeros, owner}, true},
		{"claim extendRows", cl.extendRows, []any{ids, owner}, true},
		{"claim extendClaims", cl.extendClaims, []any{ids, owner}, true},
		{"claim settled", cl.settled, []any{types, aggregates}, false},
	}
}

// ClaimTxSetting is the statement that begins each claim's transaction.
func (s *Store) ClaimTxSetting() string { return s.sql.setClaim }

// ScanStatements returns the pending scan's read of an id range ($1, $2]
// and its recheck of the watch list's ids ($1), for EXPLAIN.
func (s *Store) ScanStatements() (rng, recheck string) { return s.sql.scanRange, s.sql.scanRecheck }

// DivertedStatement returns the read of the diverted aggregates, for
// EXPLAIN.
func (s *Store) DivertedStatement() string { return s.sql.stream.diverted }

// SetEarlySlice sets how many of the newest rows NewestUnblocked looks at, until
// restore.
func SetEarlySlice(n int) (restore func()) {
	old := earlySlice
	earlySlice = n
	return func() { earlySlice = old }
}

// EarlyStatement returns the read of NewestUnblocked's rows (its arguments: the
// range of ids, open below), for EXPLAIN.
func (s *Store) EarlyStatement() string { return s.sql.snapshotEarly }
