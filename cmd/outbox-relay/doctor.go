package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
)

// sinkCheckTimeout bounds each sink check (dial, TLS handshake, NATS
// requests).
const sinkCheckTimeout = 5 * time.Second

// errChecksFailed makes doctor exit 1 after printing its report.
var errChecksFailed = errors.New("see the FAIL lines for the fixes")

func newDoctorCommand(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check wal_level, privileges, publication, slot, sinks; print the fix for each failure",
		Long: `Doctor checks what the relay needs, as the role in database_url, and prints one line per
check — ok, warn, FAIL, or skip for a check that does not apply (the publication while the
outbox table does not exist, TCP keepalives over a Unix socket) — with the exact fix (SQL or
setting) under each warn and FAIL:

  connection, server version (13+), primary, wal_level (below logical a warning in auto mode,
  which polls there, and a failure in source.mode replication), the REPLICATION attribute and
  a replication connection (pg_hba.conf), the schema version (migrate), the privileges run
  needs on the outbox, ledger and checkpoint tables (the missing GRANTs) and those it has
  beyond them (superuser, table ownership, extra grants), the publication, while the relay
  polls the notify trigger (source.notify_trigger), the slot (missing, lost, held by another
  or a stale process, retained WAL, made without the relay's hand-over: the rows run then
  hands to the claim path), max_slot_wal_keep_size, and each sink: a webhook gets an OPTIONS
  request with CORS preflight headers (nothing is delivered; n8n answers it from its webhook
  registrations without running a workflow), which tells a registered n8n webhook from a path
  n8n has not registered (workflow not published, wrong path), n8n's test URL, a webhook for
  another method and credentials a proxy refuses; a NATS server is connected and its JetStream
  stream checked (exists, captures the subjects, duplicate_window,
  and whether its last messages on the sink's subjects include another deployment's).

Doctor only reads. It exits 1 when a check fails, 0 otherwise (warnings included).`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.loadConfig()
			if err != nil {
				return err
			}
			checks := doctor(cmd.Context(), cfg)
			failed := 0
			for _, c := range checks {
				if c.Status == admin.Fail {
					failed++
				}
			}
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				if err := enc.Encode(struct {
					OK     bool          `json:"ok"`
					Checks []admin.Check `json:"checks"`
				}{failed == 0, checks}); err != nil {
					return err
				}
			} else {
				printChecks(out, checks)
			}
			switch {
			case failed == 1:
				return fmt.Errorf("doctor: 1 check failed: %w", errChecksFailed)
			case failed > 1:
				return fmt.Errorf("doctor: %d checks failed: %w", failed, errChecksFailed)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, `print JSON: {"ok": bool, "checks": [{"name", "status", "detail", "fix"}]}`)
	return cmd
}

// doctor runs the database checks, then one or more checks per sink.
func doctor(ctx context.Context, cfg *config.Config) []admin.Check {
	t := cfg.Tables()
	checks := admin.Diagnose(ctx, admin.DiagnoseConfig{
		ConnString:          cfg.DatabaseURL.Reveal(),
		Tables:              admin.Tables{Outbox: t.Outbox, Ledger: t.Ledger, Checkpoint: t.Checkpoint},
		Publication:         cfg.Source.Publication,
		Slot:                cfg.Source.Slot,
		Replication:         cfg.Source.Mode != config.SourcePoll,
		ReplicationRequired: cfg.Source.Mode == config.SourceReplication,
		NotifyTrigger:       cfg.Source.NotifyTrigger,
		PollInterval:        time.Duration(cfg.Source.PollInterval),
		Retention:           cfg.Retention.Enabled,
		SlotMaxRetained:     int64(cfg.Source.SlotMaxRetained),
		StandbyURL:          cfg.Source.StandbyURL.Reveal(),
		StandbyMaxLag:       time.Duration(cfg.Source.StandbyMaxLag),
	})
	sinks := configuredSinks(cfg)
	if len(sinks) == 0 {
		checks = append(checks, admin.Check{Name: "sinks", Status: admin.Fail, Detail: "none configured: run refuses to start without one",
			Fix: "add a sink under sinks: (docs/configuration.md, \"sinks\"), or set embedded_nats: true to try the relay with an embedded NATS server"})
	}
	var identity *deploymentIdentity
	for i, s := range sinks {
		switch s.Type {
		case config.SinkWebhook:
			checks = append(checks, checkWebhook(ctx, i, s))
		case config.SinkNATS:
			if identity == nil && s.NATS.MsgIDPrefix == "" {
				identity = readDeploymentIdentity(ctx, cfg)
			}
			checks = append(checks, checkNATS(ctx, i, s, identity)...)
		}
	}
	return checks
}

// deploymentIdentity is what a NATS sink without msg_id_prefix derives its
// deployment from, or why doctor could not read it.
type deploymentIdentity struct {
	admin.Identity
	outbox relay.QualifiedName // schema-qualified
	err    error
}

// readDeploymentIdentity reads the database's identity as run does.
func readDeploymentIdentity(ctx context.Context, cfg *config.Config) *deploymentIdentity {
	id := &deploymentIdentity{}
	ctx, cancel := context.WithTimeout(ctx, sinkCheckTimeout)
	defer cancel()
	cc, err := pgx.ParseConfig(cfg.DatabaseURL.Reveal())
	if err != nil {
		id.err = errors.New("database_url does not parse")
		return id
	}
	cc.RuntimeParams["application_name"] = admin.CLIApplicationName
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		id.err = fmt.Errorf("connect to the database: %w", err)
		return id
	}
	defer conn.Close(relay.Detached(ctx, "the connection is closed even after ctx ended; pgx bounds the close"))
	t := cfg.Tables()
	tables, err := admin.Resolve(ctx, conn, admin.Tables{Outbox: t.Outbox, Ledger: t.Ledger, Checkpoint: t.Checkpoint})
	if err != nil {
		id.err = err
		return id
	}
	id.outbox = tables.Outbox
	id.Identity, id.err = admin.ReadIdentity(ctx, conn)
	return id
}

// deploymentSample bounds how many of a stream's latest messages doctor
// reads to find another deployment's on a NATS sink's subjects.
const deploymentSample = 100

// checkDeployment warns when the stream holds, on the sink's subjects,
// messages another deployment published: its consumers then see two
// deployments' events, which is safe for delivery (each deployment's
// message ids are its own) but a surprise to a consumer that expects one
// source. It reads the stream's last deploymentSample messages and looks at
// their Outbox-Deployment header, so a deployment that has not published
// lately is not seen.
func checkDeployment(ctx context.Context, i int, s config.SinkConfig, stream jetstream.Stream, pattern string, identity *deploymentIdentity) admin.Check {
	name := "sink " + s.Name + " deployment"
	ours := s.NATS.MsgIDPrefix
	if ours == "" {
		if identity.err != nil {
			return admin.Check{Name: name, Status: admin.Skip, Detail: fmt.Sprintf("this deployment's id is unknown: %v", identity.err),
				Fix: fmt.Sprintf("set sinks[%d].msg_id_prefix when the database cannot tell its system identifier", i)}
		}
		ours = natssink.DeploymentID(identity.SystemIdentifier, identity.Database, identity.outbox.Quoted())
	}
	state := stream.CachedInfo().State
	ctx, cancel := context.WithTimeout(ctx, sinkCheckTimeout)
	defer cancel()
	read, mine, unscoped := 0, 0, 0
	others := map[string]int{}
	for seq := state.LastSeq; seq >= state.FirstSeq && seq > 0 && read < deploymentSample; seq-- {
		m, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return admin.Check{Name: name, Status: admin.Skip, Detail: fmt.Sprintf("read message %d of stream %s: %v", seq, s.NATS.Stream.Name, err)}
		}
		read++
		if !server.SubjectMatchesFilter(m.Subject, pattern) {
			continue
		}
		switch dep := m.Header.Get(natssink.HeaderDeployment); dep {
		case ours:
			mine++
		case "":
			unscoped++
		default:
			others[dep]++
		}
	}
	if len(others) == 0 {
		return admin.Check{Name: name, Status: admin.OK, Detail: fmt.Sprintf("%s; the stream's last %d messages hold, on the sink's subjects, %d of this deployment and %d of none (published before the message ids were scoped, or by another publisher), none of another",
			ours, read, mine, unscoped)}
	}
	var foreign []string
	for _, dep := range slices.Sorted(maps.Keys(others)) {
		foreign = append(foreign, fmt.Sprintf("%s (%d)", dep, others[dep]))
	}
	return admin.Check{Name: name, Status: admin.Warn,
		Detail: fmt.Sprintf("stream %s holds, on the sink's subjects %q, messages of other deployments: %s among its last %d; this one is %s. Delivery is safe (message ids are scoped by deployment), but the stream's consumers get both deployments' events",
			s.NATS.Stream.Name, pattern, strings.Join(foreign, ", "), read, ours),
		Fix: fmt.Sprintf("give each deployment subjects and a stream of its own: sinks[%d].subject with a prefix of its own (e.g. \"shop.outbox.{{.AggregateType}}.{{.EventType}}\") and sinks[%d].stream; or have the consumers filter on Outbox-Deployment and deduplicate on Nats-Msg-Id (docs/sinks.md, \"Message ids\")",
			i, i)}
}

// printChecks prints one line per check and its fix indented below.
func printChecks(w io.Writer, checks []admin.Check) {
	width := 0
	for _, c := range checks {
		width = max(width, len(c.Name))
	}
	counts := map[admin.CheckStatus]int{}
	for _, c := range checks {
		counts[c.Status]++
		fmt.Fprintf(w, "%-4s  %-*s  %s\n", c.Status, width, c.Name, c.Detail)
		if c.Fix != "" && c.Status != admin.OK {
			indent := strings.Repeat(" ", 6)
			fmt.Fprintf(w, "%sfix: %s\n", indent, strings.ReplaceAll(c.Fix, "\n", "\n"+indent+"     "))
		}
	}
	summary := fmt.Sprintf("%d ok, %d warnings, %d failed", counts[admin.OK], counts[admin.Warn], counts[admin.Fail])
	if counts[admin.Skip] > 0 {
		summary += fmt.Sprintf(", %d skipped", counts[admin.Skip])
	}
	fmt.Fprintf(w, "\n%s\n", summary)
}

func unwrapOpError(err error) error {
	if op, ok := errors.AsType[*net.OpError](err); ok && op.Err != nil {
		return op.Err
	}
	return err
}

// checkNATS connects to the NATS server and checks the JetStream stream the
// sink publishes to: it exists (or run creates it), one of its subjects
// captures every subject the template renders, its duplicate window is at
// least the configured one (a smaller one is a warning), and no other
// deployment publishes on the sink's subjects (checkDeployment).
func checkNATS(ctx context.Context, i int, s config.SinkConfig, identity *deploymentIdentity) []admin.Check {
	name := "sink " + s.Name
	n := s.NATS
	if s.URL == "" {
		return []admin.Check{{Name: name, Status: admin.OK, Detail: "embedded NATS server: run starts it under data_dir (single instance only)"}}
	}
	opts := []nats.Option{nats.Name(admin.CLIApplicationName + " doctor"), nats.Timeout(sinkCheckTimeout), nats.NoReconnect()}
	if n.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(n.CredsFile))
	}
	if n.NkeyFile != "" {
		opt, err := nats.NkeyOptionFromSeed(n.NkeyFile)
		if err != nil {
			return []admin.Check{{Name: name, Status: admin.Fail, Detail: "nkey_file: " + err.Error(), Fix: "fix sinks[" + strconv.Itoa(i) + "].nkey_file"}}
		}
		opts = append(opts, opt)
	}
	if tok := n.Token.Reveal(); tok != "" {
		opts = append(opts, nats.Token(tok))
	}
	if tc, err := s.TLS.ClientConfig(); err != nil {
		return []admin.Check{{Name: name, Status: admin.Fail, Detail: err.Error(), Fix: "fix sinks[" + strconv.Itoa(i) + "].tls"}}
	} else if tc != nil {
		opts = append(opts, nats.Secure(tc))
	}
	nc, err := nats.Connect(s.URL, opts...)
	if err != nil {
		return []admin.Check{{Name: name, Status: admin.Fail, Detail: fmt.Sprintf("cannot connect to NATS: %v", err),
			Fix: fmt.Sprintf("check sinks[%d].url, its credentials (creds_file, token) and that nats-server is up", i)}}
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(ctx, sinkCheckTimeout)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		return []admin.Check{{Name: name, Status: admin.Fail, Detail: fmt.Sprintf("JetStream: %v", err)}}
	}
	checks := []admin.Check{{Name: name, Status: admin.OK, Detail: fmt.Sprintf("connected to NATS %s at %s", nc.ConnectedServerVersion(), nc.ConnectedUrlRedacted())}}

	pattern, err := subjectPattern(n.Subject)
	if err != nil {
		return append(checks, admin.Check{Name: name + " subject", Status: admin.Fail, Detail: err.Error(), Fix: fmt.Sprintf("fix sinks[%d].subject", i)})
	}
	prefix := literalPrefix(pattern)
	window := n.Stream.DuplicateWindow
	streamName := name + " stream " + n.Stream.Name
	stream, err := js.Stream(ctx, n.Stream.Name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) && n.Stream.Create:
		return append(checks, admin.Check{Name: streamName, Status: admin.OK,
			Detail: fmt.Sprintf("does not exist yet: run creates it (stream.create: true) with subjects %q and duplicate_window %s", n.Stream.Subjects, window)})
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return append(checks, admin.Check{Name: streamName, Status: admin.Fail, Detail: "does not exist, and stream.create is false",
			Fix: fmt.Sprintf("nats stream add %s --subjects %q --dupe-window %s --storage file --defaults\n# or set sinks[%d].stream.create: true", n.Stream.Name, prefix, window, i)})
	case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount):
		return append(checks, admin.Check{Name: streamName, Status: admin.Fail, Detail: "JetStream is not enabled",
			Fix: "enable JetStream on the server (jetstream {} in its config, or nats-server -js) and for the account"})
	case err != nil:
		return append(checks, admin.Check{Name: streamName, Status: admin.Fail, Detail: fmt.Sprintf("look up the stream: %v", err)})
	}
	sc := stream.CachedInfo().Config
	covered := false
	for _, filter := range sc.Subjects {
		covered = covered || server.SubjectMatchesFilter(pattern, filter)
	}
	if covered {
		checks = append(checks, admin.Check{Name: streamName, Status: admin.OK, Detail: fmt.Sprintf("subjects %q capture %q", sc.Subjects, pattern)})
	} else {
		checks = append(checks, admin.Check{Name: streamName, Status: admin.Fail,
			Detail: fmt.Sprintf("subjects %q do not capture the sink's subjects %q: publishes would fail with no responders", sc.Subjects, pattern),
			Fix:    fmt.Sprintf("nats stream edit %s --subjects %q   # adds %q to the stream's subjects", n.Stream.Name, strings.Join(append(sc.Subjects, prefix), ","), prefix)})
	}
	if sc.Duplicates < time.Duration(window) {
		checks = append(checks, admin.Check{Name: name + " duplicate_window", Status: admin.Warn,
			Detail: fmt.Sprintf("stream %s deduplicates over %s, less than the sink's stream.duplicate_window %s: a re-send after that stores a second copy (outbox_relay_nats_duplicates_stored_total)", n.Stream.Name, config.Duration(sc.Duplicates), window),
			Fix:    fmt.Sprintf("nats stream edit %s --dupe-window %s\n# or lower sinks[%d].stream.duplicate_window", n.Stream.Name, window, i)})
	} else {
		checks = append(checks, admin.Check{Name: name + " duplicate_window", Status: admin.OK,
			Detail: fmt.Sprintf("stream %s deduplicates over %s (the sink's stream.duplicate_window: %s)", n.Stream.Name, config.Duration(sc.Duplicates), window)})
	}
	return append(checks, checkDeployment(ctx, i, s, stream, pattern, identity))
}

// subjectProbe stands in for every field when the template's shape is
// computed: a control character cannot come out of a sanitised value.
const subjectProbe = "\x01"

// subjectPattern returns the subjects a template renders as a filter,
// every token holding a field as "*" ("outbox.*.*").
func subjectPattern(text string) (string, error) {
	tmpl, err := template.New("subject").Option("missingkey=error").Parse(text)
	if err != nil {
		return "", fmt.Errorf("subject template %q: %w", text, err)
	}
	var b strings.Builder
	probe := natssink.SubjectFields{EventType: subjectProbe, AggregateType: subjectProbe, AggregateID: subjectProbe, EventKey: subjectProbe}
	if err := tmpl.Execute(&b, probe); err != nil {
		return "", fmt.Errorf("subject template %q: %w", text, err)
	}
	tokens := strings.Split(b.String(), ".")
	for i, t := range tokens {
		if strings.Contains(t, subjectProbe) {
			tokens[i] = "*"
		}
	}
	return strings.Join(tokens, "."), nil
}

// literalPrefix is the stream subject that captures pattern: its tokens
// before the first wildcard, then ">".
func literalPrefix(pattern string) string {
	tokens := strings.Split(pattern, ".")
	for i, t := range tokens {
		if t == "*" {
			if i == 0 {
				return ">"
			}
			return strings.Join(tokens[:i], ".") + ".>"
		}
	}
	return pattern
}
