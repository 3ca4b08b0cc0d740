-- The idempotency ledger: the per-sink truth about each event. action is the
-- sink's configured name.
CREATE TABLE IF NOT EXISTS {{.Ledger}} (
    event_key       text NOT NULL,
    action          text NOT NULL,
    state           text NOT NULL CHECK (state IN ('sending', 'delivered', 'unknown')),
    attempts        int NOT NULL DEFAULT 0,
    owner           text,
    claimed_at      timestamptz,
    delivered_at    timestamptz,
    next_attempt_at timestamptz,
    detail          text,
    PRIMARY KEY (event_key, action)
);

-- The confirmed position of each slot, written (synchronously) before the slot
-- is acknowledged past outbox transactions.
CREATE TABLE IF NOT EXISTS {{.Checkpoint}} (
    slot_name     text PRIMARY KEY,
    confirmed_lsn pg_lsn NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- Attempts to publish an existing event_key with different content. Rows are
-- written in the caller's transaction, so they roll back with it.
CREATE TABLE IF NOT EXISTS {{.Conflicts}} (
    id             bigserial PRIMARY KEY,
    event_key      text NOT NULL,
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    payload        jsonb,
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {{.ConflictsKeyIndexName}} ON {{.Conflicts}} (event_key);
