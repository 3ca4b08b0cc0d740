// Package relay is the domain of outbox-relay and its one delivery core
// (docs/architecture.md).
//
// The domain: an outbox row is an Event; a Sink delivers events to one
// destination and classifies failures (Transient, Unknown, Permanent,
// SinkDown); an LSN is a WAL position; a QualifiedName is a table, slot or
// publication name, always quoted as an identifier.
//
// The core: two sources feed one Engine — the stream (relay/replication,
// through the Consumer the engine returns from Stream) and the claim path
// (relay/claim, through SubmitClaimed). An event's path reads in one
// direction, each step in one place:
//
//	source → route (Engine.route: which sinks take it)
//	       → prepare (the path's store: ledger claims, re-stream checks)
//	       → lane (lane.enqueue: per-aggregate order, back-pressure, circuit)
//	       → sink (lane.send, Sink.Send)
//	       → outcome (lane.result, lane.complete: one per sink)
//	       → decision (Policy.decide: done, later, dead letter, hold)
//	       → settle (settleQueue.write: the path's store, in batches)
//	       → acknowledge (Engine.settled: the stream's tracker; the claim
//	         path's owner lock is released only when its rows are settled)
//
// The Policy is the only place that decides retries, diversions, holds and
// dead letters, for both paths. Stores (StreamStore, ClaimStore, implemented
// by package ledger) hold every SQL statement; this package imports no
// database driver.
package relay
