package nats_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/relay/sinktest"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

func TestSinkSuite(t *testing.T) {
	sinktest.Run(t, func(t *testing.T) *sinktest.Harness {
		srv := natstest.Start(t)
		s := MustNew(t, testConfig(srv))
		js := MustJetStream(t, srv)
		return &sinktest.Harness{
			Sink:         s,
			Deduplicates: true,
			Received: func() []sinktest.Message {
				var got []sinktest.Message
				for _, m := range stored(t, js, testStream) {
					attempt, _ := strconv.Atoi(m.Headers().Get(natssink.HeaderAttempt))
					// A consumer deduplicates on the event key within the
					// deployment: the Msg-Id without the deployment's scope.
					key, ok := strings.CutPrefix(m.Headers().Get(jetstream.MsgIDHeader), scopedID(""))
					if !ok {
						t.Fatalf("Nats-Msg-Id %q is not scoped by the deployment %q", m.Headers().Get(jetstream.MsgIDHeader), testDeployment.ID)
					}
					got = append(got, sinktest.Message{
						IdempotencyKey: key,
						Body:           m.Data(),
						Attempt:        attempt,
					})
				}
				return got
			},
		}
	})
}
