package replication_test

import (
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-relay/outbox-relay/relay"
)

// TestWalSenderLagObservedPerTransaction: every streamed transaction's
// Commit adds one observation of commit → walsender send to
// walsender_lag_seconds, the server's share of decode_latency_seconds, and
// reports it to the consumer (Sent: the claim path yields to a lagging
// stream, docs/architecture.md).
func TestWalSenderLagObservedPerTransaction(t *testing.T) {
	count := func() (uint64, float64) {
		var m dto.Metric
		if err := relay.WalSenderLag.Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
	}
	e := newEnv(t)
	c := &fakeConsumer{}
	start(t, e.config(t, c, &fakeCheckpoint{}, &claimRecorder{url: e.url}))
	waitStreaming(t, c, 1)
	before, sumBefore := count()
	keys := []string{"lag-1", "lag-2", "lag-3", "lag-4", "lag-5"}
	for _, k := range keys {
		e.insert(t, k)
	}
	waitFor(t, 10*time.Second, "the events", func() bool { return c.commitOf(keys[len(keys)-1]) != 0 })
	after, sumAfter := count()
	if after-before < uint64(len(keys)) {
		t.Fatalf("%d walsender_lag_seconds observations for %d transactions", after-before, len(keys))
	}
	if lag := sumAfter - sumBefore; lag < 0 || lag > 10*float64(len(keys)) {
		t.Fatalf("walsender lag summed to %.3f s over %d transactions", lag, len(keys))
	}
	if n, sum := c.sentLags(); n < len(keys) || sum < 0 || sum > 10*time.Second*time.Duration(len(keys)) {
		t.Fatalf("the consumer heard %d walsender lags (summing to %s) for %d transactions", n, sum, len(keys))
	}
}
