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

-- run reads it. It holds one number, the outbox id where the scoping began:
-- any role may read it, so that the upgrade needs no new GRANT.
GRANT SELECT ON {{.MsgIDScope}} TO PUBLIC;
