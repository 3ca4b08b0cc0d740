package relay

import "time"

// ClaimPathRowsPerSecond is the rate at which the relay expects the claim
// path to deliver a backlog handed to it, for the drain times it states
// (a slot recreated behind a backlog, doctor): a round, conservative
// figure below make bench's drain-claim measure on one NATS sink
// (docs/performance.md "The claim path at volume"). The sinks' speed, not
// the database, bounds the real rate.
const ClaimPathRowsPerSecond = 5000

// ClaimDrainEstimate is how long the claim path takes to deliver rows at
// ClaimPathRowsPerSecond, to the second (at least one).
func ClaimDrainEstimate(rows int64) time.Duration {
	return max(time.Duration(rows)*time.Second/ClaimPathRowsPerSecond, 0).Round(time.Second) + time.Second
}
