-- What tells one deployment from another among the relays that may publish
-- into one NATS stream (docs/sinks.md, "Message ids").

-- name: Identity
-- The database cluster's system identifier and the database's name.
SELECT system_identifier::text, current_database() FROM pg_control_system();

-- name: MsgIDScope
-- The first outbox id whose NATS message id carries the deployment, which
-- migration 014 recorded.
SELECT scoped_from FROM {{.MsgIDScope}};
