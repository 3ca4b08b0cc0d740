package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

func newReplayCommand(g *globals) *cobra.Command {
	var (
		sel selectionFlags
		yes bool
	)
	cmd := &cobra.Command{
		Use:   "replay --since TIME | --ids 1,2 [--sink NAME]",
		Short: "Re-deliver events by time or id, optionally to one sink",
		Long: `Replay delivers settled events again (done, failed or held; pending and processing events
are on their way and are left alone). In one transaction per 1,000 events each chosen event
becomes pending, attempts 0, due now and diverted to the claim path, its replay count goes up,
and its ledger rows are deleted: every sink's, or with --sink only that sink's, so the claim
path re-delivers to that sink only — the other sinks keep their 'delivered' rows and are
skipped. (A sink that never got the event, a failed one say, has no such row and gets it too.)

NATS publishes a replay with the message id "<event_key>~r<n>" (n = the replay count) and
the original key in Outbox-Event-Key, so the stream's duplicate window does not swallow it.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if sel.since == "" && sel.ids == "" {
				return usageError{fmt.Errorf("say what to replay: --since TIME and/or --ids 1,2,3")}
			}
			return changeRows(cmd, g, &sel, yes, rowChange{
				action: admin.ActionReplay,
				question: func(n int, sink string) string {
					return fmt.Sprintf("Replay %s events to %s?", count(n), sinkScope(sink))
				},
				note: func(c changeContext) string {
					// Events in flight may match the filters too: say why they were not replayed.
					s := c.sel
					s.Statuses = admin.InFlightStatuses
					inFlight, err := admin.SelectIDs(c.ctx, c.pool, c.tables, s)
					if err != nil || len(inFlight) == 0 {
						return ""
					}
					return fmt.Sprintf("%s matching events are pending or processing: they are being delivered and were left alone", count(len(inFlight)))
				},
			})
		},
	}
	sel.register(cmd, "deliver again to this sink only: only its ledger rows are deleted; the other sinks keep theirs and are skipped", false, 0)
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation")
	return cmd
}
