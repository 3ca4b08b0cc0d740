package main

import "testing"

func TestStatementKind(t *testing.T) {
	for _, c := range []struct{ query, want string }{
		{`WITH t AS (SELECT unnest($1::bigint[]) AS id),
u AS (UPDATE "public"."integration_outbox" o SET status = 'done', processed_at = now() FROM t WHERE o.id = t.id RETURNING o.id)
SELECT t.id FROM t WHERE NOT EXISTS (SELECT FROM "public"."integration_outbox" v WHERE v.id = t.id)`, stmtOutbox},
		{`INSERT INTO "integration_idempotency" AS l (event_key, action, state, attempts, owner, claimed_at, delivered_at)
SELECT t.k, t.a, 'delivered', 1, $3, now(), now() FROM (SELECT DISTINCT k, a FROM unnest($1::text[], $2::text[]) AS u(k, a) ORDER BY k, a) AS t
    ON CONFLICT (event_key, action) DO UPDATE SET state = 'delivered'`, stmtLedger},
		{`WITH c AS (SELECT o.id FROM "integration_outbox" AS o WHERE o.status = 'pending' FOR UPDATE SKIP LOCKED)
UPDATE "integration_outbox" AS o SET status = 'done', processed_at = now() FROM c WHERE o.id = c.id`, stmtOutbox},
		{`INSERT INTO "relay_checkpoint" AS c (slot_name, confirmed_lsn, updated_at, handover_lsn) VALUES ($1, $2::text::pg_lsn, now(), NULL)
    ON CONFLICT (slot_name) DO UPDATE SET confirmed_lsn = GREATEST(c.confirmed_lsn, excluded.confirmed_lsn)`, stmtCheckpoint},
		{`INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload) VALUES ($1, $2, $3, $4, $5::text::jsonb)`, stmtApp},
		{`SELECT o.id, o.event_key FROM "integration_outbox" o WHERE o.id = ANY($1) FOR UPDATE`, stmtReads},
		{`commit`, stmtTx},
		{`begin`, stmtTx},
		{`SELECT pg_try_advisory_lock($1)`, stmtReads},
		{`LISTEN "outbox_relay"`, stmtOther},
		{`DELETE FROM "integration_outbox_conflicts" WHERE id = $1`, stmtOther},
	} {
		if got := statementKind(c.query); got != c.want {
			t.Errorf("statementKind(%.60q…) = %q, want %q", c.query, got, c.want)
		}
	}
}

func TestClassifyBackend(t *testing.T) {
	for _, c := range []struct{ typ, app, datname, want string }{
		{"walsender", "outbox-relay", "bench_write_back", pgWalsender},
		{"walsender", "outbox-relay-bench floor", "bench_write_back", pgFloor},
		{"client backend", "", "bench_write_back", pgRelay},
		{"client backend", "outbox-relay leader bench_write_back", "bench_write_back", pgRelay},
		{"client backend", "outbox-relay-bench load", "bench_write_back", pgApp},
		{"client backend", "", "bench_steady", pgServer},
		{"autovacuum worker", "", "bench_write_back", pgServer},
		{"walwriter", "", "", pgServer},
	} {
		if got := classifyBackend(c.typ, c.app, c.datname, "bench_write_back"); got != c.want {
			t.Errorf("classifyBackend(%q, %q, %q) = %q, want %q", c.typ, c.app, c.datname, got, c.want)
		}
	}
}
