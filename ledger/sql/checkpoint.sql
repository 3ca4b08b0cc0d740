-- The stream's checkpoint: the position the slot is confirmed to, one row
-- per slot (docs/schema.md).

-- name: LoadCheckpoint
SELECT confirmed_lsn::text FROM {{.Checkpoint}} WHERE slot_name = $1

-- name: SaveCheckpoint
-- GREATEST: a checkpoint never moves backwards, so a late or reordered
-- save (two relays racing during a takeover, a retry of an older position)
-- cannot make the relay re-ack an older position.
INSERT INTO {{.Checkpoint}} AS c (slot_name, confirmed_lsn, updated_at, handover_lsn)
VALUES ($1, $2::text::pg_lsn, now(), $2::text::pg_lsn)
    ON CONFLICT (slot_name) DO UPDATE
   SET confirmed_lsn = GREATEST(c.confirmed_lsn, EXCLUDED.confirmed_lsn), updated_at = now()
