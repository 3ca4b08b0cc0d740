package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/relay"
)

// closeTimeout bounds closing a connection and the best-effort work done on
// the way out (dropping a half-made slot, the last acknowledgement).
const closeTimeout = 5 * time.Second

// session runs one connection from connect to failure: checks, slot, restart
// of the consumer, then streaming. streamed reports whether the stream
// started, which resets the reconnect backoff.
func (s *Source) session(ctx context.Context) (streamed bool, err error) {
	qconn, err := pgx.ConnectConfig(ctx, s.queryConfig)
	if err != nil {
		return false, fmt.Errorf("connect: %w", err)
	}
	defer closeConn(qconn)

	senderTimeout, version, err := s.checkServer(ctx, qconn)
	if err != nil {
		return false, err
	}
	// onStandby: the server streamed from is in recovery, a standby of the
	// primary (Config.Primary); a promoted one is the primary's successor.
	onStandby := false
	if s.cfg.Primary != nil {
		if onStandby, err = inRecovery(ctx, qconn); err != nil {
			return false, err
		}
	}

	rconn, err := pgconn.ConnectConfig(ctx, s.replConfig.Copy())
	if err != nil {
		return false, replicationConnectError(err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		defer cancel()
		_ = rconn.Close(cctx)
	}()

	sys, err := pglogrepl.IdentifySystem(ctx, rconn)
	if err != nil {
		return false, fmt.Errorf("IDENTIFY_SYSTEM: %w", err)
	}
	s.log.Debug().Str("system_id", sys.SystemID).Int32("timeline", sys.Timeline).
		Str("server_wal", sys.XLogPos.String()).Msg("replication connection open")
	s.rememberWalsender(rconn.PID())
	if s.cfg.Primary != nil {
		if err := s.checkStandbyOrigin(ctx, sys); err != nil {
			return false, err
		}
		if err := s.noteDecodingStandby(ctx, qconn, onStandby); err != nil {
			return false, err
		}
	}
	if err := s.checkOrigin(ctx, sys); err != nil {
		return false, err
	}

	startLSN, handOver, err := s.ensureSlot(ctx, qconn, rconn, version, onStandby)
	if err != nil {
		return false, err
	}
	if handOver != nil {
		// Read and delivered beside the stream (deliverHandOver); closed by its
		// Deliver, or here when the session ends before.
		defer handOver.close()
	}

	// Always 0/0: the server starts at the slot's confirmed position, which
	// is the only position this Source ever acknowledged.
	err = pglogrepl.StartReplication(ctx, rconn, s.cfg.Slot, 0, pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication,
		PluginArgs: []string{
			"proto_version '1'",
			// pgoutput splits the list like SQL identifiers (unquoted names
			// are folded to lower case), so the name is quoted as an
			// identifier inside the literal.
			"publication_names " + relay.QuoteLiteral(relay.QuoteIdentifier(s.cfg.Publication)),
		},
	})
	if err != nil {
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "55006" {
			return false, s.slotInUse(ctx, rconn.PID(), err)
		}
		return false, fmt.Errorf("START_REPLICATION: %w", err)
	}

	// Everything committed before the horizon may have been streamed (and
	// delivered) before; the consumer checks such events against the
	// ledger. It is read once the slot is ours: until START_REPLICATION
	// succeeded a former leader's walsender may still have been streaming
	// events committed after a position read earlier, and the relay it
	// feeds delivering them. The server sends nothing we read before the
	// consumer has restarted.
	var horizon relay.LSN
	if handOver != nil {
		// A slot this session made streams only transactions committed
		// after its consistent point, and no slot streamed those before:
		// the old slot was dropped, and its events settled (WaitSettled),
		// before this one was made, and under this relay's leader lock no
		// other walsender streams from it. Nothing is re-streamed, so no
		// event waits for a check against the ledger of its own (one
		// round trip per transaction: the first seconds' events, behind a
		// slot that took a second to make, waited 2-4 s for those checks
		// in make bench's slot-recreated).
		horizon = startLSN
	} else if s.cfg.Primary != nil {
		// Decoding on a standby: nothing anywhere was sent past the
		// primary's flushed position (a restarted standby may not have
		// replayed again what its walsender sent before).
		if horizon, err = s.cfg.Primary.WALFlushPosition(ctx); err != nil {
			return false, err
		}
	} else if err := qconn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&horizon); err != nil {
		return false, fmt.Errorf("read the server's WAL position: %w", err)
	}
	closeConn(qconn)
	if err := s.cfg.Consumer.Restart(ctx, horizon); err != nil {
		return false, fmt.Errorf("restart consumer: %w", err)
	}

	every := s.cfg.StatusInterval
	if senderTimeout > 0 && senderTimeout/3 < every {
		every = senderTimeout / 3
	}
	s.log.Info().Str("publication", s.cfg.Publication).Str("from", startLSN.String()).
		Str("horizon", horizon.String()).Dur("status_interval", every).Msg("streaming")
	return true, s.stream(ctx, rconn, startLSN, every, senderTimeout, onStandby, handOver)
}
