package relay

import (
	"context"
	"errors"
	"fmt"
)

// Refused events: an event whose deliveries the ledger cannot record is
// never sent. It keeps no pairs — nothing is claimed in the ledger, queued
// in a lane or sent — and is dead-lettered with the reason (status failed,
// last_error), like any event that can never be delivered
// (docs/guarantees.md, "bad input never stops the stream"). The check is
// made here, where every event of every path becomes a Work (route), so no
// path can send one: a sink's acknowledgement that cannot be written down
// would be sent again and again.

// unrecordable returns why the ledger cannot record ev's deliveries, or "".
func unrecordable(ev *Event) string {
	if n := len(ev.EventKey); n > MaxEventKeyBytes {
		return fmt.Sprintf("event_key is %d bytes; the ledger holds at most %d (docs/schema.md, \"Key lengths\")", n, MaxEventKeyBytes)
	}
	return ""
}

// refuse drops w's pairs: w is dead-lettered unsent with reason.
func (w *Work) refuse(reason string) {
	w.refused = ShortError(reason)
	w.Pairs, w.lanes = nil, nil
}

// prepareIsolating runs prepare (a store's Prepare) over works. When the
// store refuses a row's data (ErrRowData: PostgreSQL refused a ledger
// claim because of one row's data), it prepares each half of the batch on
// its own, down to the rows at fault, which are refused with the store's
// error: the rows prepared with them go on. Any other error is returned,
// the parts of the batch prepared before it staying prepared.
func (e *Engine) prepareIsolating(ctx context.Context, works []*Work, prepare func(context.Context, []*Work) error) error {
	err := prepare(ctx, works)
	if err == nil || !errors.Is(err, ErrRowData) {
		return err
	}
	if len(works) > 1 {
		half := len(works) / 2
		if err := e.prepareIsolating(ctx, works[:half], prepare); err != nil {
			return err
		}
		return e.prepareIsolating(ctx, works[half:], prepare)
	}
	w := works[0]
	e.log.Error().Err(err).Int64("id", w.Event.ID).Str("event_key", w.Event.EventKey).
		Msg("the ledger refused this event's claims: it is dead-lettered without being sent; the events beside it go on")
	w.refuse("its ledger claims were refused: " + err.Error())
	return nil
}
