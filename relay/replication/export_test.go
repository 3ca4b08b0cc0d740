package replication

// Exported for the tests in package replication_test.
var (
	ParseServerDuration = parseServerDuration
	ParseTimestamptz    = parseTimestamptz
)
