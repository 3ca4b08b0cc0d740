package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/relay"
)

// downSink stands in for a sink that could not be opened at start because
// its server refused the relay's credentials. Every event would fail alike,
// so, as with a webhook's 401, that is a sink-level failure and not a reason
// to stop delivering to the other sinks: each Send fails at once as
// SinkDown, the events wait on the claim path without counting attempts, and
// /readyz names the sink until a restart with fixed credentials opens it.
type downSink struct {
	name string
	err  error // why the sink is down, with the fix
}

var _ relay.Sink = (*downSink)(nil)

// newDownSink returns the stand-in for the sink name whose opening failed
// with err.
func newDownSink(name string, err error) *downSink {
	return &downSink{name: name, err: fmt.Errorf("%w: the server refused the sink's credentials at start; "+
		"fix them (token, token_file, creds_file, nkey_file or the user in url) and restart the relay", err)}
}

// Name returns the sink's configured name.
func (d *downSink) Name() string { return d.name }

// Send sends nothing: it calls done at once with a SinkDown error saying why.
func (d *downSink) Send(_ context.Context, dl *relay.Delivery, done func(error)) {
	done(relay.SinkDownError(fmt.Errorf("event %s not sent: %w", dl.Event.EventKey, d.err), 0))
}

// Close does nothing: nothing was opened.
func (d *downSink) Close(context.Context) error { return nil }

// credentialsRefused reports whether err is a NATS server refusing the
// client's credentials (wrong, expired or revoked).
func credentialsRefused(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired)
}
