package ledger

import "github.com/jackc/pgx/v5/pgtype"

// GlobToRegex exposes globToRegex to the tests.
var GlobToRegex = globToRegex

// SinkFilter exposes how the claim query routes a sink's globs in SQL.
func SinkFilter(globs []string) (everyType bool, regex *string, err error) {
	f, err := newSinkFilter(globs)
	return f.everyType, f.regex, err
}

// ClaimStatement returns the claim query (for an outbox with the replays
// and trace_context columns) and its arguments, for EXPLAIN.
func (s *Store) ClaimStatement(limit int, owner string, all bool) (string, []any, error) {
	names, every, regex, err := s.routingArrays()
	i := 0
	if all {
		i = 1
	}
	cursor := pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
	return s.sql.claim.claim[i][2], []any{limit, owner, all, names, every, regex, cursor, int64(0), max(limit*claimWindowRows, 1000)}, err
}

// LedgerPairsStatement returns the read of the ledger's pairs of some event
// keys (the claim path's and the stream's), for EXPLAIN.
func (s *Store) LedgerPairsStatement() string { return s.sql.claim.ledgerPairs }
