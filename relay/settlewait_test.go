package relay_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestWaitsForSettlementEndWhenNothingSettles: a wait for settlement that
// cannot finish — here an event whose row stays invisible and is never
// found deleted, so its outcome is never written — ends once nothing it
// waits for has settled for StallAfter, with an error that names what it
// waited for; it neither waits forever nor gives up on an event that
// settles within the bound (docs/guarantees.md, "Every wait has a bound").
// Before, WaitSettled and HandOverSettled waited for as long as it took:
// a replication session that recreates its slot, or records its
// hand-over, waited forever.
func TestWaitsForSettlementEndWhenNothingSettles(t *testing.T) {
	const stall = 300 * time.Millisecond
	for _, tc := range []struct {
		name string
		feed func(t *testing.T, e *relay.Engine, ev *relay.Event)
		wait func(e *relay.Engine) func(context.Context) error
		what string
	}{
		{"WaitSettled", func(t *testing.T, e *relay.Engine, ev *relay.Event) {
			ev.Xid = 1234
			submit(t, e.Stream(), ev)
		}, func(e *relay.Engine) func(context.Context) error { return e.WaitSettled }, "stream events"},
		{"HandOverSettled", func(t *testing.T, e *relay.Engine, ev *relay.Event) {
			if err := e.Stream().HandOver(context.Background(), []*relay.Event{ev}); err != nil {
				t.Fatal(err)
			}
		}, func(e *relay.Engine) func(context.Context) error { return e.Stream().HandOverSettled }, "hand-over rows"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := newFakeStore()
			store.invisibleFor[7] = 1 << 30 // its dead letter never finds the row
			store.invisibleFor[8] = 3       // not visible for a moment only
			sink := newFakeSink("s", func(d *relay.Delivery) error {
				return relay.PermanentError(errors.New("400 from the test"))
			})
			e := startEngine(t, relay.EngineConfig{Stream: store, Owner: "me", Routes: []relay.Route{{Sink: sink}}, StallAfter: stall})
			tc.feed(t, e, event(7, "a"))
			tc.feed(t, e, event(8, "b"))

			ctx, cancel := context.WithTimeout(context.Background(), 20*stall)
			defer cancel()
			began := time.Now()
			err := tc.wait(e)(ctx)
			took := time.Since(began)
			t.Logf("%s: %v after %v", tc.name, err, took.Round(time.Millisecond))
			if err == nil || ctx.Err() != nil {
				t.Fatalf("%s = %v after %v, want an error of its own within %v", tc.name, err, took.Round(time.Millisecond), 20*stall)
			}
			if took < stall {
				t.Errorf("%s ended after %v, before its bound %v", tc.name, took, stall)
			}
			for _, want := range []string{tc.what, "id 7", `"k7"`, stall.String()} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("%s error %q does not name %s", tc.name, err, want)
				}
			}
			if strings.Contains(err.Error(), "id 8") {
				t.Errorf("%s error %q names event 8, which settled", tc.name, err)
			}
		})
	}
}
