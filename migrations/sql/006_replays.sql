-- replays counts operator replays of a row (outbox-relay replay). The claim
-- path passes it to the sinks as Delivery.Replay, so NATS publishes a replay
-- with the derived Msg-Id "<event_key>~r<n>" and the stream's duplicate
-- window does not swallow it. NULL means never replayed. Like 002, a nullable
-- column without a default is catalog-only, but it needs an ACCESS EXCLUSIVE
-- lock: the short lock_timeout keeps writers queued behind it for at most
-- that long, and migrate retries.
SET LOCAL lock_timeout = {{.LockTimeout}};
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS replays int;
