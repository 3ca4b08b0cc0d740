package relay

import "time"

// HandOverRowsPerSecond is the rate at which the relay expects to deliver
// the rows a new slot's hand-over gives it, for the drain times it states
// (a slot recreated behind a backlog, doctor): a round, conservative
// figure below make bench's slot-recreated measure with both sinks and
// fresh events beside it (docs/performance.md, "The claim path at
// volume"). The sinks' speed bounds the real rate.
const HandOverRowsPerSecond = 5000

// HandOverDrainEstimate is how long a hand-over of rows takes at
// HandOverRowsPerSecond, to the second (at least one).
func HandOverDrainEstimate(rows int64) time.Duration {
	return max(time.Duration(rows)*time.Second/HandOverRowsPerSecond, 0).Round(time.Second) + time.Second
}
