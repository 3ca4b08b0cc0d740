-- Tables the outbox workflow (outbox-workflow.json) uses, in the database its
-- Postgres credential "outbox-relay-postgres" points at. Safe to run twice.

-- One row per event the workflow has taken on. The claim is the primary key:
-- a second delivery of the same event_key finds the row and does nothing.
-- done_at is set once the business step finished; a row without it belongs
-- to an execution that is still running, or that died between the claim and
-- the end of the business step (see README: "Claims without done_at").
CREATE TABLE IF NOT EXISTS n8n_processed_events (
    event_key  text PRIMARY KEY,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    done_at    timestamptz
);

-- What the placeholder business step writes: one row per applied event.
-- Replace the step (and drop this table) with your own logic. There is
-- deliberately no unique constraint: the end-to-end test counts rows per
-- event_key to prove each event was applied exactly once.
CREATE TABLE IF NOT EXISTS n8n_business_effects (
    id         bigserial PRIMARY KEY,
    event_key  text NOT NULL,
    event_type text,
    event_id   bigint,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS n8n_business_effects_event_key ON n8n_business_effects (event_key);
