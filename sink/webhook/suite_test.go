package webhook_test

import (
	"strconv"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay/sinktest"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

func TestSinkSuite(t *testing.T) {
	sinktest.Run(t, func(t *testing.T) *sinktest.Harness {
		rc := MustReceiver(t, nil)
		return &sinktest.Harness{
			Sink: MustSink(t, webhook.Config{URL: rc.URL}),
			Received: func() []sinktest.Message {
				var msgs []sinktest.Message
				for _, r := range rc.Requests() {
					attempt, _ := strconv.Atoi(r.Header.Get("Webhook-Attempt"))
					msgs = append(msgs, sinktest.Message{
						IdempotencyKey: r.Header.Get("Webhook-Id"),
						Body:           r.Body,
						Attempt:        attempt,
					})
				}
				return msgs
			},
		}
	})
}
