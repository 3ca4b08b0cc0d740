-- handover_lsn records that the slot-creation hand-over of a slot finished:
-- the consistent point of the slot whose pending rows were handed to the
-- claim path. The relay sets it to NULL before it creates a slot and to the
-- new slot's consistent point in the transaction that hands the rows over,
-- so a slot found without it (a crash between the two) is dropped and made
-- again rather than trusted. Rows of relays that ran before this column
-- existed had finished their hand-over: they get their confirmed position.
ALTER TABLE {{.Checkpoint}} ADD COLUMN IF NOT EXISTS handover_lsn pg_lsn;
UPDATE {{.Checkpoint}} SET handover_lsn = confirmed_lsn WHERE handover_lsn IS NULL;
