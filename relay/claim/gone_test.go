package claim_test

import (
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/relay"
)

// goneRows reads outbox_relay_settle_gone_total for path.
func goneRows(t *testing.T, path relay.Path) float64 {
	t.Helper()
	families, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "outbox_relay_settle_gone_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "path" && l.GetValue() == string(path) {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestClaimedRowDeletedBeforeItsOutcome: a claimed row deleted before its
// outcome (here a retry, a write to the row) is written is settled as
// gone, counted like a stream row's (docs/guarantees.md, "Deleted rows and
// invisible rows"), and the claim path goes on: the next row of its
// aggregate is delivered. Before, the outcome was dropped without a trace.
func TestClaimedRowDeletedBeforeItsOutcome(t *testing.T) {
	f := MustFixture(t)
	f.MustInsert(t,
		event{Key: "doomed", AggType: "order", AggID: "A", Diverted: true, Age: time.Minute},
		event{Key: "after", AggType: "order", AggID: "A", Diverted: true, Age: time.Minute},
	)
	sink := newFakeSink("a", func(d *relay.Delivery) error {
		if d.Event.EventKey != "doomed" {
			return nil
		}
		f.MustExec(t, `DELETE FROM integration_outbox WHERE event_key = 'doomed'`)
		return relay.TransientError(errors.New("503 from the test"), 0)
	})
	before := goneRows(t, relay.PathClaim)
	MustStart(t, f, options{Routes: routes(sink), PollInterval: 50 * time.Millisecond})

	waitFor(t, 20*time.Second, "the row after the deleted one delivered", func() bool { return sink.Delivered()["after"] == 1 })
	waitFor(t, 5*time.Second, "the deleted row counted", func() bool { return goneRows(t, relay.PathClaim)-before == 1 })
}
