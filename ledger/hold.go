package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/relay"
)

// ClaimSending records, before a send to a sink with on_unknown: hold, that
// owner is sending key: a new 'sending' ledger row with attempts 1, or an
// 'unknown' row (held, then released by a person) taken again with attempts
// incremented. It reports false when the pair is delivered or already
// 'sending' — claimed by another owner, or by this one before a crash, whose
// outcome is therefore unknown: the caller must not send. Restreamed tells a
// delivered pair apart.
//
// The claim commits synchronously before ClaimSending returns true, so a
// crash after the send finds it. Calling it again for a pair the caller
// already holds returns false: a caller retrying after a transient failure
// keeps its claim instead.
func (s *Store) ClaimSending(ctx context.Context, key relay.LedgerKey, owner string) (bool, error) {
	var claimed bool
	err := s.inTx(ctx, s.sql.setSynchronousCommit, func(b *pgx.Batch) {
		b.Queue(s.sql.claimSending, key.EventKey, key.Action, owner)
	}, func(br pgx.BatchResults) error {
		err := br.QueryRow().Scan(&claimed)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		return err
	})
	if err != nil {
		return false, fmt.Errorf("claim %s for %s: %w", keyString(key), owner, err)
	}
	return claimed, nil
}

// Release withdraws owner's 'sending' claim on key after a send that is known
// not to have reached the sink (nothing was written), before the event is
// handed to the claim path. A claim that is not owner's, or no longer
// 'sending', is left alone. Safe to repeat.
func (s *Store) Release(ctx context.Context, key relay.LedgerKey, owner string) error {
	if _, err := s.pool.Exec(ctx, s.sql.release, key.EventKey, key.Action, owner); err != nil {
		return fmt.Errorf("release claim %s of %s: %w", keyString(key), owner, err)
	}
	return nil
}

// Hold records that the outcome of sending key is unknown and parks row id
// for a person, in one synchronous statement: the ledger pair becomes
// 'unknown' with reason as its detail, and the row, if still pending, becomes
// 'held' with reason as last_error. A held row blocks its aggregate (Diverted
// reports it). A pair the ledger already shows delivered has a known outcome:
// nothing changes. A row no longer pending (already held for another sink,
// settled) keeps its status. Safe to repeat.
func (s *Store) Hold(ctx context.Context, id int64, key relay.LedgerKey, reason string) error {
	err := s.inTx(ctx, s.sql.setSynchronousCommit, func(b *pgx.Batch) {
		b.Queue(s.sql.hold, key.EventKey, key.Action, reason, id)
	}, func(br pgx.BatchResults) error {
		_, err := br.Exec()
		return err
	})
	if err != nil {
		return fmt.Errorf("hold row %d (%s): %w", id, keyString(key), err)
	}
	return nil
}

func keyString(k relay.LedgerKey) string {
	return fmt.Sprintf("%q/%q", k.EventKey, k.Action)
}
