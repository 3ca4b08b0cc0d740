package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/ledger"
)

func newReconcileCommand(g *globals) *cobra.Command {
	var olderThan durationFlag
	cmd := &cobra.Command{
		Use:   "reconcile --older-than D",
		Short: "Divert long-pending rows the stream will never deliver to the claim path",
		Long: `Reconcile marks rows that are still pending, not diverted, and older than --older-than
for the claim path. Use it when the sweep_after alarm names rows never streamed: the slot was
dropped and recreated by someone else while the relay was down, and the rows it skipped are never
streamed. (Rows the alarm counts in flight or not received yet arrive by themselves.)
The ledger prevents double delivery if the stream did deliver some of them.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if olderThan <= 0 {
				return usageError{fmt.Errorf("--older-than is required (for example --older-than 10m)")}
			}
			cfg, err := g.loadOpsConfig()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			pool, resolved, err := connectOps(ctx, cfg)
			if err != nil {
				return err
			}
			defer pool.Close()
			tables := cfg.Tables()
			tables.Outbox, tables.Ledger, tables.Checkpoint = resolved.Outbox, resolved.Ledger, resolved.Checkpoint
			lcfg := ledger.DefaultConfig()
			lcfg.Outbox, lcfg.Ledger, lcfg.Checkpoint = tables.Outbox, tables.Ledger, tables.Checkpoint
			store, err := ledger.New(pool, lcfg)
			if err != nil {
				return err
			}
			n, err := store.Reconcile(ctx, olderThan.Duration())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "handed %d rows pending longer than %s to the claim path\n", n, olderThan.Duration())
			return nil
		},
	}
	cmd.Flags().Var(&olderThan, "older-than", "rows pending longer than this (e.g. 10m, 2h)")
	return cmd
}
