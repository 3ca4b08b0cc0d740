-- The stream's record of delivery of 009 is folded into the rows' status and
-- dropped. Every pair the relay delivers now has its delivered ledger row,
-- on both paths: the one record of delivery (docs/operations.md, "what the
-- relay writes back"). An id in the old record means the stream delivered
-- that row to every sink it was routed to, so the row is done; its ledger
-- rows were never written (docs/schema.md, "upgrading"). Only rows the relay
-- itself recorded change. Stop relays of the earlier version first: they
-- write the old record.
SET LOCAL lock_timeout = {{.LockTimeout}};

UPDATE {{.Outbox}} AS o
   SET status = 'done', processed_at = coalesce(o.processed_at, now())
  FROM {{.Delivered}} AS d
 WHERE d.id = o.id AND o.status = 'pending' AND o.handoff_at IS NULL;

DROP TABLE {{.Delivered}};
