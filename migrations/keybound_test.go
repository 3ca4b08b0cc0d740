package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/migrations"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
)

// randomText returns n bytes of random letters and digits: text that no
// compression PostgreSQL applies to an index entry makes shorter.
func randomText(n int) string {
	const alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	for i := range b {
		b[i] = alnum[rand.IntN(len(alnum))]
	}
	return string(b)
}

// TestOutboxPublish_RefusesKeysTheLedgerCannotHold: an event_key longer than
// the ledger holds (relay.MaxEventKeyBytes) is refused when it is written —
// by outbox_publish (both signatures) and by a plain INSERT — with an error
// naming its length and the limit; a key of exactly the limit is taken. A
// row with a longer key written before migrate keeps its key (migrate never
// changes rows), and can still be changed: the relay dead-letters it.
// Before, outbox_publish took any key the outbox's own index took, and the
// ledger then refused to record its deliveries.
func TestOutboxPublish_RefusesKeysTheLedgerCannotHold(t *testing.T) {
	ctx := context.Background()
	conn := mustConnect(t, pgtest.NewDatabase(t))
	mustExec(t, conn, seedSQL)
	existing := randomText(2600)
	mustExec(t, conn, "INSERT INTO integration_outbox (event_key, payload) VALUES ($1, '{}')", existing)
	before := outboxRows(t, conn)
	mustMigrate(t, conn, migrations.Options{})
	if after := outboxRows(t, conn); after != before {
		t.Fatal("migrate changed existing rows")
	}

	atLimit := randomText(relay.MaxEventKeyBytes)
	over := func() string { return randomText(relay.MaxEventKeyBytes + 1) }
	want := fmt.Sprintf("event_key is %d bytes; the ledger holds at most %d", relay.MaxEventKeyBytes+1, relay.MaxEventKeyBytes)
	refused := func(what string, err error) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || !strings.Contains(pgErr.Message, want) || pgErr.Code != "22001" {
			t.Errorf("%s of a %d-byte key: %v; want SQLSTATE 22001 saying %q", what, relay.MaxEventKeyBytes+1, err, want)
		}
	}
	if got, err := publish(ctx, conn, atLimit, "{}"); err != nil || got != "inserted" {
		t.Errorf("outbox_publish of a %d-byte key: %q, %v; want inserted", len(atLimit), got, err)
	}
	_, err := publish(ctx, conn, over(), "{}")
	refused("outbox_publish", err)
	err = conn.QueryRow(ctx, "SELECT outbox_publish('lead.created', 'lead', 'L1', $1, '{}', NULL)", over()).Scan(new(string))
	refused("outbox_publish with a trace context", err)
	_, err = conn.Exec(ctx, "INSERT INTO integration_outbox (event_key, payload) VALUES ($1, '{}')", over())
	refused("INSERT", err)
	if _, err := conn.Exec(ctx, "INSERT INTO integration_outbox (event_key, payload) VALUES ($1, '{}')", randomText(relay.MaxEventKeyBytes)); err != nil {
		t.Errorf("INSERT of a key of exactly the limit: %v", err)
	}
	if _, err := conn.Exec(ctx, "UPDATE integration_outbox SET status = 'failed', last_error = 'too long' WHERE event_key = $1", existing); err != nil {
		t.Errorf("dead-letter the row whose key was longer before migrate: %v", err)
	}
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM integration_outbox WHERE octet_length(event_key) > $1", relay.MaxEventKeyBytes).Scan(&n); err != nil || n != 1 {
		t.Errorf("%d rows with keys over the limit (err %v), want the one written before migrate", n, err)
	}
}
