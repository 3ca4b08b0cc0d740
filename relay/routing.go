package relay

// Takes reports whether r's sink takes ev: the one routing rule
// (docs/configuration.md, "sinks"). The engine routes every event by it, and
// verify (ledger/admin) judges by it which sinks an outbox row should have
// reached, so a rule added here — a filter, say — changes both at once.
// Verify gives it a row's id, key, event type and creation time only: a
// rule that reads more (the payload, the aggregate) must make verify read
// it too.
func (r *Route) Takes(ev *Event) bool { return Matches(r.Events, ev.EventType) }
