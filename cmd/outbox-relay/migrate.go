package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/migrations"
)

func newMigrateCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "migrate",
		Short: "Create or adopt the outbox table, ledger, checkpoint, outbox_publish and the publication",
		Long: `Migrate applies the embedded migrations for the configured table names. It is the
only command that needs DDL rights; the publication can only be created by the outbox
table's owner (another role gets the statement to run). Running it twice is a no-op.
Existing rows are never changed; indexes are built CONCURRENTLY and DDL that needs a
strong lock waits at most migrate.lock_timeout at a time, retrying until migrate.timeout.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.loadOpsConfig()
			if err != nil {
				return err
			}
			log := g.logger(cfg)
			ctx := cmd.Context()

			conn, err := pgx.Connect(ctx, cfg.DatabaseURL.Reveal())
			if err != nil {
				return connectError(cfg, err)
			}
			defer conn.Close(ctx)

			t := cfg.Tables()
			res, err := migrations.Migrate(ctx, conn, migrations.Options{
				Names: migrations.Names{
					Outbox:          t.Outbox,
					Ledger:          t.Ledger,
					Checkpoint:      t.Checkpoint,
					Conflicts:       t.Conflicts,
					PublishFunction: t.PublishFunction,
					Publication:     cfg.Source.Publication,
				},
				LockTimeout:   time.Duration(cfg.Migrate.LockTimeout),
				Timeout:       time.Duration(cfg.Migrate.Timeout),
				NotifyTrigger: cfg.Source.NotifyTrigger,
				Logger:        log,
			})
			if err != nil {
				return explainMigrateError(ctx, conn, t, err)
			}
			out := cmd.OutOrStdout()
			if res.Adopted {
				fmt.Fprintf(out, "adopted the existing table %s: its rows and its own indexes stay as they are\n", t.Outbox)
			}
			if len(res.Applied) == 0 {
				fmt.Fprintf(out, "schema of %s is up to date (version %d)\n", t.Outbox, res.To)
			} else {
				fmt.Fprintf(out, "migrated %s from version %d to %d: %s\n", t.Outbox, res.From, res.To, strings.Join(res.Applied, ", "))
			}
			if res.PublicationCreated {
				fmt.Fprintf(out, "created publication %s\n", cfg.Source.Publication)
			}
			if res.NotifyTrigger != "" {
				fmt.Fprintf(out, "notify trigger %s (channel %s)\n", res.NotifyTrigger, migrations.NotifyChannel(t.Outbox))
			}
			if res.PublicationSkipped != "" {
				fmt.Fprintf(out, "warning: %s\n", res.PublicationSkipped)
			}
			return nil
		},
	}
}

// explainMigrateError adds what to do to a migration refused for want of
// privileges: migrate is the only command that needs DDL rights, and a
// least-privilege role meets it first. Whether run can start anyway (the
// tables are current for this build, by run's own check) is said too.
func explainMigrateError(ctx context.Context, conn *pgx.Conn, t config.Tables, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" { // insufficient_privilege
		return err
	}
	role := conn.Config().User
	state := "the relay's tables are not current for this build either: run cannot start until the owner migrates"
	if migrations.CheckSchema(ctx, conn, migrations.Names{Outbox: t.Outbox, Checkpoint: t.Checkpoint}) == nil {
		state = "the relay's tables are already current for this build, so run can start as this role; migrate again as the owner when you upgrade the relay"
	}
	return fmt.Errorf("%w\n  migrate creates and alters tables, and role %s may not (%s): it is the only command that needs DDL rights. "+
		"Run it as the owner of %s (outbox-relay migrate --database-url 'postgres://OWNER@…'); %s", err, role, pgErr.Message, t.Outbox, state)
}
