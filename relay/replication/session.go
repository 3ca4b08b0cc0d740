package replication

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
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
		// Read and delivered beside the stream (finish); closed by its
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

// handOver is a new slot's hand-over, which the session finishes while it
// streams (docs/architecture.md, "slot creation").
type handOver struct {
	rows       relay.HandOverRows
	consistent relay.LSN
	foreign    bool // the slot it replaces had no hand-over record

	// Set by finish before it closes early: the aggregates whose every row
	// Early has fed (their streamed events may follow).
	earlyAggs map[relay.AggregateKey]bool
	early     chan struct{}

	// Set by finish before it closes pinned.
	release func([]relay.AggregateKey) // ends the stream's pin on aggregates of aggs
	// pinned is closed once the rows' aggregates are pinned: the decoder
	// gives the consumer nothing before (an event of such an aggregate
	// must not overtake its rows).
	pinned chan struct{}
}

// close lets the hand-over go. The session calls it once its workers
// (finish) have returned.
func (h *handOver) close() { h.rows.Close() }

// gate is the consumer the decoder feeds while a new slot's rows are read
// (docs/architecture.md, "Slot creation"): the stream starts before the
// read ends, and an event must not reach the engine before the pin of its
// aggregate, if that aggregate has rows in the snapshot. The gate asks the
// snapshot about each transaction's aggregates it has not seen (one round
// trip, through the order index): a transaction with none there, or whose
// aggregates' rows Early has all fed, goes on at once; the first with
// another waits for the pin, and everything after it follows in stream
// order. Once the pin is set every event goes on.
type gate struct {
	relay.Consumer
	h      *handOver
	clear  map[relay.AggregateKey]bool // aggregates without rows in the snapshot
	ask    []relay.AggregateKey
	passed bool // the pin is set
}

// Submit implements relay.Consumer.
func (g *gate) Submit(ctx context.Context, events []*relay.Event) error {
	if !g.passed {
		if err := g.wait(ctx, events); err != nil {
			return err
		}
	}
	return g.Consumer.Submit(ctx, events)
}

// wait returns once events may go to the engine.
func (g *gate) wait(ctx context.Context, events []*relay.Event) error {
	select {
	case <-g.h.pinned:
		g.passed = true
		return nil
	default:
	}
	g.ask = g.ask[:0]
	for _, ev := range events {
		if !ev.Ordered() {
			continue
		}
		if a := ev.AggregateKey(); !g.clear[a] && !slices.Contains(g.ask, a) {
			g.ask = append(g.ask, a)
		}
	}
	if len(g.ask) == 0 {
		return nil
	}
	pending, err := g.h.rows.Pending(ctx, g.ask)
	for early := g.h.early; ; {
		if err == nil && !g.waitsFor(pending) {
			for _, a := range g.ask {
				g.clear[a] = true
			}
			return nil
		}
		// An aggregate with rows in the snapshot not fed yet, or no
		// answer: wait for the pin (a failed read ends the session), or
		// for Early's rows.
		select {
		case <-g.h.pinned:
			g.passed = true
			return nil
		case <-early:
			early = nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// waitsFor reports whether an aggregate of pending has rows not fed yet.
func (g *gate) waitsFor(pending []relay.AggregateKey) bool {
	fed := false
	select {
	case <-g.h.early:
		fed = true
	default:
	}
	for _, a := range pending {
		if !fed || !g.h.earlyAggs[a] {
			return true
		}
	}
	return false
}

// finish reads the hand-over's rows in the slot's snapshot, pins their
// aggregates, and delivers them through the engine, beside the stream
// (docs/architecture.md, "Slot creation"). It returns nil when ctx ends
// first (the session ends for another reason; the slot, without its
// hand-over record, is made again by the next one) and an error that ends
// the session when the read or the delivery fails.
func (s *Source) finish(ctx context.Context, h *handOver) error {
	// The rows committed just before the slot, of aggregates without a
	// backlog, go first: their read comes before the whole read (beside
	// it, under make bench's load, it took twice as long), their delivery
	// beside it.
	began := time.Now()
	events, earlyAggs, err := h.rows.Early(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("deliver the newest rows pending at slot creation: %w", err)
	}
	// The read of every row's aggregate runs beside Early's delivery. It
	// is bounded: it holds the stream's events of the snapshot's
	// aggregates, and it can wait behind a lock that waits for the
	// hand-over's own transactions (a DDL on the outbox table), which
	// PostgreSQL does not see as a deadlock.
	read, _ := relay.NewGroup(ctx)
	defer read.Stop()
	var allAggs []relay.AggregateKey
	read.GoTask("read the rows pending at slot creation", func(ctx context.Context) error {
		readCtx, cancel := context.WithTimeout(ctx, s.cfg.StallAfter)
		defer cancel()
		var err error
		allAggs, err = h.rows.Aggregates(readCtx)
		if err != nil && ctx.Err() == nil && readCtx.Err() != nil {
			return fmt.Errorf("not done after %s (a lock on the outbox table?): %w", s.cfg.StallAfter, err)
		}
		return err
	})
	if err := s.cfg.Consumer.HandOver(ctx, events); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("deliver the newest rows pending at slot creation: %w", err)
	}
	if len(events) > 0 {
		s.log.Info().Str("consistent_point", h.consistent.String()).Int("rows", len(events)).Int("aggregates", len(earlyAggs)).Dur("took", time.Since(began)).
			Msg("fed first the newest rows pending in the new slot's snapshot whose aggregates have no older row there")
	}
	h.earlyAggs = make(map[relay.AggregateKey]bool, len(earlyAggs))
	for _, a := range earlyAggs {
		h.earlyAggs[a] = true
	}
	close(h.early)
	// The read runs under ctx: the session's end ends it.
	err = read.Wait()
	if ctx.Err() != nil {
		return nil
	}
	if err != nil {
		return err
	}
	// Early's aggregates have no row left to deliver: not pinned.
	aggs := slices.DeleteFunc(slices.Clone(allAggs), func(a relay.AggregateKey) bool { return h.earlyAggs[a] })
	count := h.rows.Len()
	h.release = s.cfg.Consumer.Divert(aggs)
	close(h.pinned)
	s.log.Info().Str("consistent_point", h.consistent.String()).Int("rows", count).Int("aggregates", len(aggs)).
		Msg("read the rows pending in the new slot's snapshot: each aggregate's are delivered before its new events")
	if h.foreign && count > 0 {
		s.log.Warn().Int("rows", count).Int("aggregates", len(allAggs)).Dur("expected_drain", relay.HandOverDrainEstimate(int64(count))).
			Int("at_rows_per_second", relay.HandOverRowsPerSecond).Msg("the slot found without its hand-over record was recreated: the rows pending before it are delivered now, each aggregate's before its new events, beside the stream")
	}
	// An aggregate leaves the pin as soon as its last row is queued.
	n, err := h.rows.Deliver(ctx, s.cfg.Slot, h.consistent, s.cfg.Consumer.HandOver, h.release, s.cfg.Consumer.HandOverSettled)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		// Without the record the next session drops the slot and hands
		// over what is pending then.
		return fmt.Errorf("deliver the rows pending at slot creation: %w", err)
	}
	h.release(aggs)
	s.log.Info().Str("consistent_point", h.consistent.String()).Int64("rows_delivered", n).Int("rows_first", len(events)).
		Int("aggregates", len(allAggs)).Msg("hand-over done: the rows pending in the new slot's snapshot are settled")
	return nil
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	_ = conn.Close(ctx)
}

// replicationConnectError turns the refusals that configuration must fix
// into an *UnavailableError.
func replicationConnectError(err error) error {
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		switch pgErr.Code {
		case "42501": // insufficient_privilege
			return &UnavailableError{
				Reason: "the role lacks the REPLICATION privilege (ALTER ROLE <role> WITH REPLICATION)",
				Err:    err,
			}
		case "28000": // invalid_authorization_specification: pg_hba.conf
			return &UnavailableError{
				Reason: "pg_hba.conf does not allow replication connections for this role and database (add a line for database \"replication\" or the database itself, then reload)",
				Err:    err,
			}
		}
	}
	return fmt.Errorf("connect for replication: %w", err)
}

// checkServer verifies what retrying cannot fix and returns
// wal_sender_timeout (0 when disabled) and server_version_num.
func (s *Source) checkServer(ctx context.Context, conn *pgx.Conn) (time.Duration, int, error) {
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return 0, 0, fmt.Errorf("read server_version_num: %w", err)
	}
	if s.cfg.Primary != nil {
		if err := s.checkStandby(ctx, conn, version); err != nil {
			return 0, 0, err
		}
	}
	timeout, err := s.checkPublication(ctx, conn)
	if err != nil {
		return 0, 0, err
	}
	return timeout, version, nil
}

// checkPublication checks wal_level and the publication, and returns
// wal_sender_timeout.
func (s *Source) checkPublication(ctx context.Context, conn *pgx.Conn) (time.Duration, error) {
	var walLevel, senderTimeout string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return 0, fmt.Errorf("show wal_level: %w", err)
	}
	if walLevel != "logical" {
		return 0, &UnavailableError{Reason: fmt.Sprintf(
			"wal_level is %q; logical replication needs wal_level = logical (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)", walLevel)}
	}
	if err := conn.QueryRow(ctx, "SHOW wal_sender_timeout").Scan(&senderTimeout); err != nil {
		return 0, fmt.Errorf("show wal_sender_timeout: %w", err)
	}
	timeout, err := parseServerDuration(senderTimeout)
	if err != nil {
		return 0, fmt.Errorf("wal_sender_timeout: %w", err)
	}

	var pubInsert, publishesOutbox bool
	err = conn.QueryRow(ctx, `
		SELECT p.pubinsert,
		       EXISTS (SELECT 1 FROM pg_publication_tables t
		                WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)
		  FROM pg_publication p
		 WHERE p.pubname = $1`,
		s.cfg.Publication, s.outbox.Schema, s.outbox.Name).Scan(&pubInsert, &publishesOutbox)
	create := fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert'), as the table owner, or run outbox-relay migrate",
		relay.QuoteIdentifier(s.cfg.Publication), s.outbox.Quoted())
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, &UnavailableError{Reason: fmt.Sprintf("publication %q does not exist (%s)", s.cfg.Publication, create)}
	case err != nil:
		return 0, fmt.Errorf("look up publication %q: %w", s.cfg.Publication, err)
	case !publishesOutbox:
		return 0, &UnavailableError{Reason: fmt.Sprintf("publication %q does not publish table %s (ALTER PUBLICATION %s ADD TABLE %s)",
			s.cfg.Publication, s.outbox, relay.QuoteIdentifier(s.cfg.Publication), s.outbox.Quoted())}
	case !pubInsert:
		return 0, &UnavailableError{Reason: fmt.Sprintf("publication %q does not publish inserts (ALTER PUBLICATION %s SET (publish = 'insert'))",
			s.cfg.Publication, relay.QuoteIdentifier(s.cfg.Publication))}
	}
	return timeout, nil
}

// parseServerDuration parses a time setting as SHOW prints it ("1min",
// "500ms", "0"); a bare number is in milliseconds, as for
// wal_sender_timeout.
func parseServerDuration(v string) (time.Duration, error) {
	v = strings.TrimSpace(v)
	i := 0
	for i < len(v) && (v[i] >= '0' && v[i] <= '9' || v[i] == '-') {
		i++
	}
	n, err := strconv.ParseInt(v[:i], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("invalid duration %q", v)
	}
	var unit time.Duration
	switch strings.TrimSpace(v[i:]) {
	case "", "ms":
		unit = time.Millisecond
	case "us":
		unit = time.Microsecond
	case "s":
		unit = time.Second
	case "min":
		unit = time.Minute
	case "h":
		unit = time.Hour
	case "d":
		unit = 24 * time.Hour
	default:
		return 0, fmt.Errorf("invalid duration %q", v)
	}
	if n <= 0 {
		return 0, nil
	}
	return time.Duration(n) * unit, nil
}

// slotDetails is what ensureSlot needs to know about an existing slot.
type slotDetails struct {
	exists         bool
	slotType       string
	plugin         string
	database       string
	sameDatabase   bool
	walStatus      string
	confirmedFlush relay.LSN
	activePID      int32
	// failover is pg_replication_slots.failover (17+): the slot is synced
	// to standbys with sync_replication_slots; false on older servers.
	failover bool

	// invalidationReason is pg_replication_slots.invalidation_reason (17+),
	// "" when the slot is valid or the server is older.
	invalidationReason string
	// synced is pg_replication_slots.synced (17+): on a standby, a copy of
	// the primary's slot that sync_replication_slots keeps.
	synced bool
}

// invalidated reports whether the server has invalidated the slot, so that
// it can no longer stream, and why. wal_status "lost" says so on every
// supported version: on 13-15 the one cause is WAL removed past
// max_slot_wal_keep_size, and from 16 on every invalidation shows as lost.
// From 17 on invalidation_reason names the cause ("wal_removed",
// "rows_removed", "wal_level_insufficient", and on 18 "idle_timeout" for a
// slot unused longer than idle_replication_slot_timeout); it is checked as
// well, so that no cause is missed whatever wal_status shows.
func (d slotDetails) invalidated() (bool, string) {
	switch {
	case d.invalidationReason != "":
		return true, d.invalidationReason
	case d.walStatus == "lost":
		return true, "wal_status lost"
	}
	return false, ""
}

func lookUpSlot(ctx context.Context, conn *pgx.Conn, slot string) (slotDetails, error) {
	d := slotDetails{exists: true}
	// to_jsonb(s) ->> 'invalidation_reason' is NULL on servers before 17,
	// which lack the column: one query for every version.
	err := conn.QueryRow(ctx, `
		SELECT slot_type, coalesce(plugin, ''), coalesce(database, ''),
		       coalesce(database = current_database(), false),
		       coalesce(wal_status, ''), coalesce(to_jsonb(s) ->> 'invalidation_reason', ''),
		       confirmed_flush_lsn::text, coalesce(active_pid, 0),
		       coalesce((to_jsonb(s) ->> 'failover')::bool, false),
		       coalesce((to_jsonb(s) ->> 'synced')::bool, false)
		  FROM pg_replication_slots s
		 WHERE slot_name = $1`, slot).
		Scan(&d.slotType, &d.plugin, &d.database, &d.sameDatabase, &d.walStatus, &d.invalidationReason, &d.confirmedFlush, &d.activePID, &d.failover, &d.synced)
	if errors.Is(err, pgx.ErrNoRows) {
		return slotDetails{}, nil
	}
	if err != nil {
		return slotDetails{}, fmt.Errorf("look up replication slot %q: %w", slot, err)
	}
	return d, nil
}

// SlotInfo reports the replication slot named slot from pg_replication_slots:
// whether it exists, its wal_status ("reserved", "extended", "unreserved" or
// "lost"; "" when it has none), its confirmed_flush_lsn (0 when it has none)
// and the PID of the process streaming from it (0 when none). It only reads,
// so it is safe to call at any time, on any ordinary connection.
func SlotInfo(ctx context.Context, conn *pgx.Conn, slot string) (exists bool, walStatus string, confirmedFlush relay.LSN, activePID int32, err error) {
	d, err := lookUpSlot(ctx, conn, slot)
	if err != nil {
		return false, "", 0, 0, err
	}
	return d.exists, d.walStatus, d.confirmedFlush, d.activePID, nil
}

// ensureSlot returns the position streaming will start from, creating the
// slot (through the snapshot hand-over) when it is missing or lost.
func (s *Source) ensureSlot(ctx context.Context, qconn *pgx.Conn, rconn *pgconn.PgConn, version int, onStandby bool) (relay.LSN, *handOver, error) {
	if onStandby {
		s.dropPrimarySlot(ctx)
	}
	slot, err := lookUpSlot(ctx, qconn, s.cfg.Slot)
	if err != nil {
		return 0, nil, err
	}
	foreign := false // the slot exists without the relay's hand-over record
	if slot.exists {
		switch {
		case onStandby && slot.synced:
			return 0, nil, errSyncedCopy
		case slot.slotType != "logical":
			return 0, nil, &UnavailableError{Reason: fmt.Sprintf("replication slot %q is a %s slot; choose another slot name", s.cfg.Slot, slot.slotType)}
		case !slot.sameDatabase:
			return 0, nil, &UnavailableError{Reason: fmt.Sprintf("replication slot %q belongs to database %q; choose another slot name", s.cfg.Slot, slot.database)}
		case slot.plugin != "pgoutput":
			return 0, nil, &UnavailableError{Reason: fmt.Sprintf("replication slot %q uses plugin %q, not pgoutput; drop it or choose another slot name", s.cfg.Slot, slot.plugin)}
		}
		handedOver, err := s.cfg.HandOver.HandedOver(ctx, s.cfg.Slot)
		if err != nil {
			return 0, nil, err
		}
		invalidated, reason := slot.invalidated()
		foreign = !invalidated && !handedOver
		switch {
		case invalidated:
			s.log.Warn().Str("reason", reason).Msg("replication slot was invalidated; dropping and recreating it")
		case !handedOver && s.cfg.Primary != nil:
			s.log.Warn().Msg("replication slot on the standby has no record of its hand-over (delivery moved to the primary since, or the relay stopped between creating it and handing the rows pending then to the claim path): dropping and recreating it")
		case !handedOver:
			// docs/failover.md "A slot without its hand-over record"
			s.log.Warn().Msg("replication slot has no record of its hand-over (another process created it, or the relay stopped between creating it and delivering the rows pending then): " +
				"the rows committed behind it may never be streamed, so the safe rule applies: dropping and recreating it, and delivering every row pending now beside the stream")
		default:
			if slot.walStatus == "unreserved" {
				s.log.Warn().Msg("replication slot retains more WAL than max_slot_wal_keep_size; it will be invalidated unless it catches up")
			}
			if s.ownStaleWalsender(uint32(slot.activePID), rconn.PID()) {
				_ = s.endOwnWalsender(ctx, qconn, uint32(slot.activePID))
			} else if slot.activePID != 0 {
				s.log.Warn().Int32("pid", slot.activePID).Msg("replication slot is in use by another process")
			}
			if version >= failoverVersion && !slot.failover && s.cfg.Primary == nil {
				s.enableFailover(ctx, rconn, slot.activePID)
			}
			return slot.confirmedFlush, nil, nil
		}
		if err := pglogrepl.DropReplicationSlot(ctx, rconn, s.cfg.Slot, pglogrepl.DropReplicationSlotOptions{}); err != nil {
			return 0, nil, fmt.Errorf("drop replication slot: %w", err)
		}
	}

	if s.cfg.WaitSettled != nil {
		if err := s.cfg.WaitSettled(ctx); err != nil {
			return 0, nil, fmt.Errorf("wait for the consumer to settle before creating the slot: %w", err)
		}
	}
	if err := s.cfg.HandOver.BeginSlot(ctx, s.cfg.Slot); err != nil {
		return 0, nil, err
	}
	var res pglogrepl.CreateReplicationSlotResult
	if onStandby {
		// The slot's consistent point must come after every write the
		// relay made before (BeginSlot included): docs/standby.md.
		if _, err := s.waitReplayed(ctx, qconn); err != nil {
			return 0, nil, err
		}
	}
	createCtx, cancel := context.WithTimeout(ctx, s.cfg.StallAfter)
	defer cancel()
	if onStandby {
		res, err = s.createStandbySlot(createCtx, rconn)
	} else {
		res, err = createSlot(createCtx, rconn, s.cfg.Slot, version)
	}
	if err != nil && ctx.Err() == nil && createCtx.Err() != nil {
		return 0, nil, fmt.Errorf("create replication slot: not done after %s: %s", s.cfg.StallAfter, s.slotCreationWaitsFor(ctx, qconn, onStandby))
	}
	if err != nil {
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "53400" {
			return 0, nil, &UnavailableError{Reason: "all replication slots are in use (raise max_replication_slots, or drop an unused slot)", Err: err}
		}
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && onStandby && pgErr.Code == "55000" && strings.Contains(pgErr.Message, "primary") {
			return 0, nil, &UnavailableError{Reason: "the primary's wal_level is not logical: decoding on a standby needs wal_level = logical on the primary (ALTER SYSTEM SET wal_level = logical there, then restart it)", Err: err}
		}
		return 0, nil, fmt.Errorf("create replication slot: %w", err)
	}
	consistent, err := relay.ParseLSN(res.ConsistentPoint)
	if err != nil {
		return 0, nil, fmt.Errorf("create replication slot: consistent point: %w", err)
	}

	// The snapshot stays valid while rconn runs no other command: the rows
	// pending in it are exactly the rows the new slot will never stream.
	if s.cfg.Primary != nil {
		n, err := s.cfg.Primary.MarkForClaimFromStandby(ctx, qconn, s.cfg.Slot, res.SnapshotName, consistent)
		if err != nil {
			// Without the hand-over those rows would stay pending unseen:
			// drop the slot so that the next attempt repeats it.
			s.dropAfterFailedHandOver(rconn)
			return 0, nil, fmt.Errorf("hand the rows pending at slot creation to the claim path: %w", err)
		}
		s.log.Info().Str("consistent_point", consistent.String()).Int64("rows_handed_to_claim_path", n).Bool("on_standby", onStandby).
			Msg("created replication slot; rows pending in its snapshot go to the claim path")
		return consistent, nil, nil
	}
	// On the primary the snapshot is imported into a transaction that
	// holds it, and the slot streams while its rows are read and delivered
	// (Source.finish); the decoder waits for their aggregates' pin.
	rows, err := s.cfg.HandOver.OpenHandOver(ctx, res.SnapshotName)
	if err != nil {
		s.dropAfterFailedHandOver(rconn)
		return 0, nil, fmt.Errorf("import the new slot's snapshot: %w", err)
	}
	s.log.Info().Str("consistent_point", consistent.String()).Bool("failover", version >= failoverVersion).
		Msg("created replication slot; the rows pending in its snapshot are delivered while it streams")
	return consistent, &handOver{rows: rows, consistent: consistent, foreign: foreign, early: make(chan struct{}), pinned: make(chan struct{})}, nil
}

// slotCreationWaitsFor names what a slot's creation that did not finish
// waits for: on the primary, the transactions running when it began (the
// oldest open ones, read on qconn); on a standby, a running-transactions
// record from the primary.
func (s *Source) slotCreationWaitsFor(ctx context.Context, qconn *pgx.Conn, onStandby bool) string {
	if onStandby {
		return "on a standby it waits for a running-transactions record from the primary (pg_log_standby_snapshot(): see the warning above, if any), then for the primary's transactions running then to end"
	}
	what := "it waits for the transactions running when it began to end"
	qctx, cancel := context.WithTimeout(ctx, closeTimeout)
	defer cancel()
	rows, err := qconn.Query(qctx, `
		SELECT pid, coalesce(state, ''), application_name, xact_start
		  FROM pg_stat_activity
		 WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
		 ORDER BY xact_start
		 LIMIT 3`)
	if err != nil {
		return what
	}
	var open []string
	var (
		pid        int32
		state, app string
		started    time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&pid, &state, &app, &started}, func() error {
		open = append(open, fmt.Sprintf("pid %d (%s, application %q, open since %s)", pid, state, app, started.UTC().Format(time.RFC3339)))
		return nil
	})
	if err != nil || len(open) == 0 {
		return what
	}
	return what + "; the oldest open now: " + strings.Join(open, ", ")
}

func (s *Source) dropAfterFailedHandOver(rconn *pgconn.PgConn) {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	err := pglogrepl.DropReplicationSlot(ctx, rconn, s.cfg.Slot, pglogrepl.DropReplicationSlotOptions{})
	if err == nil {
		return
	}
	// The replication connection may be what failed; try an ordinary one.
	conn, cerr := pgx.ConnectConfig(ctx, s.queryConfig)
	if cerr == nil {
		defer closeConn(conn)
		_, err = conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", s.cfg.Slot)
	}
	if err != nil {
		s.log.Error().Err(err).Msg("could not drop the replication slot after a failed hand-over: rows pending at its creation " +
			"will not be streamed; they raise the sweep_after alarm, and outbox-relay reconcile hands them to the claim path")
	}
}
