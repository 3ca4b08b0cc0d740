-- The seed shape of the outbox table, created only when the table is absent
-- (the Go step that runs this checks first). An existing table of this shape
-- is left exactly as it is: its rows and its own indexes are the user's.
CREATE TABLE {{.Outbox}} (
    id             bigserial PRIMARY KEY,
    event_type     text,
    aggregate_type text,
    aggregate_id   text,
    event_key      text NOT NULL UNIQUE,
    payload        jsonb,
    status         text DEFAULT 'pending',
    attempts       int DEFAULT 0,
    available_at   timestamptz DEFAULT now(),
    locked_at      timestamptz,
    locked_by      text,
    last_error     text,
    created_at     timestamptz DEFAULT now(),
    processed_at   timestamptz
);

-- The table is new and empty, so plain (not CONCURRENTLY) builds block nobody.
CREATE INDEX {{.StatusIndex}} ON {{.Outbox}} (status, available_at, created_at);
CREATE INDEX {{.AggregateIndex}} ON {{.Outbox}} (aggregate_type, aggregate_id, created_at);
