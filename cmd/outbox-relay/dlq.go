package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// defaultListLimit is how many rows dlq list shows without --limit.
const defaultListLimit = 100

// noArgs is cobra.NoArgs as a usage error (exit code 2).
func noArgs(cmd *cobra.Command, args []string) error {
	if err := cobra.NoArgs(cmd, args); err != nil {
		return usageError{err}
	}
	return nil
}

// selectionFlags are the filters dlq and replay share.
type selectionFlags struct {
	sink      string
	eventType string
	since     string
	ids       string
	limit     int
	status    string // dlq list and retry: --status
}

// registerStatus adds --status: which of the dead-letter queue's statuses
// (admin.DLQStatuses) dlq list and retry take, failed and held unless told.
func (f *selectionFlags) registerStatus(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.status, "status", strings.Join(admin.DeadStatuses, ","),
		"only events with these statuses (comma-separated: "+strings.Join(admin.DLQStatuses, ", ")+")")
}

// statuses reads --status.
func (f *selectionFlags) statuses() ([]string, error) {
	var out []string
	for part := range strings.SplitSeq(f.status, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		if !slices.Contains(admin.DLQStatuses, part) {
			return nil, usageError{fmt.Errorf("--status %q: want %s", part, strings.Join(admin.DLQStatuses, ", "))}
		}
		if !slices.Contains(out, part) {
			out = append(out, part)
		}
	}
	if len(out) == 0 {
		return nil, usageError{fmt.Errorf("--status: no status given (%s)", strings.Join(admin.DLQStatuses, ", "))}
	}
	return out, nil
}

func (f *selectionFlags) register(cmd *cobra.Command, sinkHelp string, withLimit bool, limitDefault int) {
	if sinkHelp != "" {
		cmd.Flags().StringVar(&f.sink, "sink", "", sinkHelp)
	}
	cmd.Flags().StringVar(&f.eventType, "event-type", "", `only event types matching this glob ("order.*"); a NULL type matches only "*"`)
	cmd.Flags().StringVar(&f.since, "since", "", "only events created at or after this time: RFC 3339 (2026-01-02T15:04:05Z), a date (2026-01-02, UTC) or a duration ago (24h)")
	cmd.Flags().StringVar(&f.ids, "ids", "", "only these event ids (comma-separated: 1,2,3)")
	if withLimit {
		cmd.Flags().IntVar(&f.limit, "limit", limitDefault, "at most this many events, oldest id first (0: all)")
	}
}

// selection turns the flags into an admin.Selection over statuses.
func (f *selectionFlags) selection(cfg *config.Config, statuses []string, now time.Time) (admin.Selection, error) {
	sel := admin.Selection{Statuses: statuses, EventType: f.eventType, Limit: f.limit}
	if f.limit < 0 {
		return sel, usageError{fmt.Errorf("--limit must be 0 (all) or more, got %d", f.limit)}
	}
	if f.eventType != "" {
		if _, err := path.Match(f.eventType, ""); err != nil {
			return sel, usageError{fmt.Errorf("--event-type %q is not a valid glob (path.Match syntax: *, ?, [a-z])", f.eventType)}
		}
	}
	if f.since != "" {
		t, err := parseSince(f.since, now)
		if err != nil {
			return sel, usageError{err}
		}
		sel.Since = t
	}
	if f.ids != "" {
		ids, err := parseIDs(f.ids)
		if err != nil {
			return sel, usageError{err}
		}
		sel.IDs = ids
	}
	if f.sink != "" {
		s, err := findSink(cfg, f.sink)
		if err != nil {
			return sel, err
		}
		sel.Routes, sel.Filter = s.Events, s.CompiledFilter()
	}
	return sel, nil
}

// parseSince reads --since (admin.ParseSince).
func parseSince(s string, now time.Time) (time.Time, error) {
	t, err := admin.ParseSince(s, now)
	if err != nil {
		return t, fmt.Errorf("--since %w", err)
	}
	return t, nil
}

// parseIDs reads --ids: comma-separated ids, each once.
func parseIDs(s string) ([]int64, error) {
	var ids []int64
	seen := map[int64]bool{}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		id, err := strconv.ParseInt(part, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("--ids: %q is not an event id", part)
		}
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		return nil, errors.New("--ids: no ids given")
	}
	return ids, nil
}

func newDLQCommand(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "List, retry or discard dead-lettered (failed) and held events",
		Long: `The dead-letter queue is the outbox rows with status failed (a permanent error, or
max_attempts used up; they do not block their aggregate) and held (the outcome of a send is
unknown and the sink has on_unknown: hold; they block their aggregate until a person decides).

  list     show them, with each sink's ledger state
  retry    make them deliverable again: status pending, attempts 0, due now, diverted to the claim
           path; their ledger rows that are not 'delivered' are cleared (every sink, or --sink)
  discard  settle them without delivery: status discarded, last_error kept

list and retry take discarded events too with --status discarded. retry and discard ask for
confirmation unless --yes, and work in transactions of 1,000 rows.`,
	}
	cmd.AddCommand(newDLQListCommand(g), newDLQRetryCommand(g), newDLQDiscardCommand(g))
	return cmd
}

func newDLQListCommand(g *globals) *cobra.Command {
	var (
		sel    selectionFlags
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List failed and held events (or discarded ones) with each sink's ledger state",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			statuses, err := sel.statuses()
			if err != nil {
				return err
			}
			cfg, err := g.loadOpsConfig()
			if err != nil {
				return err
			}
			s, err := sel.selection(cfg, statuses, time.Now())
			if err != nil {
				return err
			}
			s.NotDeliveredTo = sel.sink
			ctx := cmd.Context()
			pool, tables, err := connectOps(ctx, cfg)
			if err != nil {
				return err
			}
			defer pool.Close()
			page, err := admin.ListPage(ctx, pool, tables, s)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(page.Entries)
			}
			printDLQ(cmd.OutOrStdout(), page.Entries, configuredSinks(cfg), statuses)
			if page.More {
				fmt.Fprintf(cmd.OutOrStdout(), "showing the first %d; --limit N (0: all) shows more\n", sel.limit)
			}
			return nil
		},
	}
	sel.register(cmd, "only events routed to this sink and not delivered to it", true, defaultListLimit)
	sel.registerStatus(cmd)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (full last_error and ledger rows)")
	return cmd
}

// printDLQ prints entries, chosen among statuses, as a table; the sinks
// column shows each sink that takes the event, and any other sink the
// ledger names.
func printDLQ(w io.Writer, entries []admin.Entry, sinks []config.SinkConfig, statuses []string) {
	if len(entries) == 0 {
		fmt.Fprintf(w, "no %s events match\n", strings.Join(statuses, " or "))
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATUS\tATTEMPTS\tTYPE\tAGGREGATE\tKEY\tSINKS\tLAST ERROR")
	counts := map[string]int{}
	cut := false
	for _, e := range entries {
		counts[e.Status]++
		states := map[string]string{}
		for _, l := range e.Ledger {
			states[l.Action] = l.State
		}
		var cells []string
		for _, s := range sinks {
			if !(admin.Sink{Events: s.Events, Filter: s.CompiledFilter()}).Takes(e.Event()) {
				continue
			}
			state := states[s.Name]
			if state == "" {
				state = "-"
			}
			cells = append(cells, s.Name+"="+state)
			delete(states, s.Name)
		}
		for _, name := range sortedKeys(states) {
			cells = append(cells, name+"="+states[name])
		}
		agg := orDash(e.AggregateType) + "/" + orDash(e.AggregateID)
		lastError := excerpt(orDash(e.LastError), lastErrorWidth)
		cut = cut || lastError != orDash(e.LastError)
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", e.ID, e.Status, e.Attempts, excerpt(orDash(e.EventType), 32),
			excerpt(agg, 32), excerpt(e.EventKey, 36), strings.Join(cells, " "), lastError)
	}
	tw.Flush()
	var byStatus []string
	for _, st := range statuses {
		byStatus = append(byStatus, fmt.Sprintf("%d %s", counts[st], st))
	}
	fmt.Fprintf(w, "%d events: %s (- : no ledger row for that sink)\n", len(entries), strings.Join(byStatus, ", "))
	if cut {
		fmt.Fprintln(w, "errors are cut to their first line and "+strconv.Itoa(lastErrorWidth)+" characters: dlq list --json shows every error whole")
	}
}

// lastErrorWidth is how much of last_error the table shows: enough for a
// webhook error's prefix (sink, event key, status) and the start of the
// receiver's body, which says what it refused.
const lastErrorWidth = 240

func orDash(s *string) string {
	if s == nil {
		return "-"
	}
	return *s
}

// excerpt returns the first line of s, at most n runes, without control
// characters (a payload-derived error must not move the terminal's cursor).
func excerpt(s string, n int) string {
	if i := strings.IndexAny(s, "\r\n"); i >= 0 {
		s = s[:i] + " …"
	}
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-1]) + "…"
}

func newDLQRetryCommand(g *globals) *cobra.Command {
	var (
		sel selectionFlags
		yes bool
	)
	cmd := &cobra.Command{
		Use:   "retry",
		Short: "Make failed and held events (or discarded ones) deliverable again",
		Long: `Retry resets the chosen failed and held events (with --status, discarded ones too) —
status pending, attempts 0, available_at and handoff_at now (the claim path takes them, in
replication mode too), last_error cleared — and deletes their ledger rows that are not
'delivered' ('sending' claims, 'unknown' outcomes), for every sink or only --sink, in one
transaction per 1,000 events. Sinks that already have an event keep their 'delivered' row
and do not get it again.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			statuses, err := sel.statuses()
			if err != nil {
				return err
			}
			action := admin.ActionRetry
			action.Statuses = statuses
			return changeRows(cmd, g, &sel, yes, rowChange{
				action: action,
				question: func(n int, sink string) string {
					return fmt.Sprintf("Reset %s %s events to pending and clear their undelivered ledger rows for %s?", count(n), strings.Join(statuses, "/"), sinkScope(sink))
				},
				notDeliveredFilter: true,
			})
		},
	}
	sel.register(cmd, "only events routed to this sink and not delivered to it; only its undelivered ledger rows are cleared", true, 0)
	sel.registerStatus(cmd)
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation")
	return cmd
}

func newDLQDiscardCommand(g *globals) *cobra.Command {
	var (
		sel selectionFlags
		yes bool
	)
	cmd := &cobra.Command{
		Use:   "discard",
		Short: "Settle failed and held events without delivering them",
		Long: `Discard marks the chosen failed and held events as settled without delivering them: status
discarded, processed_at now, last_error kept. A discarded event no longer blocks its aggregate,
retention prunes it like a done one, and dlq list --status discarded, retry --status discarded
and replay take it. The ledger is left as it is.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return changeRows(cmd, g, &sel, yes, rowChange{
				action: admin.ActionDiscard,
				question: func(n int, _ string) string {
					return fmt.Sprintf("Discard %s failed/held events (status discarded, not delivered)?", count(n))
				},
				notDeliveredFilter: true,
			})
		},
	}
	sel.register(cmd, "only events routed to this sink and not delivered to it (every sink's ledger rows are kept)", true, 0)
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation")
	return cmd
}

func sinkScope(sink string) string {
	if sink == "" {
		return "every sink"
	}
	return "sink " + sink
}

// count formats n with thousands separators.
func count(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// confirm asks question on stderr and reads the answer from stdin; only
// "y" or "yes" goes ahead.
func confirm(cmd *cobra.Command, question string) error {
	fmt.Fprintf(cmd.ErrOrStderr(), "%s [y/N] ", question)
	line, err := bufio.NewReader(cmd.InOrStdin()).ReadString('\n')
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		return nil
	}
	if err != nil && strings.TrimSpace(line) == "" {
		fmt.Fprintln(cmd.ErrOrStderr())
		return usageError{errors.New("no answer on stdin: pass --yes to go ahead without asking")}
	}
	return errors.New("not confirmed: nothing changed")
}

// newProgress returns a progress bar on w for total rows, or nil when total
// fits in one batch.
func newProgress(w io.Writer, total int, what string) *progressbar.ProgressBar {
	if total <= admin.BatchSize {
		return nil
	}
	return progressbar.NewOptions(total,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(what),
		progressbar.OptionShowCount(),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionSetRenderBlankState(true),
		progressbar.OptionOnCompletion(func() { fmt.Fprintln(w) }),
	)
}

// changeContext is what a change's note needs.
type changeContext struct {
	ctx    context.Context
	pool   admin.DB
	tables admin.Tables
	sel    admin.Selection
}

// rowChange describes a change of the rows a selection chooses (retry,
// discard, replay).
type rowChange struct {
	action   admin.Action
	question func(n int, sink string) string
	// notDeliveredFilter: --sink also keeps only events not delivered to
	// that sink (the dead letters that concern it).
	notDeliveredFilter bool
	// note, computed before any change, adds a line after the summary.
	note func(c changeContext) string
}

// changeRows selects the rows, asks, and applies the change in batches of
// admin.BatchSize, one transaction each, with a progress bar for large sets.
func changeRows(cmd *cobra.Command, g *globals, sel *selectionFlags, yes bool, change rowChange) error {
	cfg, err := g.loadOpsConfig()
	if err != nil {
		return err
	}
	s, err := sel.selection(cfg, change.action.Statuses, time.Now())
	if err != nil {
		return err
	}
	if change.notDeliveredFilter {
		s.NotDeliveredTo = sel.sink
	}
	ctx := cmd.Context()
	pool, tables, err := connectOps(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	ids, err := admin.SelectIDs(ctx, pool, tables, s)
	if err != nil {
		return err
	}
	c := changeContext{ctx: ctx, pool: pool, tables: tables, sel: s}
	var sinks []string
	if sel.sink != "" {
		sinks = []string{sel.sink}
	}
	note := ""
	if change.note != nil {
		note = change.note(c)
	}
	out := cmd.OutOrStdout()
	printNote := func() {
		if note != "" {
			fmt.Fprintln(out, note)
		}
	}
	if len(ids) == 0 {
		fmt.Fprintf(out, "no events to %s: none matches\n", change.action.Name)
		printNote()
		return nil
	}
	if !yes {
		if err := confirm(cmd, change.question(len(ids), sel.sink)); err != nil {
			return err
		}
	}
	bar := newProgress(cmd.ErrOrStderr(), len(ids), change.action.Name)
	var progress func(int)
	if bar != nil {
		progress = func(n int) { _ = bar.Add(n) }
	}
	total, err := change.action.Apply(ctx, pool, tables, ids, sinks, progress)
	if err != nil {
		return err
	}
	if bar != nil {
		_ = bar.Finish()
	}
	fmt.Fprintf(out, "%s %s events", change.action.Done, count(int(total.Rows)))
	if total.LedgerRows > 0 {
		fmt.Fprintf(out, ", cleared %s ledger rows", count(int(total.LedgerRows)))
	}
	fmt.Fprintln(out)
	if skipped := len(ids) - int(total.Rows); skipped > 0 {
		fmt.Fprintf(out, "%s events changed status since they were selected and were left alone\n", count(skipped))
	}
	printNote()
	return nil
}
