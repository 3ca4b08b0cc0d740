package main

import (
	"context"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/relay/notify"
	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

// notifier is the dead-letter notifier (docs/operations.md, "Dead-letter
// notifications") that run starts beside its other workers when notify.url
// is set, and the webhook it posts to.
type notifier struct {
	*notify.Notifier
	sender *webhook.Notifier
}

// newNotifier returns the configured notifier, or nil when notify.url is
// empty. It fails when migrate has not created the notifier's table or the
// role may not write it, naming the fix. The caller closes it once the
// workers have stopped.
func (r *relayRun) newNotifier(ctx context.Context) (*notifier, error) {
	n := r.cfg.Notify
	if n.URL == "" {
		return nil, nil
	}
	store, err := admin.NewNotifyStore(ctx, r.pool, r.tables.Outbox, r.owner)
	if err != nil {
		return nil, err
	}
	a := n.Auth
	sender, err := webhook.NewNotifier(webhook.NotifierConfig{
		URL: n.URL.Reveal(), Format: string(n.Format), Timeout: time.Duration(n.Timeout), Headers: n.Headers,
		Auth:   webhook.Auth{Type: string(a.Type), Secret: a.Secret.Reveal(), Header: a.Header, Value: a.Value.Reveal(), Username: a.Username, Password: a.Password.Reveal()},
		Logger: r.log,
	})
	if err != nil {
		return nil, err
	}
	sinks := make([]string, len(r.routes))
	for i, rt := range r.routes {
		sinks[i] = rt.Sink.Name()
	}
	nt, err := notify.New(notify.Config{Store: store, Sender: sender, Sinks: sinks, Channels: n.Sinks,
		Interval: time.Duration(n.Interval), ConsoleURL: n.ConsoleURL, Logger: r.log})
	if err != nil {
		return nil, err
	}
	return &notifier{Notifier: nt, sender: sender}, nil
}

// close releases the webhook's connections.
func (n *notifier) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = n.sender.Close(ctx)
}
