package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// gapsFound is verify's failure when it found gaps: exit code 1.
type gapsFound struct{ n int64 }

func (e gapsFound) Error() string {
	return fmt.Sprintf("verify found %d gaps (listed above)", e.n)
}

// verifyFlags are verify's command line.
type verifyFlags struct {
	since, ids, sink, receiverQuery string
	stuckAfter                      durationFlag
	deep, asJSON                    bool
	list                            int
}

func newVerifyCommand(g *globals) *cobra.Command {
	var f verifyFlags
	cmd := &cobra.Command{
		Use:   "verify --since DURATION|TIME | --ids 1,2,5-9 [--sink NAME] [--deep]",
		Short: "Prove over a window that no event was lost or repeated",
		Long: `Verify checks every outbox row of a window against the record: for each sink the row is
routed to (by the engine's own routing), a delivered ledger row, or a status that settles it
(failed, held, discarded), or the row still on its way. It reports:

  missing          a done row that a routed sink has no delivered ledger row for
  stuck            a row pending or processing, due longer ago than --stuck-after
  unrouted         a ledger row for a sink the row is not routed to (or not configured)
  orphaned         a ledger row whose outbox row is gone, though retention could not
                   have removed it yet (with --since only: a ledger row has no id)

--deep also reads what the sinks hold: a NATS sink's stream (every delivered event there,
under one id, and no event there the ledger does not know: missing_at_sink, duplicate,
unrecorded; replays are counted apart), and a webhook receiver's own table through
--receiver-query or the sink's receiver_query (missing_at_sink).

Exit codes: 0 no gap; 1 gaps found (the first ids of each kind and a query that lists all),
or verify could not check; 2 bad usage.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runVerifyCommand(cmd, g, &f) },
	}
	fl := cmd.Flags()
	fl.StringVar(&f.since, "since", "", "check rows created at or after this time: RFC 3339 (2026-01-02T15:04:05Z), a date (2026-01-02, UTC) or a duration ago (24h)")
	fl.StringVar(&f.ids, "ids", "", "check these event ids: comma-separated ids and ranges (1,2,5-9)")
	fl.StringVar(&f.sink, "sink", "", "check this sink only: its pairs and ledger rows")
	fl.Var(&f.stuckAfter, "stuck-after", "a row pending this long after it is due is stuck (default: source.sweep_after)")
	fl.BoolVar(&f.deep, "deep", false, "also read what the sinks hold: a NATS sink's stream, a webhook receiver's table (--receiver-query)")
	fl.StringVar(&f.receiverQuery, "receiver-query", "", "with --deep: SQL on the relay's database returning the event keys, among $1 (text[]), that the webhook sink's receiver applied (overrides the sink's receiver_query)")
	fl.BoolVar(&f.asJSON, "json", false, "print JSON")
	fl.IntVar(&f.list, "list", 10, "gaps listed per kind and sink (0: all)")
	return cmd
}

func runVerifyCommand(cmd *cobra.Command, g *globals, f *verifyFlags) error {
	opts := admin.VerifyOptions{Listed: f.list}
	switch {
	case f.since == "" && f.ids == "":
		return usageError{errors.New("say which window to verify: --since DURATION|TIME and/or --ids 1,2,5-9")}
	case f.list < 0:
		return usageError{fmt.Errorf("--list must be 0 (all) or more, got %d", f.list)}
	case f.list == 0:
		opts.Listed = -1
	case f.receiverQuery != "" && !f.deep:
		return usageError{errors.New("--receiver-query is a deep check: add --deep")}
	}
	if f.since != "" {
		t, err := parseSince(f.since, time.Now())
		if err != nil {
			return usageError{err}
		}
		opts.Since = t
		if f.ids == "" {
			opts.Orphans = &admin.OrphanWalk{Since: t}
		}
	}
	if f.ids != "" {
		ranges, err := parseIDRanges(f.ids)
		if err != nil {
			return usageError{err}
		}
		opts.IDs = ranges
	}
	// Reading a stream needs the sinks' credentials; the database checks
	// need only their names and routes.
	load := g.loadOpsConfig
	if f.deep {
		load = g.loadConfig
	}
	cfg, err := load()
	if err != nil {
		return err
	}
	if f.sink != "" {
		if _, err := findSink(cfg, f.sink); err != nil {
			return err
		}
		opts.Sink = f.sink
	}
	sinks := configuredSinks(cfg)
	if f.receiverQuery != "" {
		if err := applyReceiverQuery(sinks, f.sink, f.receiverQuery); err != nil {
			return err
		}
	}
	opts.StuckAfter = time.Duration(cfg.Source.SweepAfter)
	if cmd.Flags().Changed("stuck-after") {
		opts.StuckAfter = f.stuckAfter.Duration()
	}
	if cfg.Retention.Enabled {
		opts.RetentionDoneAfter = time.Duration(cfg.Retention.DoneAfter)
	}
	opts.Sinks = verifySinks(sinks, f.deep)

	ctx := cmd.Context()
	began := time.Now()
	pool, tables, err := connectOps(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	var notes []string
	if f.deep {
		scope, err := readMsgIDScope(ctx, pool, cfg, tables.Outbox)
		if err != nil {
			return err
		}
		closeStreams, n, err := openStreams(ctx, pool, tables, &opts, sinks, scope)
		defer closeStreams()
		if err != nil {
			return err
		}
		notes = n
	}
	rep, err := admin.Verify(ctx, pool, tables, opts)
	if err != nil {
		return err
	}
	rep.Notes = append(notes, rep.Notes...)
	rep.Took = time.Since(began) // the stream's reading included
	out := cmd.OutOrStdout()
	if f.asJSON {
		err = printVerifyJSON(out, rep)
	} else {
		printVerify(out, rep)
	}
	if err != nil {
		return err
	}
	if !rep.Clean() {
		var n int64
		for _, gg := range rep.Gaps {
			n += gg.Count
		}
		return gapsFound{n}
	}
	return nil
}

// applyReceiverQuery sets --receiver-query on the webhook sink it is for:
// --sink's, or the only webhook sink.
func applyReceiverQuery(sinks []config.SinkConfig, only, query string) error {
	var hooks []int
	for i, s := range sinks {
		if s.Type == config.SinkWebhook && (only == "" || s.Name == only) {
			hooks = append(hooks, i)
		}
	}
	switch {
	case len(hooks) == 0 && only != "":
		return usageError{fmt.Errorf("--receiver-query: sink %s is not a webhook sink", only)}
	case len(hooks) == 0:
		return usageError{errors.New("--receiver-query: no webhook sink is configured")}
	case len(hooks) > 1:
		return usageError{errors.New("--receiver-query: several webhook sinks are configured; say which with --sink")}
	case !strings.Contains(query, "$1"):
		return usageError{errors.New("--receiver-query must use $1, the text[] of event keys to look up")}
	}
	sinks[hooks[0]].Webhook.ReceiverQuery = query
	return nil
}

// verifySinks turns the configured sinks into verify's: their routes and,
// with deep, a webhook sink's receiver query.
func verifySinks(sinks []config.SinkConfig, deep bool) []admin.VerifySink {
	out := make([]admin.VerifySink, len(sinks))
	for i, s := range sinks {
		out[i] = admin.VerifySink{Name: s.Name, Route: relay.Route{Events: s.Events, Filter: s.CompiledFilter()}}
		if deep && s.Type == config.SinkWebhook {
			out[i].ReceiverQuery = s.Webhook.ReceiverQuery
		}
	}
	return out
}

// openStreams reads the stream of each NATS sink verify checks into a
// StreamAudit (sink/nats), from the window's start, and sets the audit to
// catch up after the outbox pass. It returns notes on the sinks it could
// not read for a reason that is no failure (an embedded server) and a
// function that closes the connections.
func openStreams(ctx context.Context, db admin.DB, t admin.Tables, o *admin.VerifyOptions, sinks []config.SinkConfig, scope msgIDScope) (func(), []string, error) {
	var readers []*natssink.StreamReader
	closeAll := func() {
		for _, r := range readers {
			r.Close()
		}
	}
	var notes []string
	start := o.Since
	for i, sc := range sinks {
		if sc.Type != config.SinkNATS || (o.Sink != "" && sc.Name != o.Sink) {
			if sc.Type == config.SinkWebhook && (o.Sink == "" || sc.Name == o.Sink) && sc.Webhook.ReceiverQuery == "" {
				notes = append(notes, fmt.Sprintf("sink %s: the receiver's own record is not checked: give --receiver-query or the sink's receiver_query", sc.Name))
			}
			continue
		}
		if sc.URL == "" {
			notes = append(notes, fmt.Sprintf("sink %s: its stream is not checked: the embedded NATS server lives inside the relay's process", sc.Name))
			continue
		}
		natsOpts, err := natsClientOptions(sc)
		if err != nil {
			return closeAll, nil, usageError{fmt.Errorf("sinks[%d] (%s): %w", i, sc.Name, err)}
		}
		dep, err := scope.deployment(i, sc)
		if err != nil {
			return closeAll, nil, err
		}
		r, err := natssink.OpenStream(ctx, natssink.ReaderConfig{URL: sc.URL, Options: natsOpts, Stream: sc.NATS.Stream.Name, Subject: sc.NATS.Subject, Deployment: dep.ID})
		if err != nil {
			return closeAll, nil, fmt.Errorf("verify --deep: sink %s: %w", sc.Name, err)
		}
		readers = append(readers, r)
		if start.IsZero() {
			if start, err = admin.WindowStart(ctx, db, t, o.IDs); err != nil {
				return closeAll, nil, err
			}
		}
		if start.IsZero() {
			notes = append(notes, fmt.Sprintf("sink %s: its stream is not read: the window has no row", sc.Name))
			continue
		}
		audit := admin.NewStreamAudit()
		if !r.FirstStored.IsZero() {
			first := r.FirstStored.UTC()
			audit.Tally.FirstStored = &first
			if r.Removed {
				audit.RemovedBefore = first
			}
		}
		add := func(ev natssink.StoredEvent) {
			audit.Add(admin.StreamCopy{EventKey: ev.EventKey, Replay: ev.Replay, MsgID: ev.MsgID, Stored: ev.Stored})
		}
		// The stream's clock and the database's may differ a little: a
		// minute earlier reads copies of events before the window too,
		// which are looked up, not judged missing.
		began := time.Now()
		if _, err := r.Read(ctx, start.Add(-time.Minute), add); err != nil {
			return closeAll, nil, fmt.Errorf("verify --deep: sink %s: %w", sc.Name, err)
		}
		audit.Tally.Foreign, audit.Tally.ReadSeconds = r.Foreign, time.Since(began).Seconds()
		audit.CatchUp = func(ctx context.Context) error {
			began := time.Now()
			_, err := r.Read(ctx, time.Time{}, add)
			audit.Tally.Foreign = r.Foreign
			audit.Tally.ReadSeconds += time.Since(began).Seconds()
			return err
		}
		o.Sinks[i].Stream = audit
	}
	return closeAll, notes, nil
}

// parseIDRanges reads --ids: comma-separated ids and ranges ("5-9").
func parseIDRanges(s string) ([]admin.IDRange, error) {
	var out []admin.IDRange
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		from, to, isRange := strings.Cut(part, "-")
		a, err := strconv.ParseInt(strings.TrimSpace(from), 10, 64)
		b := a
		if err == nil && isRange {
			b, err = strconv.ParseInt(strings.TrimSpace(to), 10, 64)
		}
		switch {
		case err != nil:
			return nil, fmt.Errorf("--ids: %q is not an id or a range of ids (5-9)", part)
		case b < a:
			return nil, fmt.Errorf("--ids: the range %q ends before it starts", part)
		}
		out = append(out, admin.IDRange{From: a, To: b})
	}
	if len(out) == 0 {
		return nil, errors.New("--ids: no ids given")
	}
	return admin.MergeRanges(out), nil
}

// printVerifyJSON prints the report as JSON.
func printVerifyJSON(w io.Writer, rep *admin.VerifyReport) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		Clean      bool    `json:"clean"`
		StuckAfter string  `json:"stuck_after"`
		Took       float64 `json:"took_seconds"`
		*admin.VerifyReport
	}{rep.Clean(), rep.StuckAfter.String(), math.Round(rep.Took.Seconds()*1000) / 1000, rep})
}

// printVerify prints the report for a person: the window, each sink's
// tally, the notes, then each kind of gap with its first rows and the
// query that lists them all.
func printVerify(w io.Writer, rep *admin.VerifyReport) {
	window := "ids " + rep.IDsText
	if rep.IDsText == "" {
		window = "no ids"
	}
	if rep.Since != nil {
		window += ", created since " + rep.Since.Format(time.RFC3339)
	}
	fmt.Fprintf(w, "verify: %s rows (%s); as of %s, stuck after %s; took %s\n", count(int(rep.Rows)), window,
		rep.AsOf.UTC().Format(time.RFC3339), rep.StuckAfter, rep.Took.Round(time.Millisecond))
	for _, t := range rep.Sinks {
		parts := []string{count(int(t.Delivered)) + " delivered"}
		for _, p := range []struct {
			n    int64
			what string
		}{{t.Missing, "missing"}, {t.DeadLettered, "dead-lettered"}, {t.Held, "held"}, {t.Discarded, "discarded"}, {t.OnItsWay, "on their way"}, {t.Other, "in another status"}} {
			if p.n > 0 {
				parts = append(parts, count(int(p.n))+" "+p.what)
			}
		}
		fmt.Fprintf(w, "  sink %s: %s routed: %s\n", t.Sink, count(int(t.Routed)), strings.Join(parts, ", "))
		if s := t.Stream; s != nil {
			fmt.Fprintf(w, "    stream: %s copies read (%s replays, %s repeats under the same id, %s other messages)",
				count(int(s.Read)), count(int(s.Replays)), count(int(s.Repeats)), count(int(s.Foreign)))
			if s.NotCheckable > 0 {
				fmt.Fprintf(w, "; %s delivered rows older than its first message not checked", count(int(s.NotCheckable)))
			}
			fmt.Fprintln(w)
		}
		if t.Receiver != nil {
			fmt.Fprintf(w, "    receiver's table: %s delivered events looked up\n", count(int(*t.Receiver)))
		}
	}
	for _, n := range rep.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
	if rep.Clean() {
		fmt.Fprintln(w, "clean: nothing missing, stuck, unrouted or orphaned")
		return
	}
	for _, gg := range rep.Gaps {
		where := ""
		if gg.Sink != "" {
			where = " at " + gg.Sink
		}
		fmt.Fprintf(w, "%s%s: %s\n", strings.ToUpper(string(gg.Kind)), where, count(int(gg.Count)))
		for _, g := range gg.First {
			id := "-"
			if g.ID != 0 {
				id = strconv.FormatInt(g.ID, 10)
			}
			fmt.Fprintf(w, "  %s\t%s\t%s\n", id, excerpt(g.EventKey, 48), g.Detail)
		}
		if more := gg.Count - int64(len(gg.First)); more > 0 {
			fmt.Fprintf(w, "  … and %s more\n", count(int(more)))
		}
		if gg.SQL != "" {
			fmt.Fprintf(w, "  all of them:\n    %s\n", strings.ReplaceAll(gg.SQL, "\n", "\n    "))
		} else if gg.Count > int64(len(gg.First)) {
			fmt.Fprintln(w, "  all of them: --list 0 --json")
		}
	}
}

// continuousPause is how long the continuous verify waits after a
// statement that took took: as long again, so that it keeps at most half of
// one connection busy.
func continuousPause(took time.Duration) time.Duration { return took }

// continuousLedgerBudget bounds the ledger rows one continuous pass reads
// looking for orphaned rows (admin.OrphanWalk): the walk over a large
// ledger spreads over several passes.
const continuousLedgerBudget = 500_000

// initVerifyMetrics creates the continuous verify's series at 0, so that
// they exist from the start, whether it runs or not.
func initVerifyMetrics() {
	for _, k := range admin.DatabaseGapKinds {
		relay.VerifyGaps.WithLabelValues(string(k))
	}
}

// runContinuousVerify verifies the rows created in the last verify.window,
// every verify.interval, one pass at a time, until ctx ends; it exports
// each pass's gaps (relay.VerifyGaps) and logs them. A pass that fails is
// logged and tried again at the next interval.
func runContinuousVerify(ctx context.Context, db admin.DB, t config.Tables, cfg *config.Config, log zerolog.Logger) error {
	log = log.With().Str("component", "verify").Logger()
	interval, window := time.Duration(cfg.Verify.Interval), time.Duration(cfg.Verify.Window)
	log.Info().Dur("interval", interval).Dur("window", window).Msg("verify: checking the last window's rows against the ledger every interval")
	tables, err := admin.Resolve(ctx, db, admin.Tables{Outbox: t.Outbox, Ledger: t.Ledger, Checkpoint: t.Checkpoint})
	if err != nil {
		return err
	}
	walk := &admin.OrphanWalk{Budget: continuousLedgerBudget}
	var retention time.Duration
	if cfg.Retention.Enabled {
		retention = time.Duration(cfg.Retention.DoneAfter)
	}
	timer := time.NewTimer(interval)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
		rep, err := admin.Verify(ctx, db, tables, admin.VerifyOptions{
			Since: time.Now().Add(-window), Sinks: verifySinks(configuredSinks(cfg), false),
			StuckAfter: time.Duration(cfg.Source.SweepAfter), RetentionDoneAfter: retention,
			Orphans: walk, Pause: continuousPause, Listed: 3,
		})
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			log.Warn().Err(err).Dur("retry_in", interval).Msg("verify: the pass failed; trying again at the next interval")
		default:
			ev := log.Debug()
			if !rep.Clean() {
				ev = log.Warn()
			}
			for _, k := range admin.DatabaseGapKinds {
				n := rep.Count(k)
				relay.VerifyGaps.WithLabelValues(string(k)).Set(float64(n))
				ev = ev.Int64(string(k), n)
			}
			relay.VerifyLastRun.SetToCurrentTime()
			ev = ev.Int64("rows", rep.Rows).Dur("took", rep.Took)
			if rep.Clean() {
				ev.Msg("verify: no gap")
			} else {
				ev.Msg("verify: gaps found; `outbox-relay verify --since " + window.String() + "` lists their rows")
			}
		}
		timer.Reset(interval)
	}
}
