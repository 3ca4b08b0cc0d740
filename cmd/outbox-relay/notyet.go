package main

import (
	"fmt"

	"github.com/spf13/cobra"
)

// notYet is the body of a command whose issue has not landed: it says which
// issue brings it and exits with code 3, so scripts can tell it apart from a
// failure.
func notYet(what string) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		return fmt.Errorf("%s: %w (%s)", cmd.CommandPath(), errNotImplemented, what)
	}
}

func newDoctorCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "doctor",
		Short: "Check wal_level, privileges, publication, slot, sinks; print the fix for each failure",
		Args:  cobra.NoArgs,
		RunE:  notYet("lands with the operations issue"),
	}
}

func newStatusCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show mode, leader, slot, counts by status and per-sink deliveries",
		Args:  cobra.NoArgs,
		RunE:  notYet("lands with the operations issue"),
	}
	cmd.Flags().Bool("json", false, "print JSON")
	return cmd
}

func newDLQCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "List, retry or discard dead-lettered (failed) and held events",
	}
	for _, sub := range []struct{ use, short string }{
		{"list", "List failed and held events"},
		{"retry", "Reset failed events (and the chosen sinks' ledger rows) for delivery"},
		{"discard", "Mark failed events as discarded"},
	} {
		cmd.AddCommand(&cobra.Command{Use: sub.use, Short: sub.short, Args: cobra.NoArgs, RunE: notYet("lands with the operations issue")})
	}
	return cmd
}

func newReplayCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Re-deliver events by time or id, optionally to one sink",
		Args:  cobra.NoArgs,
		RunE:  notYet("lands with the operations issue"),
	}
	cmd.Flags().String("since", "", "replay events created at or after this time (RFC 3339)")
	cmd.Flags().String("ids", "", "replay these event ids (comma-separated)")
	cmd.Flags().String("sink", "", "replay to this sink only")
	cmd.Flags().Bool("yes", false, "do not ask for confirmation")
	return cmd
}

func newReconcileCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "reconcile",
		Short: "Hand long-pending rows the stream will never deliver to the claim path",
		Args:  cobra.NoArgs,
		RunE:  notYet("lands with the claim-path issue"),
	}
	cmd.Flags().Duration("older-than", 0, "rows pending longer than this")
	return cmd
}
