-- outbox_publish inserts an event, or tells the caller the key is taken.
--
--   'inserted'  the row is new;
--   'duplicate' the key exists with the same five fields (IS NOT DISTINCT FROM;
--               jsonb compares semantically, so 1.0 = 1);
--   'conflict'  the key exists with other content: the stored row is untouched
--               and the attempt is kept in the conflicts table (in the
--               caller's transaction).
--
-- INSERT … ON CONFLICT DO NOTHING is the claim: there is no check-then-insert
-- window. At READ COMMITTED a second caller with the same new key waits for
-- the first to commit or roll back, then sees its row (each statement of a
-- VOLATILE function takes a fresh snapshot). At REPEATABLE READ or above the
-- committed row is invisible to the caller's snapshot and PostgreSQL raises
-- 40001 (serialization_failure): retry the transaction.
CREATE OR REPLACE FUNCTION {{.PublishFunction}}(
    p_event_type     text,
    p_aggregate_type text,
    p_aggregate_id   text,
    p_event_key      text,
    p_payload        jsonb
) RETURNS text
LANGUAGE plpgsql
VOLATILE
AS {{.Tag}}
DECLARE
    stored record;
BEGIN
    -- Retention may delete the conflicting row between the two statements;
    -- then the insert is simply tried again.
    FOR i IN 1..3 LOOP
        INSERT INTO {{.Outbox}} (event_type, aggregate_type, aggregate_id, event_key, payload)
        VALUES (p_event_type, p_aggregate_type, p_aggregate_id, p_event_key, p_payload)
        ON CONFLICT (event_key) DO NOTHING;
        IF FOUND THEN
            RETURN 'inserted';
        END IF;

        SELECT o.event_type, o.aggregate_type, o.aggregate_id, o.payload
          INTO stored
          FROM {{.Outbox}} o
         WHERE o.event_key = p_event_key;
        IF FOUND THEN
            IF stored.event_type IS NOT DISTINCT FROM p_event_type
               AND stored.aggregate_type IS NOT DISTINCT FROM p_aggregate_type
               AND stored.aggregate_id IS NOT DISTINCT FROM p_aggregate_id
               AND stored.payload IS NOT DISTINCT FROM p_payload THEN
                RETURN 'duplicate';
            END IF;
            INSERT INTO {{.Conflicts}} (event_key, event_type, aggregate_type, aggregate_id, payload)
            VALUES (p_event_key, p_event_type, p_aggregate_type, p_aggregate_id, p_payload);
            RETURN 'conflict';
        END IF;
    END LOOP;
    RAISE EXCEPTION 'outbox_publish: event_key % kept conflicting with a row that disappeared', p_event_key
        USING ERRCODE = '40001';
END
{{.Tag}};
