-- Retention: pruning old done and discarded rows with their ledger rows,
-- and old ledger rows whose outbox row is gone (docs/operations.md,
-- "Retention"). Finding old rows reads the tables in slices of rows by
-- primary key, so each statement is short however large the tables.
-- Ages go to the server in microseconds ($1): the cut-off is computed from
-- the server's clock, like processed_at and delivered_at.

-- name: RetentionSample
-- The WAL position and the oldest transaction now, a sample the slot must
-- pass before rows older than it may go.
SELECT pg_current_wal_insert_lsn()::text, pg_snapshot_xmin(pg_current_snapshot())::text::bigint;

-- name: RetentionSlotConfirmed
SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1;

-- name: RetentionOutboxSlice
-- Where a slice of the outbox after id $1 ends: the $2-th row after its
-- start, or the table's last row (the last slice; rows added since wait
-- for the next pass). NULL: nothing after the start.
SELECT coalesce(n.id, m.id), n.id IS NULL
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT id FROM {{.Outbox}} WHERE id > $1 ORDER BY id OFFSET $2 - 1 LIMIT 1) AS n ON true
  LEFT JOIN LATERAL (SELECT id FROM {{.Outbox}} WHERE id > $1 ORDER BY id DESC LIMIT 1) AS m ON true;

-- name: RetentionPruneDone
-- At most $2 done and discarded rows of the slice $4 < id <= $5 older than
-- $1, with their ledger rows: an event's ledger rows go with its row
-- (docs/guarantees.md, "a key published again"): a key published again
-- after its row was pruned is a new event on either path, never skipped
-- as delivered. $3: the rows' inserting transactions must be older than
-- this xid (NULL: no bound), so no row the slot could still send again
-- goes; age() compares xids across wraparound, and a frozen xmin is older
-- than any. Rows locked by someone else (a replay in progress) are skipped;
-- the status is checked again as the row is deleted, so a row replayed
-- meanwhile is kept.
WITH gone AS (
DELETE FROM {{.Outbox}} AS o
 WHERE o.id IN (
       SELECT x.id FROM {{.Outbox}} AS x
        WHERE x.id > $4 AND x.id <= $5
          AND x.status IN ('done', 'discarded') AND coalesce(x.processed_at, x.created_at) < now() - $1 * interval '1 microsecond'
          AND ($3::bigint IS NULL OR age(x.xmin) > age($3::bigint::text::xid))
        ORDER BY x.id
        LIMIT $2
          FOR UPDATE SKIP LOCKED)
   AND o.status IN ('done', 'discarded')
RETURNING o.event_key),
ledger AS (
DELETE FROM {{.Ledger}} AS l USING gone WHERE l.event_key = gone.event_key RETURNING 1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM ledger);

-- name: RetentionLedgerSliceFirst
-- Where the first slice of the ledger from ($1, $2) (included) ends: the
-- $3-th row, or the table's last row. NULL: nothing from the start.
SELECT coalesce(n.event_key, m.event_key), coalesce(n.action, m.action), n.event_key IS NULL
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT event_key, action FROM {{.Ledger}} WHERE (event_key, action) >= ($1, $2)
                      ORDER BY event_key, action OFFSET $3 - 1 LIMIT 1) AS n ON true
  LEFT JOIN LATERAL (SELECT event_key, action FROM {{.Ledger}} WHERE (event_key, action) >= ($1, $2)
                      ORDER BY event_key DESC, action DESC LIMIT 1) AS m ON true;

-- name: RetentionLedgerSliceNext
-- RetentionLedgerSliceFirst for a slice after ($1, $2) (excluded).
SELECT coalesce(n.event_key, m.event_key), coalesce(n.action, m.action), n.event_key IS NULL
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT event_key, action FROM {{.Ledger}} WHERE (event_key, action) > ($1, $2)
                      ORDER BY event_key, action OFFSET $3 - 1 LIMIT 1) AS n ON true
  LEFT JOIN LATERAL (SELECT event_key, action FROM {{.Ledger}} WHERE (event_key, action) > ($1, $2)
                      ORDER BY event_key DESC, action DESC LIMIT 1) AS m ON true;

-- name: RetentionPruneLedgerFirst
-- An event's ledger rows are its record of delivery: they go with its row
-- (RetentionPruneDone), never before it (docs/guarantees.md, "Retention").
-- This takes at most $2 ledger rows whose outbox row is gone — deleted by
-- someone else, or pruned before a ledger row of a late claim was written
-- — once they are older than $1, or at once when they carry no time. The
-- NOT EXISTS probes the outbox's unique index on event_key per ledger row
-- of the slice (OFFSET 0 keeps it from becoming an anti-join that reads
-- the whole outbox). The slice is ($3, $4) (included, the first slice) to
-- ($5, $6).
DELETE FROM {{.Ledger}}
 WHERE ctid = ANY (ARRAY(
       SELECT l.ctid FROM {{.Ledger}} AS l
        WHERE (l.event_key, l.action) >= ($3, $4) AND (l.event_key, l.action) <= ($5, $6)
          AND (coalesce(l.delivered_at, l.claimed_at) < now() - $1 * interval '1 microsecond'
               OR (l.delivered_at IS NULL AND l.claimed_at IS NULL))
          AND NOT EXISTS (SELECT 1 FROM {{.Outbox}} AS o WHERE o.event_key = l.event_key OFFSET 0)
        ORDER BY l.event_key, l.action
        LIMIT $2
          FOR UPDATE SKIP LOCKED));

-- name: RetentionPruneLedgerNext
-- RetentionPruneLedgerFirst for a slice after ($3, $4) (excluded).
DELETE FROM {{.Ledger}}
 WHERE ctid = ANY (ARRAY(
       SELECT l.ctid FROM {{.Ledger}} AS l
        WHERE (l.event_key, l.action) > ($3, $4) AND (l.event_key, l.action) <= ($5, $6)
          AND (coalesce(l.delivered_at, l.claimed_at) < now() - $1 * interval '1 microsecond'
               OR (l.delivered_at IS NULL AND l.claimed_at IS NULL))
          AND NOT EXISTS (SELECT 1 FROM {{.Outbox}} AS o WHERE o.event_key = l.event_key OFFSET 0)
        ORDER BY l.event_key, l.action
        LIMIT $2
          FOR UPDATE SKIP LOCKED));
