package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// LoadCheckpoint returns the confirmed position saved for slot, or 0 when
// none was saved. It only reads.
func (s *Store) LoadCheckpoint(ctx context.Context, slot string) (relay.LSN, error) {
	var lsn relay.LSN
	err := s.pool.QueryRow(ctx, s.sql.loadCheckpoint, slot).Scan(&lsn)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("load checkpoint of slot %s: %w", slot, err)
	}
	return lsn, nil
}

// SaveCheckpoint records lsn as slot's confirmed position. The position
// never moves backwards: saving an LSN below the stored one keeps the
// stored one (and refreshes updated_at), so a late or repeated save is
// harmless and the call is safe to repeat.
//
// The commit is synchronous (synchronous_commit = on for this transaction,
// whatever the role's default; a server set to remote_apply keeps it). When
// SaveCheckpoint returns nil the WAL is flushed up to its commit, so every
// asynchronous commit made before it on this server — the outcomes and
// delivered ledger rows SettleStream wrote — is durable too: only then may the slot be
// acknowledged up to lsn. When the server names standbys in
// synchronized_standby_slots (PostgreSQL 17+), it also waits until they
// have flushed that WAL: a failover slot synced to a standby must not stand
// past events whose outcomes the standby lacks (docs/failover.md). The
// commit is refused on another timeline than the stream's (see StreamFrom).
func (s *Store) SaveCheckpoint(ctx context.Context, slot string, lsn relay.LSN) error {
	standbys, err := s.saveCheckpoint(ctx, slot, lsn)
	if err != nil {
		return fmt.Errorf("save checkpoint %s of slot %s: %w", lsn, slot, err)
	}
	if err := s.waitStandbys(ctx, standbys); err != nil {
		return fmt.Errorf("save checkpoint %s of slot %s: %w", lsn, slot, err)
	}
	return nil
}

// saveCheckpoint writes the checkpoint and returns the server's
// synchronized_standby_slots.
func (s *Store) saveCheckpoint(ctx context.Context, slot string, lsn relay.LSN) (standbys string, err error) {
	_, err = s.runStreamSteps(ctx, s.sql.setSynchronousCommit, []step{
		exec("save the checkpoint", s.sql.saveCheckpoint, slot, lsn),
		{kind: "read synchronized_standby_slots", sql: catalog.Get("StandbySlots"), check: func(row pgx.Row) error { return row.Scan(&standbys) }},
	})
	return standbys, err
}
