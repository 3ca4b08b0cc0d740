---- tern: disable-tx ----
-- Dead-letter notifications (docs/operations.md, "Dead-letter
-- notifications"). The notifier reads the failed and held rows in the order
-- they were settled (processed_at, then id), after the mark it recorded for
-- each sink; this table holds those marks, one row per sink notified about
-- ("*": the dead letters whose last_error names no sink):
--   notified_at, notified_id  the last settled row notified about, or passed
--                             over because it did not concern the sink;
--   sent_at                   when the last notification was accepted;
--   attempted_at, attempted_by when a relay last claimed the sink's next
--                             notification, and which: a claim is taken only
--                             while the mark is the one the relay read and
--                             the last attempt is an interval old, so two
--                             relays never send the same notification.
-- It never holds an event: the rows stay in the outbox.
CREATE TABLE IF NOT EXISTS {{.NotifyState}} (
    channel      text PRIMARY KEY,
    notified_at  timestamptz NOT NULL,
    notified_id  bigint NOT NULL,
    sent_at      timestamptz,
    attempted_at timestamptz,
    attempted_by text
);

-- The notifier's read: "failed or held, settled after the mark, oldest
-- first". The status indexes cannot serve it in that order; this partial
-- index holds only the dead-letter queue. Built CONCURRENTLY, like 003
-- (a build cut short is dropped and built again by migrate).
SET lock_timeout = {{.LockTimeout}};

CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.DeadLetterIndexName}}
    ON {{.Outbox}} (processed_at, id)
    WHERE status IN ('failed', 'held');
