-- An event_key longer than the relay's ledger holds ({{.MaxEventKeyBytes}} bytes:
-- docs/schema.md, "Key lengths") is refused where it is written, with its
-- length and the limit, by outbox_publish and by a plain INSERT alike: the
-- relay could never record its delivery, and would dead-letter it unsent.
--
-- A trigger, not a CHECK constraint: PostgreSQL checks a CHECK constraint,
-- even one added NOT VALID, on every UPDATE of a row, and a row whose key
-- was already longer must still be changed (the relay dead-letters it). The
-- trigger fires on INSERT only. Its WHEN condition is all an insert of a
-- key that fits costs; the function runs only for a key too long. AFTER,
-- because a BEFORE ROW trigger would turn COPY's batched inserts into
-- single ones. CREATE TRIGGER takes a lock that conflicts with inserts: the
-- short lock_timeout keeps writers queued behind it for at most that long,
-- and migrate retries.
SET LOCAL lock_timeout = {{.LockTimeout}};

CREATE OR REPLACE FUNCTION {{.KeyBoundFunction}}() RETURNS trigger
LANGUAGE plpgsql
AS {{.Tag}}
BEGIN
    RAISE EXCEPTION 'event_key is % bytes; the ledger holds at most {{.MaxEventKeyBytes}} (event_key %…)',
        octet_length(NEW.event_key), left(NEW.event_key, 40)
        USING ERRCODE = '22001', HINT = 'The relay records each delivery under its event_key; see "Key lengths" in its docs/schema.md.';
END
{{.Tag}};

DROP TRIGGER IF EXISTS {{.KeyBoundTrigger}} ON {{.Outbox}};
CREATE TRIGGER {{.KeyBoundTrigger}} AFTER INSERT ON {{.Outbox}}
    FOR EACH ROW WHEN (octet_length(NEW.event_key) > {{.MaxEventKeyBytes}})
    EXECUTE FUNCTION {{.KeyBoundFunction}}();
