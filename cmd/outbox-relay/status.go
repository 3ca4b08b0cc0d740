package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

func newStatusCommand(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show mode, leader, slot, counts by status and per-sink deliveries",
		Long: `Status reads the relay's state from the database, so it works from any machine and
whether a relay runs or not:

  mode        replication (a process streams from the slot), poll (no one streams, but an
              outbox-relay session is connected) or stopped
  leader      the session holding the leader lock of the slot, or else the slot's walsender
  relays      relay processes of the slot, and the database connections they hold
  slot        where it is (the primary, or the standby of source.standby_url), wal_status,
              retained WAL, the position acknowledged to it, and the relay's checkpoint
  rows        outbox rows by status, the age of the oldest pending row
  delivered   per sink, ledger rows delivered in the last hour
  rate limit  per sink with sinks[].rate_limit, the limit (a running relay's metrics and
              console show the time waited on it)
  paused      the sinks an operator paused (outbox-relay sink pause), since when and why
  sink down   per sink, the pending rows whose last attempt found it down, and why (a
              running relay's /readyz names the sinks down now)
  progress    stalled when rows have waited longer than http.stall_after (5m when 0) on a
              path that shows no progress for as long: the stream's checkpoint, the claim
              path's claims and settlements (a running relay's /readyz says more)`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
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
			where := admin.Where{Slot: cfg.Source.Slot, LeaderKey: ledger.LeaderLockKey(cfg.Source.Slot)}
			if url := cfg.Source.StandbyURL.Reveal(); url != "" && cfg.Source.Mode != config.SourcePoll {
				// The relay's slot lives on the standby (docs/standby.md).
				standby, err := connectStandby(ctx, url)
				if err != nil {
					where.StandbyErr = err
				} else {
					defer closeQuietly(standby)
					where.Standby = standby
				}
			}
			st, err := admin.ReadStatus(ctx, pool, tables, where)
			if err != nil {
				return err
			}
			stallAfter := time.Duration(cfg.HTTP.StallAfter)
			if stallAfter <= 0 {
				stallAfter = time.Duration(config.Default().HTTP.StallAfter)
			}
			if st.Progress, err = admin.ReadProgress(ctx, pool, tables, st.Slot, stallAfter); err != nil {
				return err
			}
			for _, s := range configuredSinks(cfg) {
				if _, ok := st.DeliveredLastHour[s.Name]; !ok {
					st.DeliveredLastHour[s.Name] = 0
				}
				if rl := s.RateLimit; rl.On() {
					if st.RateLimits == nil {
						st.RateLimits = map[string]admin.RateLimit{}
					}
					st.RateLimits[s.Name] = admin.RateLimit{PerSecond: rl.PerSecond, Burst: rl.Burst}
				}
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(st)
			}
			printStatus(cmd.OutOrStdout(), st, time.Now())
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printStatus(w io.Writer, st *admin.Status, now time.Time) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	defer tw.Flush()
	line := func(k, format string, args ...any) { fmt.Fprintf(tw, "%s\t%s\n", k, fmt.Sprintf(format, args...)) }

	line("mode:", "%s", st.Mode)
	switch {
	case st.Leader == nil:
		line("leader:", "none")
	case st.Leader.By == "lock":
		line("leader:", "%s (holds the leader lock)", describeSession(st.Leader.Session, now))
	default:
		line("leader:", "%s (streams from the slot; no leader lock held)", describeSession(st.Leader.Session, now))
	}

	line("relays:", "%d", st.Relays)
	line("connections:", "%s", describeConnections(st.Connections))

	s := st.Slot
	where := ""
	if s.Server == "standby" {
		where = " on the standby (source.standby_url)"
	}
	switch {
	case s.Error != "":
		line("slot:", "%s%s: unknown: %s", s.Name, where, s.Error)
	case !s.Exists:
		line("slot:", "%s does not exist%s (run creates it)", s.Name, where)
	default:
		state := "inactive"
		if s.Active && s.Holder != nil {
			state = "active, streaming to " + describeSession(*s.Holder, now)
		}
		retained := "unknown"
		if s.RetainedWALBytes != nil {
			retained = admin.FormatBytes(*s.RetainedWALBytes)
		}
		walStatus := s.WALStatus
		if s.InvalidationReason != "" {
			walStatus += " (invalidated: " + s.InvalidationReason + ")"
		}
		line("slot:", "%s%s: %s; wal_status %s, retained WAL %s", s.Name, where, state, walStatus, retained)
		if s.ConfirmedFlushLSN == "" {
			line("acknowledged:", "nothing yet (the slot's confirmed position is not set)")
		} else {
			line("acknowledged:", "%s: the slot's confirmed position; the server keeps the WAL from there", s.ConfirmedFlushLSN)
		}
	}
	if cp := st.Checkpoint; cp != nil {
		line("checkpoint:", "%s, written %s ago: the relay's own record, written before each acknowledgement that passes events (idle keepalives move only the slot's)",
			cp.ConfirmedLSN, roundAge(now.Sub(cp.UpdatedAt)))
	}

	var counts []string
	for _, status := range admin.Statuses {
		counts = append(counts, fmt.Sprintf("%s %d", status, st.Rows[status]))
	}
	for _, status := range sortedKeys(st.Rows) {
		if !slices.Contains(admin.Statuses, status) {
			counts = append(counts, fmt.Sprintf("%s %d", status, st.Rows[status]))
		}
	}
	line("rows:", "%s", strings.Join(counts, ", "))
	if st.OldestPendingSeconds == nil {
		line("oldest pending:", "none pending")
	} else {
		line("oldest pending:", "%s", roundAge(time.Duration(*st.OldestPendingSeconds*float64(time.Second))))
	}
	line("held / failed:", "%d / %d (outbox-relay dlq list)", st.Held, st.Failed)
	var delivered []string
	for _, sink := range sortedKeys(st.DeliveredLastHour) {
		delivered = append(delivered, fmt.Sprintf("%s %d", sink, st.DeliveredLastHour[sink]))
	}
	if len(delivered) == 0 {
		delivered = []string{"none"}
	}
	line("delivered (1h):", "%s", strings.Join(delivered, ", "))
	for _, sink := range sortedKeys(st.SinksDown) {
		d := st.SinksDown[sink]
		line("sink down:", "%s: %d pending rows found it down at their last attempt; newest: %s", sink, d.Waiting, d.LastError)
	}
	for _, sink := range sortedKeys(st.RateLimits) {
		rl := st.RateLimits[sink]
		line("rate limit:", "%s %g/s, burst %d (the time waited on it: outbox_relay_rate_limit_wait_seconds_total, and the console)", sink, rl.PerSecond, rl.Burst)
	}
	for _, p := range st.Paused {
		line("paused:", "%s since %s%s (outbox-relay sink resume %s)", p.Sink, p.PausedAt.UTC().Format(time.RFC3339), reasonNote(p.Reason), p.Sink)
	}
	if p := st.Progress; p != nil {
		after := time.Duration(p.StallAfterSeconds * float64(time.Second))
		switch {
		case p.Stalled != "":
			line("progress:", "STALLED: %s", p.Stalled)
		case p.Note != "":
			line("progress:", "no stall; %s", p.Note)
		default:
			line("progress:", "no row has waited longer than %s", after)
		}
	}
}

// describeConnections says how many connections the relays hold, by
// application_name (`3 ("outbox-relay", "outbox-relay leader
// outbox_relay", "outbox-relay owner lock")`).
func describeConnections(sessions []admin.Session) string {
	if len(sessions) == 0 {
		return "0"
	}
	counts := map[string]int{}
	for _, s := range sessions {
		counts[s.ApplicationName]++
	}
	var names []string
	for _, app := range sortedKeys(counts) {
		name := strconv.Quote(app)
		if n := counts[app]; n > 1 {
			name = fmt.Sprintf("%d × %s", n, name)
		}
		names = append(names, name)
	}
	return fmt.Sprintf("%d (%s)", len(sessions), strings.Join(names, ", "))
}

func describeSession(s admin.Session, now time.Time) string {
	out := fmt.Sprintf("pid %d %q", s.PID, s.ApplicationName)
	if s.ClientAddr != "" {
		out += " from " + s.ClientAddr
	}
	if s.BackendStart != nil {
		out += ", up " + roundAge(now.Sub(*s.BackendStart))
	}
	return out
}

// roundAge prints d to a precision that suits its size.
func roundAge(d time.Duration) string {
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	default:
		return d.Round(time.Second).String()
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// connectOps opens a small pool for an operator command, named
// admin.CLIApplicationName (status does not count it as a relay), and
// schema-qualifies the configured tables. A failed connection is explained
// with its fix (connectError), and a database migrate has not prepared is
// named as such (requireMigrated).
func connectOps(ctx context.Context, cfg *config.Config) (*pgxpool.Pool, admin.Tables, error) {
	pc, err := pgxpool.ParseConfig(cfg.DatabaseURL.Reveal())
	if err != nil {
		// pgx's parse errors can quote the string, password included.
		return nil, admin.Tables{}, usageError{fmt.Errorf("database_url does not parse as a PostgreSQL URL or key=value string")}
	}
	pc.ConnConfig.RuntimeParams["application_name"] = admin.CLIApplicationName
	pc.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, admin.Tables{}, fmt.Errorf("database: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, admin.Tables{}, connectError(cfg, err)
	}
	t := cfg.Tables()
	var sinks []admin.Sink
	for _, s := range configuredSinks(cfg) {
		sinks = append(sinks, admin.Sink{Name: s.Name, Events: s.Events, Filter: s.CompiledFilter()})
	}
	tables, err := admin.Resolve(ctx, pool, admin.Tables{Outbox: t.Outbox, Ledger: t.Ledger, Checkpoint: t.Checkpoint, Sinks: sinks})
	if err == nil {
		err = requireMigrated(ctx, pool, tables, configuredTarget(cfg))
	}
	if err != nil {
		pool.Close()
		return nil, admin.Tables{}, err
	}
	return pool, tables, nil
}

// connectStandby opens a connection to the standby of source.standby_url
// for an operator command, named admin.CLIApplicationName.
func connectStandby(ctx context.Context, url string) (*pgx.Conn, error) {
	cc, err := pgx.ParseConfig(url)
	if err != nil {
		// pgx's parse errors can quote the string, password included.
		return nil, errors.New("source.standby_url does not parse as a PostgreSQL URL or key=value string")
	}
	cc.RuntimeParams["application_name"] = admin.CLIApplicationName
	if cc.ConnectTimeout == 0 || cc.ConnectTimeout > standbyConnectTimeout {
		cc.ConnectTimeout = standbyConnectTimeout
	}
	return pgx.ConnectConfig(ctx, cc)
}

// standbyConnectTimeout bounds status's connection to the standby: a
// standby that is down must not hold the command up.
const standbyConnectTimeout = 5 * time.Second

func closeQuietly(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// configuredSinks returns the sinks run delivers to: the configured ones
// and, with embedded_nats, the embedded NATS sink.
func configuredSinks(cfg *config.Config) []config.SinkConfig { return cfg.EffectiveSinks() }

// findSink returns the configured sink called name, or a usage error that
// lists the sinks there are.
func findSink(cfg *config.Config, name string) (config.SinkConfig, error) {
	sinks := configuredSinks(cfg)
	var names []string
	for _, s := range sinks {
		if s.Name == name {
			return s, nil
		}
		names = append(names, s.Name)
	}
	if len(names) == 0 {
		names = []string{"none"}
	}
	return config.SinkConfig{}, usageError{fmt.Errorf("--sink %q: no such sink (configured: %s)", name, strings.Join(names, ", "))}
}
