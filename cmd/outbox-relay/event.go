package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

func newEventCommand(g *globals) *cobra.Command {
	var (
		id     int64
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "event KEY | event --id N",
		Short: "Show what happened to one event: its row, its state and each sink's ledger row",
		Long: `Event looks up one event by its event_key (or --id) and shows its outbox row, what the
relay makes of it (with the stream, at the claim path and when it is due, being sent, delivered,
held, dead-lettered), the earlier event of its aggregate it waits behind, and for each sink
whether it is routed there (the sinks' events globs) and what the ledger records: state,
attempts, delivered_at, detail. It only reads. An event the outbox does not hold exits 1.`,
		Args: func(cmd *cobra.Command, args []string) error {
			byID := cmd.Flags().Changed("id")
			switch {
			case len(args) > 1:
				return usageError{fmt.Errorf("event takes one key, got %d arguments (quote a key with spaces)", len(args))}
			case byID && len(args) == 1:
				return usageError{errors.New("give a key or --id, not both")}
			case !byID && len(args) == 0:
				return usageError{errors.New("give the event's key (outbox-relay event KEY) or its id (--id N)")}
			case !byID && args[0] == "":
				return usageError{errors.New("the key is empty: an event's key never is")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			ref := admin.EventRef{ID: id}
			if len(args) == 1 {
				ref.Key = args[0]
			}
			cfg, err := g.loadOpsConfig()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			pool, tables, err := connectOps(ctx, cfg)
			if err != nil {
				return err
			}
			defer pool.Close()
			r, err := admin.LookupEvent(ctx, pool, tables, ref)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(r)
			}
			printEvent(cmd.OutOrStdout(), r, time.Now())
			return nil
		},
	}
	cmd.Flags().Int64Var(&id, "id", 0, "look the event up by its id instead of its key")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// printEvent renders r for a person. Every text from the table is printed
// on one line with its control characters escaped: a key or an error must
// not move the terminal's cursor.
func printEvent(w io.Writer, r admin.EventReport, now time.Time) {
	fmt.Fprintf(w, "event %d, key %s\n", r.ID, strconv.Quote(r.EventKey))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	line := func(k, format string, args ...any) { fmt.Fprintf(tw, "%s\t%s\n", k, fmt.Sprintf(format, args...)) }
	line("state:", "%s", describeEventState(r, now))
	line("type:", "%s", printable(r.EventType))
	if r.AggregateType == nil || r.AggregateID == nil {
		line("aggregate:", "%s / %s (unordered: a NULL aggregate waits behind nothing)", printable(r.AggregateType), printable(r.AggregateID))
	} else {
		line("aggregate:", "%s / %s", printable(r.AggregateType), printable(r.AggregateID))
	}
	if b := r.WaitsBehind; b != nil {
		line("waits behind:", "event %d, key %s (%s): an aggregate's events go out in id order (outbox-relay event --id %d)",
			b.ID, strconv.Quote(b.EventKey), b.Status, b.ID)
	}
	status := r.Status
	if status == "" {
		status = "NULL (the sweeper makes it pending)"
	}
	line("status:", "%s", status)
	line("attempts:", "%d", r.Attempts)
	if r.Replays > 0 {
		line("replays:", "%d (the sinks' idempotency ids end in ~r%d)", r.Replays, r.Replays)
	}
	line("last error:", "%s", printable(r.LastError))
	line("created:", "%s", when(r.CreatedAt, now))
	line("available:", "%s", when(r.AvailableAt, now))
	if r.DivertedAt != nil {
		line("diverted:", "%s", when(r.DivertedAt, now))
	}
	if r.LockedBy != nil || r.LockedAt != nil {
		line("claimed:", "%s by %s", when(r.LockedAt, now), printable(r.LockedBy))
	}
	line("processed:", "%s", when(r.ProcessedAt, now))
	if r.PayloadBytes == nil {
		line("payload:", "NULL (sent as JSON null)")
	} else {
		line("payload:", "%d bytes", *r.PayloadBytes)
	}
	tw.Flush()

	fmt.Fprintln(w)
	if len(r.Sinks) == 0 {
		fmt.Fprintln(w, "sinks: none configured, and no ledger row")
		return
	}
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SINK\tROUTED\tDELIVERED\tLEDGER\tATTEMPTS\tAT\tDETAIL")
	for _, s := range r.Sinks {
		routed := yesNo(s.Routed)
		if !s.Configured {
			routed = "not configured"
		}
		state, attempts, at, detail := "-", "-", "-", "-"
		if l := s.Ledger; l != nil {
			state, attempts, detail = l.State, strconv.Itoa(int(l.Attempts)), printable(l.Detail)
			switch {
			case l.DeliveredAt != nil:
				at = "delivered " + when(l.DeliveredAt, now)
			case l.NextAttemptAt != nil:
				at = "next attempt " + when(l.NextAttemptAt, now)
			case l.ClaimedAt != nil:
				at = "claimed " + when(l.ClaimedAt, now)
				if l.Owner != nil {
					at += " by " + printable(l.Owner)
				}
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", printable(&s.Name), routed, yesNo(s.Delivered), state, attempts, at, detail)
	}
	tw.Flush()
	fmt.Fprintln(w, "(ROUTED: the sink's events globs take the event's type; LEDGER -: no ledger row for that sink)")
}

// describeEventState says in a sentence what the relay makes of r.
func describeEventState(r admin.EventReport, now time.Time) string {
	switch r.State {
	case admin.EventWithStream:
		return "pending with the stream: on its way, or waiting for the slot to send it"
	case admin.EventAtClaimPath:
		if r.AvailableAt != nil && r.AvailableAt.After(now) {
			return "at the claim path: due in " + roundAge(r.AvailableAt.Sub(now))
		}
		return "at the claim path: due now, the next claim takes it"
	case admin.EventProcessing:
		return "being sent by the claim path (claimed by " + printable(r.LockedBy) + ")"
	case admin.EventHeld:
		return fmt.Sprintf("held: an outcome is unknown at a sink that holds such events; outbox-relay dlq retry --ids %d sends it again, dlq discard --ids %d settles it", r.ID, r.ID)
	case admin.EventFailed:
		return fmt.Sprintf("dead-lettered (last error below); outbox-relay dlq retry --ids %d sends it again", r.ID)
	case admin.EventDone:
		return "done: delivered to every sink it is routed to"
	case admin.EventDiscarded:
		return "discarded by outbox-relay dlq discard: settled without delivery"
	}
	return fmt.Sprintf("status %s, which the relay does not write (a legacy poller's?)", strconv.Quote(r.Status))
}

// when prints t in UTC with its distance from now, or "-" for none.
func when(t *time.Time, now time.Time) string {
	if t == nil {
		return "-"
	}
	s := t.UTC().Format(time.RFC3339)
	if d := now.Sub(*t); d < 0 {
		return s + " (in " + roundAge(-d) + ")"
	}
	return s + " (" + roundAge(now.Sub(*t)) + " ago)"
}

// printable returns *s on one line with control characters escaped, or "-"
// for NULL.
func printable(s *string) string {
	if s == nil {
		return "-"
	}
	if !strings.ContainsFunc(*s, func(r rune) bool { return r < 0x20 || r == 0x7f || r == 0xfffd }) {
		return *s
	}
	q := strconv.Quote(*s)
	return q[1 : len(q)-1]
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
