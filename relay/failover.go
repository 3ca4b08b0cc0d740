package relay

import "errors"

// ErrServerChanged reports that the server the stream reads from is not the
// one the current term started on: another timeline of the same cluster (a
// standby was promoted) or another cluster. A term streams from one server
// (docs/failover.md): the outcomes of the events it streamed are written
// there or not at all, so the term ends and a new one starts on the new
// server. Sources return it without retrying; the supervisor ends the term.
var ErrServerChanged = errors.New("the database server changed (a failover): the term ends")
