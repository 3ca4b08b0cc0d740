-- Since this migration the NATS sink's message id carries the deployment's
-- identity (docs/sinks.md, "Message ids"): event keys are unique per outbox,
-- not per NATS account, and JetStream deduplicates per stream. The version
-- before it published every event under its bare key. scoped_from is the
-- first outbox id whose message id is scoped: the events that exist now keep
-- their bare key, so a re-send of one after the upgrade (its first send's
-- outcome unknown) is still dropped as a duplicate within the stream's
-- window. Stop relays of the earlier version before migrate
-- (docs/schema.md, "Upgrading"): an event they publish after this point
-- would be re-sent under the scoped id.
CREATE TABLE IF NOT EXISTS {{.MsgIDScope}} (
    scoped_from bigint NOT NULL CHECK (scoped_from >= 0)
);
-- A row inserted with a lower id that commits later was never published by
-- a stopped relay; it is still below, and keeps its bare key.
INSERT INTO {{.MsgIDScope}} (scoped_from)
SELECT coalesce((SELECT max(id) FROM {{.Outbox}}), 0) + 1
 WHERE NOT EXISTS (SELECT FROM {{.MsgIDScope}});

-- run reads it: every role that may read the outbox may read it.
DO {{.Tag}}
DECLARE
    grant_to record;
BEGIN
    FOR grant_to IN
        SELECT DISTINCT a.grantee
          FROM pg_class c, aclexplode(c.relacl) a
         WHERE c.oid = {{.OutboxLiteral}}::regclass AND a.privilege_type = 'SELECT'
    LOOP
        EXECUTE 'GRANT SELECT ON ' || {{.MsgIDScopeLiteral}} || ' TO '
             || CASE WHEN grant_to.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(grant_to.grantee)) END;
    END LOOP;
END
{{.Tag}};
