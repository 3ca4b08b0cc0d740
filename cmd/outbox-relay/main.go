// Command outbox-relay delivers the rows inserted into a transactional outbox
// table to an n8n webhook and to NATS JetStream, from a logical replication
// slot, with the polling claim as the fallback path.
//
// Exit codes: 0 success; 1 the command failed; 2 bad usage or configuration.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

// Exit codes, documented in the README.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// usageError marks errors caused by the command line or the configuration.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := Execute(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func exitCode(err error) int {
	var usage usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &usage):
		return exitUsage
	default:
		return exitFailure
	}
}

// globals are the flags every command takes.
type globals struct {
	configPath  string
	databaseURL string
	// logFormat and logLevel are --log-format and --log-level: log.format
	// and log.level set on the command line.
	logFormat, logLevel string
	// embeddedNATS is run's --embedded-nats: embedded_nats set on the
	// command line.
	embeddedNATS bool
	stdout       io.Writer
	stderr       io.Writer
}

// loadConfig reads the configuration: flags > RELAY_* environment > file >
// defaults. The file is --config, else the path in RELAY_CONFIG. Commands
// that send (run, doctor) and config use it.
func (g *globals) loadConfig() (*config.Config, error) { return g.load(false) }

// loadOpsConfig reads the configuration as loadConfig does, for a command
// that never sends (status, event, dlq, replay, reconcile, migrate): it needs the
// sinks' names and events, not their secrets, so an unset ${VAR} in a sink
// secret is no error there (config.Options.SinkSecretsOptional). An
// operator can run it from a machine that holds only the database's
// credentials.
func (g *globals) loadOpsConfig() (*config.Config, error) { return g.load(true) }

func (g *globals) load(sinkSecretsOptional bool) (*config.Config, error) {
	overrides := map[string]string{}
	if g.databaseURL != "" {
		overrides["database_url"] = g.databaseURL
	}
	if g.embeddedNATS {
		overrides["embedded_nats"] = "true"
	}
	if g.logFormat != "" {
		overrides["log.format"] = g.logFormat
	}
	if g.logLevel != "" {
		overrides["log.level"] = g.logLevel
	}
	path, from := g.configFile()
	cfg, err := config.Load(config.Options{Path: path, Overrides: overrides, SinkSecretsOptional: sinkSecretsOptional})
	if err != nil {
		if from == config.EnvConfigFile {
			err = fmt.Errorf("%s=%s: %w", config.EnvConfigFile, path, err)
		}
		return nil, usageError{err}
	}
	return cfg, nil
}

// configFile returns the configuration file's path and where it was named:
// "--config", config.EnvConfigFile, or "" when there is none.
func (g *globals) configFile() (path, from string) {
	if g.configPath != "" {
		return g.configPath, "--config"
	}
	if p := os.Getenv(config.EnvConfigFile); p != "" {
		return p, config.EnvConfigFile
	}
	return "", ""
}

// logger builds the process logger from the log settings (logging.go).
func (g *globals) logger(cfg *config.Config) zerolog.Logger {
	return newLogger(g.stderr, cfg.Log)
}

func newRootCommand(stdout, stderr io.Writer) *cobra.Command {
	g := &globals{stdout: stdout, stderr: stderr}
	root := &cobra.Command{
		Use:   "outbox-relay",
		Short: "Deliver transactional outbox rows to n8n webhooks and NATS JetStream within milliseconds of commit",
		Long: `outbox-relay attaches to a PostgreSQL primary, reads outbox INSERTs from a logical
replication slot and delivers each event to its sinks (an n8n webhook, NATS JetStream),
with an idempotency ledger and the polling claim (FOR UPDATE SKIP LOCKED) as the fallback.

Configuration: --config FILE (YAML; default: the path in RELAY_CONFIG), RELAY_<PATH>
environment variables, flags.
Exit codes: 0 success, 1 failure, 2 bad usage or configuration.`,
		Version:       versionString(),
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetVersionTemplate("outbox-relay version {{.Version}}\n")
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.PersistentFlags().StringVarP(&g.configPath, "config", "c", "", "configuration file (YAML); default: the path in RELAY_CONFIG")
	root.PersistentFlags().StringVar(&g.databaseURL, "database-url", "", "PostgreSQL connection URL (overrides database_url)")
	root.PersistentFlags().StringVar(&g.logFormat, "log-format", "", "json, console or auto (overrides log.format)")
	root.PersistentFlags().StringVar(&g.logLevel, "log-level", "", "trace, debug, info, warn or error (overrides log.level)")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })

	root.AddCommand(
		newRunCommand(g),
		newMigrateCommand(g),
		newDoctorCommand(g),
		newStatusCommand(g),
		newEventCommand(g),
		newDLQCommand(g),
		newReplayCommand(g),
		newSinkCommand(g),
		newReconcileCommand(g),
		newVerifyCommand(g),
		newConfigCommand(g),
		newVersionCommand(),
	)
	requireSubcommand(root)
	return root
}

// requireSubcommand makes cmd and each of its descendants that only group
// subcommands (the root, dlq) fail with a usage error (exit 2) when called
// without one or with an unknown one, after printing their help to stderr
// for the former. Cobra's defaults exit 0 with the help, and 1 for an
// unknown command.
func requireSubcommand(cmd *cobra.Command) {
	for _, c := range cmd.Commands() {
		requireSubcommand(c)
	}
	if !cmd.HasSubCommands() || cmd.Run != nil || cmd.RunE != nil {
		return
	}
	cmd.SuggestionsMinimumDistance = 2
	cmd.Args = func(c *cobra.Command, args []string) error {
		if len(args) == 0 {
			return nil
		}
		msg := fmt.Sprintf("unknown command %q for %q", args[0], c.CommandPath())
		if s := c.SuggestionsFor(args[0]); len(s) > 0 {
			msg += fmt.Sprintf("; did you mean %q?", strings.Join(s, `" or "`))
		}
		return usageError{fmt.Errorf("%s (run '%s --help' for the commands)", msg, c.CommandPath())}
	}
	cmd.RunE = func(c *cobra.Command, _ []string) error {
		c.SetOut(c.ErrOrStderr())
		_ = c.Help()
		var names []string
		for _, sub := range c.Commands() {
			if sub.IsAvailableCommand() {
				names = append(names, sub.Name())
			}
		}
		return usageError{fmt.Errorf("%s needs a command: %s", c.CommandPath(), strings.Join(names, ", "))}
	}
}

// Execute runs the command line args and returns the exit code; main and the
// tests share it.
func Execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := newRootCommand(stdout, stderr)
	if args == nil {
		args = []string{} // cobra reads os.Args for nil
	}
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "outbox-relay: %v\n", err)
	}
	return exitCode(err)
}
