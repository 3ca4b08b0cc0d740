package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

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
				return fmt.Errorf("connect to the database: %w", err)
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
				return err
			}
			out := cmd.OutOrStdout()
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
