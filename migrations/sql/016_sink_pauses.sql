-- Paused sinks (docs/sinks.md, "Pause and resume"). One row per sink an
-- operator paused: while its row is here, no relay sends to that sink — the
-- stream hands its events to the claim path without an attempt, and the
-- claim path puts them back — and the row's removal resumes it. Every relay
-- on this outbox reads the table, so a pause holds across restarts and for
-- each relay of an HA pair:
--   sink       the sink's name (the ledger's action);
--   paused_at  when it was paused;
--   reason     the operator's note (--reason), '' when none;
--   paused_by  who paused it: the CLI's user@host or the API's address.
-- It never holds an event: the rows stay in the outbox.
CREATE TABLE IF NOT EXISTS {{.SinkPauses}} (
    sink      text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    reason    text NOT NULL DEFAULT '',
    paused_by text NOT NULL DEFAULT ''
);
