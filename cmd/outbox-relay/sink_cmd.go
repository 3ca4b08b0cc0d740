package main

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// newSinkCommand is `sink pause|resume NAME` (docs/operations.md, "Pause
// and resume a sink"): the same code as the admin API's
// /api/v1/sinks/{name}/pause and /resume (admin.PauseSink, ResumeSink).
func newSinkCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "sink",
		Short: "Pause or resume delivery to one sink",
		Args:  noArgs,
	}
	cmd.AddCommand(newSinkPauseCommand(g), newSinkResumeCommand(g))
	return cmd
}

func newSinkPauseCommand(g *globals) *cobra.Command {
	var reason string
	cmd := &cobra.Command{
		Use:   "pause NAME [--reason TEXT]",
		Short: "Stop delivering to a sink until it is resumed",
		Long: `Pause records in the database that no relay sends to the sink NAME: every relay on the
outbox notices within a second, across restarts and leader changes, until ` + "`sink resume NAME`" + `.
The sink's events are diverted to the claim path without an attempt and wait there; the other
sinks keep receiving, and the replication slot keeps advancing. After the resume they are
delivered in per-aggregate order.`,
		Args: exactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return sinkChange(cmd, g, func(ctx pauseContext) error {
				p, already, err := admin.PauseSink(ctx.cmd.Context(), ctx.pool, ctx.tables, args[0], reason, operator())
				if err != nil {
					return ctx.sinkError(err)
				}
				if already {
					fmt.Fprintf(cmd.OutOrStdout(), "sink %s was already paused (since %s%s)\n", p.Sink, p.PausedAt.UTC().Format(time.RFC3339), reasonNote(p.Reason))
					return nil
				}
				fmt.Fprintf(cmd.OutOrStdout(), "sink %s paused: its events wait with the claim path until `outbox-relay sink resume %s`\n", p.Sink, p.Sink)
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why the sink is paused: status and the console show it")
	return cmd
}

func newSinkResumeCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "resume NAME",
		Short: "Deliver to a paused sink again",
		Long: `Resume removes the sink's pause: every relay sends to it again within a second, and the events
it held are delivered by the claim path in per-aggregate order.`,
		Args: exactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return sinkChange(cmd, g, func(ctx pauseContext) error {
				since, was, err := admin.ResumeSink(ctx.cmd.Context(), ctx.pool, ctx.tables, args[0])
				if err != nil {
					return ctx.sinkError(err)
				}
				if !was {
					fmt.Fprintf(cmd.OutOrStdout(), "sink %s was not paused\n", args[0])
					return nil
				}
				fmt.Fprintf(cmd.OutOrStdout(), "sink %s resumed after %s paused: the events it held are delivered in per-aggregate order\n", args[0], roundDuration(time.Since(since)))
				return nil
			})
		},
	}
}

// pauseContext is what a sink command's change needs.
type pauseContext struct {
	cmd    *cobra.Command
	pool   admin.DB
	tables admin.Tables
}

// sinkError makes an unknown sink a usage error (exit 2).
func (pauseContext) sinkError(err error) error {
	if errors.Is(err, admin.ErrNoSuchSink) {
		return usageError{err}
	}
	return err
}

// sinkChange connects as the operator commands do and runs change.
func sinkChange(cmd *cobra.Command, g *globals, change func(pauseContext) error) error {
	cfg, err := g.loadOpsConfig()
	if err != nil {
		return err
	}
	pool, tables, err := connectOps(cmd.Context(), cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	return change(pauseContext{cmd: cmd, pool: pool, tables: tables})
}

// operator names who runs a command, for the record of a pause:
// user@host.
func operator() string {
	name := "unknown"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	host, _ := os.Hostname()
	return name + "@" + host
}

// reasonNote is ": reason" or nothing.
func reasonNote(reason string) string {
	if reason == "" {
		return ""
	}
	return ": " + reason
}

// exactArgs requires n arguments, naming them, as a usage error (exit 2).
func exactArgs(n int, names string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usageError{fmt.Errorf("%s takes %s", cmd.CommandPath(), names)}
		}
		return nil
	}
}

// roundDuration rounds d for a message: to the second, or the millisecond
// under one.
func roundDuration(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(time.Second)
}
