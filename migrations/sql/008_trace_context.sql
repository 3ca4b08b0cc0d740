-- trace_context holds the W3C trace context an application attaches to an
-- event, as the carrier object an OpenTelemetry propagator fills:
-- {"traceparent": "00-…-…-01", "tracestate": "…"}. The relay forwards it to
-- the sinks and parents its delivery spans on it (docs/ecosystem.md). It is
-- never checked here: a bad value must not fail the business transaction
-- that writes the event; the relay drops it instead. Like 002, a nullable
-- column without a default is catalog-only, but it needs an ACCESS EXCLUSIVE
-- lock: the short lock_timeout keeps writers queued behind it for at most
-- that long, and migrate retries.
SET LOCAL lock_timeout = {{.LockTimeout}};
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS trace_context jsonb;
-- The trace context of a conflicting attempt tells which request made it.
ALTER TABLE {{.Conflicts}} ADD COLUMN IF NOT EXISTS trace_context jsonb;

-- An existing column of that name must be jsonb: the relay reads its text
-- form as JSON.
DO {{.Tag}}
DECLARE
    typ text;
BEGIN
    SELECT format_type(a.atttypid, a.atttypmod) INTO typ
      FROM pg_attribute a
     WHERE a.attrelid = {{.OutboxLiteral}}::regclass AND a.attname = 'trace_context' AND NOT a.attisdropped;
    IF typ <> 'jsonb' THEN
        RAISE EXCEPTION 'column trace_context of % has type %; the relay needs jsonb: rename the column, or ALTER it to jsonb', {{.OutboxLiteral}}, typ;
    END IF;
END
{{.Tag}};

-- outbox_publish with a sixth argument, the trace context. It is a new
-- overload rather than a DEFAULT on the old function: adding a parameter
-- takes DROP and CREATE, which would lose the function's grants, and a
-- second function with a DEFAULT beside the old one would make every
-- five-argument call ambiguous. Five-argument calls (positional or named)
-- reach the old signature, which now calls this one with NULL.
--
-- The trace context is not part of the event: a retry of the publish from
-- another trace is still a 'duplicate', and the stored row keeps the trace
-- context of the call that inserted it. Otherwise as 005.
CREATE OR REPLACE FUNCTION {{.PublishFunction}}(
    p_event_type     text,
    p_aggregate_type text,
    p_aggregate_id   text,
    p_event_key      text,
    p_payload        jsonb,
    p_trace_context  jsonb
) RETURNS text
LANGUAGE plpgsql
VOLATILE
AS {{.Tag}}
DECLARE
    stored record;
BEGIN
    FOR i IN 1..3 LOOP
        INSERT INTO {{.Outbox}} (event_type, aggregate_type, aggregate_id, event_key, payload, trace_context)
        VALUES (p_event_type, p_aggregate_type, p_aggregate_id, p_event_key, p_payload, p_trace_context)
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
            INSERT INTO {{.Conflicts}} (event_key, event_type, aggregate_type, aggregate_id, payload, trace_context)
            VALUES (p_event_key, p_event_type, p_aggregate_type, p_aggregate_id, p_payload, p_trace_context);
            RETURN 'conflict';
        END IF;
    END LOOP;
    RAISE EXCEPTION 'outbox_publish: event_key % kept conflicting with a row that disappeared', p_event_key
        USING ERRCODE = '40001';
END
{{.Tag}};

-- The new signature gets the old one's privileges, so that a REVOKE FROM
-- PUBLIC made on the old function is not undone by a new function that
-- everyone may execute.
DO {{.Tag}}
DECLARE
    old_acl aclitem[];
    grant_to record;
BEGIN
    SELECT p.proacl INTO old_acl FROM pg_proc p
     WHERE p.oid = {{.PublishLiteral5}}::regprocedure;
    IF old_acl IS NULL THEN
        RETURN; -- the default privileges, which the new function has too
    END IF;
    EXECUTE 'REVOKE ALL ON FUNCTION ' || {{.PublishLiteral6}} || ' FROM PUBLIC';
    FOR grant_to IN
        SELECT a.grantee, bool_or(a.is_grantable) AS grantable
          FROM aclexplode(old_acl) a
         WHERE a.privilege_type = 'EXECUTE'
         GROUP BY a.grantee
    LOOP
        EXECUTE 'GRANT EXECUTE ON FUNCTION ' || {{.PublishLiteral6}} || ' TO '
             || CASE WHEN grant_to.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(grant_to.grantee)) END
             || CASE WHEN grant_to.grantable THEN ' WITH GRANT OPTION' ELSE '' END;
    END LOOP;
END
{{.Tag}};

-- Five-argument calls keep working, with no trace context.
CREATE OR REPLACE FUNCTION {{.PublishFunction}}(
    p_event_type     text,
    p_aggregate_type text,
    p_aggregate_id   text,
    p_event_key      text,
    p_payload        jsonb
) RETURNS text
LANGUAGE sql
VOLATILE
AS {{.Tag}}
    SELECT {{.PublishFunction}}(p_event_type, p_aggregate_type, p_aggregate_id, p_event_key, p_payload, NULL::jsonb)
{{.Tag}};
