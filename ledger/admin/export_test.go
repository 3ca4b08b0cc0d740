package admin

// VerifyStatements are verify's statements, for the plan tests.
type VerifyStatements struct {
	Slice, FirstAfter, OrphansNext, Unrecorded string
}

// VerifyStatementsForTest returns verify's statements for t.
func VerifyStatementsForTest(t Tables) VerifyStatements {
	q := newVerifySQL(t)
	return VerifyStatements{Slice: q.slice, FirstAfter: q.firstAfter, OrphansNext: q.orphansNext, Unrecorded: q.unrecorded}
}
