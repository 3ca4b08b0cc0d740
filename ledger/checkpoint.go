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

// SaveCheckpoint records lsn as slot's confirmed position. The position never
// moves backwards: saving an LSN below the stored one keeps the stored one
// (and refreshes updated_at), so a late or repeated save is harmless and the
// call is safe to repeat.
//
// The commit is synchronous (synchronous_commit = on for this transaction,
// whatever the role's default; a server set to remote_apply keeps it). When
// SaveCheckpoint returns nil the WAL is flushed up to its commit, so every
// asynchronous commit made before it on this server — the ledger writes of
// Settle — is durable too: only then may the slot be acknowledged up to lsn.
func (s *Store) SaveCheckpoint(ctx context.Context, slot string, lsn relay.LSN) error {
	err := s.inTx(ctx, s.sql.setSynchronousCommit, func(b *pgx.Batch) {
		b.Queue(s.sql.saveCheckpoint, slot, lsn)
	}, func(br pgx.BatchResults) error {
		_, err := br.Exec()
		return err
	})
	if err != nil {
		return fmt.Errorf("save checkpoint %s of slot %s: %w", lsn, slot, err)
	}
	return nil
}
