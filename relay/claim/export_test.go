package claim

// GlobToRegex exposes globToRegex to the tests.
var GlobToRegex = globToRegex

// SinkFilter exposes how the claim query routes a sink's globs in SQL.
func SinkFilter(globs []string) (everyType bool, regex *string, err error) {
	f, err := newSinkFilter(globs)
	return f.everyType, f.regex, err
}

// ClaimStatement returns the claim query and its arguments, for EXPLAIN.
func (c *Claimer) ClaimStatement() (string, []any) {
	args := []any{c.cfg.BatchSize, c.cfg.Owner}
	if !c.cfg.Unordered {
		args = append(args, c.sinkNames, c.sinkEvery, c.sinkRegex)
	}
	return c.sql.claimReplays, args
}

// OwnerLockClass is the first key of the owner lock.
const OwnerLockClass = ownerLockClass
