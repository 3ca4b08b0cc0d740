package main

import (
	"github.com/spf13/cobra"
)

func newConfigCommand(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "config",
		Short: "Print the effective configuration, secrets redacted",
		Long: `Config loads the configuration as run would (flags > RELAY_* environment > file >
defaults, secrets read from their *_file keys), validates it and prints it as YAML.
database_url and source.standby_url show their host, port, database, user and
settings with only the passwords as xxxxx; every other secret (webhook auth
secrets, NATS tokens, http.metrics_token) is printed as [redacted], webhook header
values too, and credentials in sink URLs as xxxxx; paths of *_file keys are printed
as they are, without the secret read from them. A "$" in a value is printed "$$", so the output loads back as a file.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.loadConfig()
			if err != nil {
				return err
			}
			out, err := cfg.Redacted()
			if err != nil {
				return err
			}
			_, err = g.stdout.Write(out)
			return err
		},
	}
}
