-- handoff_at marks a row the claim path owns: the stream handed it off, or a
-- new slot will never stream it. Adding a nullable column without a default is
-- catalog-only, but it needs an ACCESS EXCLUSIVE lock: the short lock_timeout
-- keeps writers queued behind it for at most that long, and migrate retries.
SET LOCAL lock_timeout = {{.LockTimeout}};
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS handoff_at timestamptz;
