-- The stream's record of delivery (docs/operations.md, "what the relay writes
-- back"): the ids of outbox rows the stream delivered to every sink they are
-- routed to. The relay writes it with the synchronous checkpoint that comes
-- before each acknowledgement of the slot — about 100 bytes of WAL per event,
-- instead of an UPDATE of the outbox row (about 900 bytes, with every index)
-- and a ledger row per sink (about 250 bytes each). A row that is pending,
-- not diverted, and has its id here is done; `status` derives it, and
-- `delivery.mark_done: async` writes status = 'done' as well, for tools that
-- read the column. Retention deletes the ids with their rows.
CREATE TABLE IF NOT EXISTS {{.Delivered}} (
    id bigint PRIMARY KEY
);
