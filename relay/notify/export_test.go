package notify

import "context"

// RunPass is one pass, as Run makes one every interval.
func (n *Notifier) RunPass(ctx context.Context) error { return n.pass(ctx) }
