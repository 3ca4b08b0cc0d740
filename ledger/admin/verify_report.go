package admin

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// GapKind is a kind of gap verify finds.
type GapKind string

// The gap kinds, docs/operations.md "verify".
const (
	GapMissing  GapKind = "missing"
	GapStuck    GapKind = "stuck"
	GapUnrouted GapKind = "unrouted"
	GapOrphaned GapKind = "orphaned"
	// The deep checks': the sink lacks an event the ledger shows delivered
	// to it; the sink holds an event twice under different idempotency
	// ids; the sink holds an event the ledger does not show delivered to
	// it, though the row is settled (or gone).
	GapMissingAtSink GapKind = "missing_at_sink"
	GapDuplicate     GapKind = "duplicate"
	GapUnrecorded    GapKind = "unrecorded"
)

// GapKinds lists every kind, in the order reports show them; the first four
// are what a verify without --deep finds (the continuous verify's metric
// series).
var GapKinds = []GapKind{GapMissing, GapStuck, GapUnrouted, GapOrphaned, GapMissingAtSink, GapDuplicate, GapUnrecorded}

// IDRange is the ids From to To, both included.
type IDRange struct{ From, To int64 }

func (r IDRange) String() string {
	if r.From == r.To {
		return fmt.Sprint(r.From)
	}
	return fmt.Sprintf("%d-%d", r.From, r.To)
}

// DatabaseGapKinds are the kinds a verify without deep checks can find: the
// continuous verify's.
var DatabaseGapKinds = GapKinds[:4]

// VerifyReport is what Verify found.
type VerifyReport struct {
	// AsOf is the database's clock when the check began; stuck is judged
	// against it.
	AsOf  time.Time  `json:"as_of"`
	Since *time.Time `json:"since,omitempty"`
	// IDs is the window's id ranges; FirstID and LastID the ids of the
	// first and last row checked (0 when none was).
	IDs     []IDRange `json:"-"`
	IDsText string    `json:"ids"`
	FirstID int64     `json:"first_id"`
	LastID  int64     `json:"last_id"`
	// Rows counts the outbox rows checked.
	Rows       int64         `json:"rows"`
	StuckAfter time.Duration `json:"-"`
	Sinks      []*SinkTally  `json:"sinks"`
	Gaps       []*GapGroup   `json:"gaps"`
	// Notes say what could not be checked, and why.
	Notes []string      `json:"notes"`
	Took  time.Duration `json:"-"`

	sql    reportSQL
	listed int
}

// SinkTally counts a sink's pairs in the window by what the record says.
type SinkTally struct {
	Sink string `json:"sink"`
	// Routed counts the rows routed to the sink; each is one of Delivered
	// (a delivered ledger row), Missing, DeadLettered, Held, Discarded,
	// OnItsWay (pending or processing) or Other (a status the relay does
	// not write).
	Routed       int64 `json:"routed"`
	Delivered    int64 `json:"delivered"`
	Missing      int64 `json:"missing"`
	DeadLettered int64 `json:"dead_lettered"`
	Held         int64 `json:"held"`
	Discarded    int64 `json:"discarded"`
	OnItsWay     int64 `json:"on_its_way"`
	Other        int64 `json:"other_status"`
	// Receiver counts the delivered keys the receiver's table was asked
	// about (ReceiverQuery); Stream is the stream's audit.
	Receiver *int64       `json:"receiver_checked,omitempty"`
	Stream   *StreamTally `json:"stream,omitempty"`
}

// GapGroup is the gaps of one kind at one sink ("" for a stuck row, which
// concerns the row).
type GapGroup struct {
	Kind  GapKind `json:"kind"`
	Sink  string  `json:"sink,omitempty"`
	Count int64   `json:"count"`
	// First lists the first gaps found (VerifyOptions.Listed).
	First []Gap `json:"first"`
	// SQL lists them all, when SQL can (not the deep checks').
	SQL string `json:"sql,omitempty"`
}

// Gap is one gap.
type Gap struct {
	// ID is the outbox row's id; 0 for an orphaned ledger row and for a
	// copy at a sink whose row is gone.
	ID       int64  `json:"id,omitempty"`
	EventKey string `json:"event_key"`
	Detail   string `json:"detail,omitempty"`
}

// Clean reports whether no gap was found.
func (r *VerifyReport) Clean() bool { return len(r.Gaps) == 0 }

// Count returns the gaps of kind at every sink.
func (r *VerifyReport) Count(kind GapKind) int64 {
	var n int64
	for _, g := range r.Gaps {
		if g.Kind == kind {
			n += g.Count
		}
	}
	return n
}

// add records one gap.
func (r *VerifyReport) add(kind GapKind, sink string, g Gap) {
	r.addCount(kind, sink, 1, &g)
}

// addCount records n gaps of kind at sink, listing g (if not nil) among
// the first.
func (r *VerifyReport) addCount(kind GapKind, sink string, n int64, g *Gap) {
	var group *GapGroup
	for _, x := range r.Gaps {
		if x.Kind == kind && x.Sink == sink {
			group = x
			break
		}
	}
	if group == nil {
		group = &GapGroup{Kind: kind, Sink: sink, First: []Gap{}, SQL: r.sql.forKind(kind, sink)}
		r.Gaps = append(r.Gaps, group)
		slices.SortStableFunc(r.Gaps, func(a, b *GapGroup) int {
			if c := slices.Index(GapKinds, a.Kind) - slices.Index(GapKinds, b.Kind); c != 0 {
				return c
			}
			return strings.Compare(a.Sink, b.Sink)
		})
	}
	group.Count += n
	if g != nil && (r.listed < 0 || len(group.First) < r.listed) {
		group.First = append(group.First, *g)
	}
}

func (r *VerifyReport) tally(sink string) *SinkTally {
	for _, t := range r.Sinks {
		if t.Sink == sink {
			return t
		}
	}
	return nil
}

// addGroup records n gaps of kind at sink, of which first are listed.
func (r *VerifyReport) addGroup(kind GapKind, sink string, n int64, first []Gap) {
	if n == 0 {
		return
	}
	for _, g := range first {
		r.addCount(kind, sink, 1, &g)
	}
	r.addCount(kind, sink, n-int64(len(first)), nil)
}
