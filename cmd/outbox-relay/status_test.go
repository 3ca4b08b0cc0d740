package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/ledger"
	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// opsDB is a migrated database for the operator commands, with a config
// file naming it and two sinks: "n8n" (a webhook taking order.* events) and
// "nats" (every event).
type opsDB struct {
	url    string
	pool   *pgxpool.Pool
	config string
}

func newOpsDB(t *testing.T) *opsDB {
	t.Helper()
	url := pgtest.NewDatabase(t)
	if code, out, errOut := execute(t, "migrate", "--database-url", url); code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return &opsDB{url: url, pool: pool, config: writeOpsConfig(t, url, `
  - name: n8n
    type: webhook
    url: http://127.0.0.1:9/webhook/outbox
    events: ["order.*"]
  - name: nats
    type: nats
    url: nats://127.0.0.1:9`)}
}

// writeOpsConfig writes a config file for dbURL with the sinks YAML given.
func writeOpsConfig(t *testing.T, dbURL, sinks string, extra ...string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "relay.yaml")
	text := fmt.Sprintf("database_url: %q\nsinks:%s\n%s", dbURL, sinks, strings.Join(extra, "\n"))
	if sinks == "" {
		text = fmt.Sprintf("database_url: %q\n%s", dbURL, strings.Join(extra, "\n"))
	}
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// newPGConn connects to url for the test.
func newPGConn(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func (d *opsDB) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := d.pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// insert adds an outbox row and returns its id.
func (d *opsDB) insert(t *testing.T, key, eventType, status, lastError string) int64 {
	t.Helper()
	var id int64
	err := d.pool.QueryRow(context.Background(), `
INSERT INTO integration_outbox (event_type, aggregate_type, aggregate_id, event_key, payload, status, attempts, last_error)
VALUES ($1, 'order', 'A1', $2, '{}', $3, 3, NULLIF($4, '')) RETURNING id`, eventType, key, status, lastError).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func (d *opsDB) ledger(t *testing.T, key, sink, state string) {
	t.Helper()
	d.exec(t, `INSERT INTO integration_idempotency (event_key, action, state, attempts, delivered_at)
		VALUES ($1, $2, $3, 1, CASE WHEN $3 = 'delivered' THEN now() END)`, key, sink, state)
}

func (d *opsDB) status(t *testing.T, id int64) (status string, replays int) {
	t.Helper()
	if err := d.pool.QueryRow(context.Background(), `SELECT status, coalesce(replays, 0) FROM integration_outbox WHERE id = $1`, id).Scan(&status, &replays); err != nil {
		t.Fatal(err)
	}
	return status, replays
}

func (d *opsDB) ledgerStates(t *testing.T, key string) string {
	t.Helper()
	var s string
	if err := d.pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(action || '=' || state, ' ' ORDER BY action), '')
		FROM integration_idempotency WHERE event_key = $1`, key).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// executeWithInput runs the command line in-process with stdin, as execute
// does with none.
func executeWithInput(t *testing.T, stdin string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	execute(t) // clears the RELAY_* environment
	var out, errOut bytes.Buffer
	root := newRootCommand(&out, &errOut)
	root.SetIn(strings.NewReader(stdin))
	root.SetArgs(args)
	err := root.ExecuteContext(context.Background())
	if err != nil {
		fmt.Fprintf(&errOut, "outbox-relay: %v\n", err)
	}
	return exitCode(err), out.String(), errOut.String()
}

func TestStatusCommand(t *testing.T) {
	d := newOpsDB(t)
	d.insert(t, "p", "order.created", "pending", "")
	d.insert(t, "f", "order.created", "failed", "HTTP 422")
	d.insert(t, "h", "order.created", "held", "timeout after write")
	d.insert(t, "d", "order.created", "done", "")
	d.ledger(t, "d", "nats", "delivered")
	d.ledger(t, "d", "n8n", "delivered")
	d.ledger(t, "f", "nats", "delivered")

	code, out, errOut := execute(t, "status", "--config", d.config)
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	t.Logf("status:\n%s", out)
	for _, want := range []string{
		"mode:            stopped",
		"leader:          none",
		"slot:            outbox_relay does not exist (run creates it)",
		"rows:            pending 1, processing 0, held 1, failed 1, done 1",
		"oldest pending:  ",
		"held / failed:   1 / 1",
		"delivered (1h):  n8n 1, nats 2",
		"progress:        no row has waited longer than 5m0s",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status output lacks %q", want)
		}
	}

	// A relay holding the leader lock and streaming: JSON.
	ctx := context.Background()
	cc, _ := pgx.ParseConfig(d.url)
	cc.RuntimeParams["application_name"] = "outbox-relay leader outbox_relay"
	leader, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Close(ctx)
	if _, err := leader.Exec(ctx, "SELECT pg_advisory_lock($1)", ledger.LeaderLockKey("outbox_relay")); err != nil {
		t.Fatal(err)
	}
	d.exec(t, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")

	code, out, errOut = execute(t, "status", "--config", d.config, "--json")
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	var st admin.Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	if st.Mode != admin.ModePoll || st.Leader == nil || st.Leader.By != "lock" || st.Leader.PID != int32(leader.PgConn().PID()) ||
		!st.Slot.Exists || st.Slot.Active || st.Slot.RetainedWALBytes == nil || st.Rows["failed"] != 1 || st.DeliveredLastHour["nats"] != 2 {
		t.Fatalf("status --json: %s", out)
	}
	if !strings.Contains(out, `"oldest_pending_seconds": `) || !strings.Contains(out, `"retained_wal_bytes": `) {
		t.Fatalf("JSON keys: %s", out)
	}

	code, out, _ = execute(t, "status", "--config", d.config)
	if code != exitOK || !strings.Contains(out, "mode:            poll") || !strings.Contains(out, `"outbox-relay leader outbox_relay"`) ||
		!strings.Contains(out, "(holds the leader lock)") || !strings.Contains(out, "slot:            outbox_relay: inactive; wal_status reserved") {
		t.Fatalf("status with a leader:\n%s", out)
	}
}

// TestStatusCommand_Stalled: status says the relay is stalled when rows have
// waited longer than http.stall_after on a path that shows no progress.
func TestStatusCommand_Stalled(t *testing.T) {
	d := newOpsDB(t)
	cfg := writeOpsConfig(t, d.url, "", "http: {stall_after: 2m}")
	d.insert(t, "waiting", "order.created", "pending", "")
	d.exec(t, "UPDATE integration_outbox SET created_at = now() - interval '3 minutes', available_at = now() - interval '3 minutes'")
	d.exec(t, "SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')")
	d.exec(t, "INSERT INTO relay_checkpoint (slot_name, confirmed_lsn, updated_at) VALUES ('outbox_relay', '0/1', now() - interval '150 seconds')")

	code, out, errOut := execute(t, "status", "--config", cfg)
	want := regexp.MustCompile(`progress: +STALLED: the stream last wrote its checkpoint 2m3\ds ago while 1 rows it owns have waited longer than 2m0s \(the oldest 3m\ds\)`)
	if code != exitOK || !want.MatchString(out) {
		t.Fatalf("exit %d, want a line matching %s:\n%s%s", code, want, out, errOut)
	}
	code, out, _ = execute(t, "status", "--config", cfg, "--json")
	var st admin.Status
	if err := json.Unmarshal([]byte(out), &st); code != exitOK || err != nil || st.Progress == nil || st.Progress.StreamWaiting != 1 ||
		!strings.Contains(st.Progress.Stalled, "the stream last wrote its checkpoint") || st.Progress.StallAfterSeconds != 120 {
		t.Fatalf("status --json: exit %d, %v\n%s", code, err, out)
	}
	d.exec(t, "SELECT pg_drop_replication_slot('outbox_relay')")
}

func TestStatusCommand_Errors(t *testing.T) {
	code, _, errOut := execute(t, "status", "--database-url", "postgres://nobody:pw@127.0.0.1:1/x?connect_timeout=2")
	if code != exitFailure || !strings.Contains(errOut, "connect to the database") || strings.Contains(errOut, "pw@") {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	code, _, errOut = execute(t, "status", "--database-url", "postgres://x:s3cret@[bad")
	if code != exitUsage || strings.Contains(errOut, "s3cret") {
		t.Fatalf("exit %d: %s", code, errOut)
	}
}

func TestRoundAge(t *testing.T) {
	for d, want := range map[time.Duration]string{
		1234567 * time.Nanosecond:   "1ms",
		4210 * time.Millisecond:     "4.2s",
		3*time.Hour + time.Second/3: "3h0m0s",
	} {
		if got := roundAge(d); got != want {
			t.Errorf("roundAge(%s) = %q, want %q", d, got, want)
		}
	}
}

// TestStatusCommand_OneRelay: with one relay running, status counts one
// relay (not its three connections: leader lock, owner lock, walsender) and
// explains the two positions it shows side by side.
func TestStatusCommand_OneRelay(t *testing.T) {
	s := newSetup(t, pgtest.NewDatabase(t))
	cfg := s.configFile(t, "")
	s.startInProcess(t, cfg)
	s.publishWriters(t, 1, 1, 1, "status")
	var out string
	eventually(t, 30*time.Second, "the relay streaming, delivering and checkpointing", func() bool {
		var code int
		code, out, _ = execute(t, "status", "--config", cfg)
		return code == exitOK && strings.Contains(out, "mode:            replication") && strings.Contains(out, "hook 1, nats 1") &&
			strings.Contains(out, "checkpoint:") && !strings.Contains(out, "checkpoint:      0/0,")
	})
	t.Logf("status:\n%s", out)
	for _, want := range []string{
		"relays:          1\n",
		`connections:     3 ("outbox-relay", "outbox-relay leader outbox_relay", "outbox-relay owner lock")`,
		"slot:            outbox_relay: active, streaming to ",
		"acknowledged:    ",
		"the slot's confirmed position; the server keeps the WAL from there",
		"the relay's own record, written before each acknowledgement that passes events",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status output lacks %q", want)
		}
	}
	code, out, _ := execute(t, "status", "--config", cfg, "--json")
	var st admin.Status
	if err := json.Unmarshal([]byte(out), &st); code != exitOK || err != nil || st.Relays != 1 || len(st.Connections) != 3 || st.Slot.Server != "primary" {
		t.Fatalf("status --json: exit %d, %v\n%s", code, err, out)
	}
}

// TestStatusCommand_SlotOnTheStandby (PostgreSQL 16+): with
// source.standby_url the relay's slot lives on the standby, and status
// reads it there: a relay streaming from the standby is in replication
// mode, and the slot line says where the slot is. Read on the primary, the
// slot did not exist and the mode was poll.
func TestStatusCommand_SlotOnTheStandby(t *testing.T) {
	bindir := pgtest.BindirAtLeast(t, 16, "logical decoding on a standby")
	ctx := context.Background()
	primary := pgtest.NewCluster(t, pgtest.Options{Bindir: bindir})
	if err := primary.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	standby := pgtest.NewStandby(t, primary, pgtest.StandbyOptions{})
	s := newSetup(t, primary.URL("app"))
	cfg := s.configFileWith(t, "", fmt.Sprintf("source: {standby_url: %q}\n", standby.URL("app")))
	s.startInProcess(t, cfg)
	s.publishWriters(t, 1, 1, 1, "standby")
	var out string
	eventually(t, 60*time.Second, "the relay streaming from the standby and delivering", func() bool {
		var code int
		code, out, _ = execute(t, "status", "--config", cfg)
		return code == exitOK && strings.Contains(out, "hook 1, nats 1") && strings.Contains(out, "mode:            replication")
	})
	t.Logf("status:\n%s", out)
	if !strings.Contains(out, "slot:            outbox_relay on the standby (source.standby_url): active, streaming to ") {
		t.Errorf("status does not show the slot on the standby:\n%s", out)
	}
	code, out, _ := execute(t, "status", "--config", cfg, "--json")
	var st admin.Status
	if err := json.Unmarshal([]byte(out), &st); code != exitOK || err != nil || st.Mode != admin.ModeReplication ||
		st.Slot.Server != "standby" || !st.Slot.Exists || !st.Slot.Active || st.Slot.ConfirmedFlushLSN == "" {
		t.Fatalf("status --json: exit %d, %v\n%s", code, err, out)
	}

	// The standby stopped: status says it cannot read the slot.
	if err := standby.Stop(); err != nil {
		t.Fatal(err)
	}
	code, out, _ = execute(t, "status", "--config", cfg)
	if code != exitOK || !strings.Contains(out, "outbox_relay on the standby (source.standby_url): unknown: cannot connect to source.standby_url") {
		t.Fatalf("status with the standby down: exit %d\n%s", code, out)
	}
}
