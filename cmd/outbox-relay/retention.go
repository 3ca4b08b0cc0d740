package main

import (
	"context"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// retentionConfig converts the retention section for admin.Prune.
func retentionConfig(r config.RetentionConfig) admin.RetentionConfig {
	return admin.RetentionConfig{
		DoneAfter:   time.Duration(r.DoneAfter),
		LedgerAfter: time.Duration(r.LedgerAfter),
		Batch:       r.Batch,
	}
}

// runRetention prunes old done rows and ledger rows (admin.Prune) at once and
// then every retention.interval until ctx ends, and returns nil then. It
// returns at once when retention is disabled. A failed pass is logged and
// retried at the next interval. db needs DELETE on the outbox and the
// ledger; tables should be schema-qualified as run resolves them. A row the
// relay's slot could still send again is never pruned (admin.Horizon).
//
// Pruning is safe on several relays at once (rows locked by another pass
// are skipped), but only one needs to do it: run starts it for the
// leader's term.
//
// standby, when set, is the standby the relay decodes on (source.standby_url):
// the slot, and with it the horizon, lives there.
func runRetention(ctx context.Context, db, standby admin.DB, tables config.Tables, cfg *config.Config, log zerolog.Logger) error {
	r := cfg.Retention
	if !r.Enabled {
		return nil
	}
	log = log.With().Str("component", "retention").Logger()
	log.Info().Dur("done_after", time.Duration(r.DoneAfter)).Dur("ledger_after", time.Duration(r.LedgerAfter)).Dur("interval", time.Duration(r.Interval)).
		Int("batch", r.Batch).Msg("retention: pruning old done rows and ledger rows")
	rc := retentionConfig(r)
	rc.Slot = cfg.Source.Slot
	if standby != nil {
		rc.Horizon = admin.NewHorizonOn(cfg.Source.Slot, standby)
	}
	return admin.RunRetention(ctx, db, admin.Tables{Outbox: tables.Outbox, Ledger: tables.Ledger, Checkpoint: tables.Checkpoint},
		rc, time.Duration(r.Interval), log)
}
