package ledger

import "fmt"

// A NULL status is pending (the column is nullable: docs/guarantees.md,
// "NULL status and NULL available_at"; docs/schema.md, "NULL status"). The
// conditions below are the one way the relay's statements test a row's
// status for "pending", "the stream's" and "unsettled": none reads
// status = 'pending' for those, nor COALESCE(status, …).
//
// The relay writes a status on every row it changes: a diversion to the
// claim path writes pending, so the claim path's rows never have a NULL
// status, and the claim's window (the claim and diversion indexes, whose
// predicate is status = 'pending') reads them as they are. A row that has
// never been written by the relay may have one. The order index holds such
// a row (migration 013), so an aggregate's row with a NULL status holds its
// later rows back on the claim path and in a new slot's hand-over; the
// claim path takes the row itself once the sweeper has written it pending
// and due (RepairDue).

// Pending is the SQL condition "the row aliased o is pending": its status
// is pending or NULL.
func Pending(o string) string {
	return fmt.Sprintf("(%[1]s.status = 'pending' OR %[1]s.status IS NULL)", o)
}

// StreamOwned is the SQL condition "the row aliased o is still the
// stream's": pending (Pending) and not diverted to the claim path. A
// statement that finds its rows by id tests "StreamOwned(o) IS TRUE",
// which no index serves: the planner probes the ids, where the condition
// alone let it combine the status indexes' entries for every pending row
// (docs/performance.md, "Plans that do not depend on statistics").
func StreamOwned(o string) string {
	return fmt.Sprintf("(%s AND %s.handoff_at IS NULL)", Pending(o), o)
}

// Unsettled is the SQL condition "the row aliased o is unsettled": pending
// (a NULL status included), processing or held. It is the order index's
// predicate (migration 013), written the same way so that the planner
// matches it; Pending implies it.
func Unsettled(o string) string {
	return fmt.Sprintf("(%[1]s.status IN ('pending', 'processing', 'held') OR %[1]s.status IS NULL)", o)
}
