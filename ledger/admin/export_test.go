package admin

import (
	"github.com/outbox-relay/outbox-relay/relay"
)

// VerifyStatements are verify's statements, for the plan tests.
type VerifyStatements struct {
	Slice, FirstAfter, OrphansNext, Unrecorded string
}

// VerifyStatementsForTest returns verify's statements for t.
func VerifyStatementsForTest(t Tables) VerifyStatements {
	q := newVerifySQL(t)
	return VerifyStatements{Slice: q.slice, FirstAfter: q.firstAfter, OrphansNext: q.orphansNext, Unrecorded: q.unrecorded}
}

// NotifyReadSQL is the dead-letter notifier's read on outbox, for the plan
// test.
func NotifyReadSQL(outbox relay.QualifiedName) string {
	return newNotifySQL(outbox).read
}

// StatementsForTest returns the package's statements rendered for t.
func StatementsForTest(t Tables) map[string]string { return statements(t) }
