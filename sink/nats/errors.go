package nats

import (
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/relay"
)

// ErrClosed is the cause of the SinkDown error a Send gets after Close.
var ErrClosed = errors.New("nats sink closed")

// classifyPublishError classifies an error PublishMsgAsync returned: the
// message was not handed to the connection, so nothing was stored.
func classifyPublishError(key string, err error) error {
	err = fmt.Errorf("publish %s: %w", key, err)
	switch {
	case errors.Is(err, nats.ErrMaxPayload):
		return relay.PermanentError(err)
	case errors.Is(err, nats.ErrConnectionClosed),
		errors.Is(err, nats.ErrConnectionReconnecting),
		errors.Is(err, nats.ErrConnectionDraining),
		errors.Is(err, nats.ErrReconnectBufExceeded),
		errors.Is(err, nats.ErrInvalidConnection):
		return relay.SinkDownError(err, 0)
	default:
		return relay.TransientError(err, 0)
	}
}

// classifyAckError classifies the error a PubAckFuture resolved with: the
// message was written to the connection, so unless the server answered with
// a refusal it may have been stored.
func classifyAckError(key string, err error) error {
	err = fmt.Errorf("publish %s: %w", key, err)
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, jetstream.ErrNoStreamResponse), errors.Is(err, nats.ErrNoResponders):
		// No stream listens on the subject (deleted, or JetStream not
		// ready after a restart): nothing was stored, and every event
		// would fail alike.
		return relay.SinkDownError(err, 0)
	case errors.As(err, &apiErr):
		switch apiErr.ErrorCode {
		case jetstream.JSErrCodeStreamNotFound, jetstream.JSErrCodeJetStreamNotEnabled,
			jetstream.JSErrCodeJetStreamNotEnabledForAccount:
			return relay.SinkDownError(err, 0)
		case jetstream.JSErrCodeStreamMessageExceedsMaximum, jsErrCodeStreamHeaderExceedsMaximum:
			return relay.PermanentError(err)
		default:
			// The stream refused the message (limits, storage, a
			// leader election): not stored, safe to retry.
			return relay.TransientError(err, 0)
		}
	default:
		// Ack timeout, connection lost or closed after the publish, an
		// unreadable ack: the message may have been stored. The retry
		// carries the same Nats-Msg-Id, so JetStream drops it as a
		// duplicate within the stream's duplicate window.
		return relay.UnknownError(err)
	}
}

// jsErrCodeStreamHeaderExceedsMaximum is nats-server's
// JSStreamHeaderExceedsMaximumErr ("header size exceeds maximum allowed of
// 64k"), which nats.go does not name.
const jsErrCodeStreamHeaderExceedsMaximum jetstream.ErrorCode = 10097
