package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay/netfault"
)

// The names the run uses: database, slot, sinks (= ledger actions), stream.
const (
	dbName     = "chaos"
	slotName   = "chaos"
	natsAction = "nats"
	hookAction = "hook"
	streamName = "CHAOS"
	subjects   = "chaos.>"
	// keyBoundTrigger is migration 012's trigger on integration_outbox
	// (migrations.keyBound): it refuses an event_key longer than
	// relay.MaxEventKeyBytes at insert. long-keys writes with it off, as a
	// row written before it was installed.
	keyBoundTrigger = "integration_outbox_relay_key_bound"
)

// A large payload's padding is largeMin..largeMax bytes, less where
// nats-server's max_payload (1 MB by default) leaves no room for
// largeHeadroom: the envelope around the payload and the headers.
const (
	largeMin      = 300 << 10
	largeMax      = 900 << 10
	largeHeadroom = 64 << 10
)

// keepPrunedSQL copies what retention deletes — outbox rows, and delivered
// ledger rows (the relay also deletes withdrawn 'sending' claims, which are
// no record of anything) — into tables the checker reads beside the live
// ones: the run's record stays whole while the relays prune it.
const keepPrunedSQL = `
CREATE TABLE chaos_pruned_outbox (LIKE integration_outbox);
CREATE TABLE chaos_pruned_ledger (LIKE integration_idempotency);
CREATE FUNCTION chaos_keep_pruned_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO chaos_pruned_outbox SELECT * FROM gone; RETURN NULL; END $$;
CREATE FUNCTION chaos_keep_pruned_ledger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO chaos_pruned_ledger SELECT * FROM gone WHERE state = 'delivered'; RETURN NULL; END $$;
CREATE TRIGGER chaos_keep_pruned AFTER DELETE ON integration_outbox REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION chaos_keep_pruned_outbox();
CREATE TRIGGER chaos_keep_pruned AFTER DELETE ON integration_idempotency REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION chaos_keep_pruned_ledger();`

// allOutbox and allLedger read the tables with what retention pruned.
const (
	allOutbox = `(SELECT * FROM integration_outbox UNION ALL SELECT * FROM chaos_pruned_outbox)`
	allLedger = `(SELECT * FROM integration_idempotency UNION ALL SELECT * FROM chaos_pruned_ledger)`
)

// stack is everything the run starts: the servers, the receiver and the
// relay pair.
type stack struct {
	o     options
	work  string
	base  time.Time
	out   io.Writer
	pgVer string

	// cluster is the primary, standby its synchronous physical standby
	// (nil while a failover rebuilds it); a failover swaps them, keeping
	// the two ports, so every multi-host URL stays right.
	cluster, standby *pgtest.Cluster
	pgLog            *os.File
	dbURL            string        // both servers, target_session_attrs=read-write
	pool             *pgxpool.Pool // the harness's own queries

	nats    *harness.NATSServer
	natsBin string
	natsVer string
	nc      *nats.Conn
	js      jetstream.JetStream

	hook   *receiver
	tap    *tap
	relays []*relaySlot
	// load is the run's writers; the faults that write rows of their own
	// (handover-delete, long-keys) commit them through it, so they are
	// part of the record like any other.
	load *load
	// largeMin and largeMax bound a large payload's padding (see largeMax).
	largeMin, largeMax int
	// pgProxies and natsProxies hold the netfault proxies the relays'
	// connections to PostgreSQL (one per relay and server) and to
	// nats-server (one per relay) go through; the harness's own
	// connections do not.
	pgProxies, natsProxies []*netfault.Proxy
}

// say prints a progress line with the time since the start.
func (s *stack) say(format string, args ...any) {
	fmt.Fprintf(s.out, "==> %6.1fs "+format+"\n", append([]any{time.Since(s.base).Seconds()}, args...)...)
}

// since is the time since the run's start.
func (s *stack) since() time.Duration { return time.Since(s.base) }

// setUp starts PostgreSQL (and migrates), nats-server, the receiver and the
// NATS tap, and writes the relays' configuration.
func setUp(ctx context.Context, o options, out io.Writer) (*stack, error) {
	s := &stack{o: o, base: time.Now(), out: out}
	var err error
	if s.work, err = os.MkdirTemp("", "outbox-relay-chaos-"); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			s.close()
		}
	}()

	s.say("starting a private PostgreSQL cluster (wal_level=logical, fsync=on) and a synchronous physical standby")
	if s.pgLog, err = os.Create(filepath.Join(s.work, "postgres.log")); err != nil {
		return nil, err
	}
	if s.cluster, err = pgtest.StartCluster(ctx, pgtest.Options{Log: s.pgLog}); err != nil {
		return nil, err
	}
	if err := s.cluster.CreateDatabase(ctx, dbName); err != nil {
		return nil, err
	}
	if err := harness.Migrate(ctx, o.relayBin, s.cluster.URL(dbName)); err != nil {
		return nil, err
	}
	if s.standby, err = s.cluster.StartStandby(ctx, standbyOptions(0, false, s.pgLog)); err != nil {
		return nil, err
	}
	if err := setSyncStandby(ctx, s.cluster, standbyAppName); err != nil {
		return nil, err
	}
	s.dbURL = pgtest.MultiHostURL(dbName, s.cluster, s.standby)
	pcfg, err := pgxpool.ParseConfig(s.dbURL)
	if err != nil {
		return nil, err
	}
	pcfg.MaxConns = int32(o.profile.writers) + 4
	if s.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return nil, err
	}
	if err := s.pool.QueryRow(ctx, "SELECT version()").Scan(&s.pgVer); err != nil {
		return nil, err
	}
	if _, err := s.pool.Exec(ctx, "CREATE TABLE "+otherTable+" (id bigserial PRIMARY KEY, pad text)"); err != nil {
		return nil, err
	}
	if _, err := s.pool.Exec(ctx, keepPrunedSQL); err != nil {
		return nil, fmt.Errorf("keep the rows retention prunes: %w", err)
	}
	var bound bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'integration_outbox'::regclass AND tgname = $1)`, keyBoundTrigger).Scan(&bound); err != nil || !bound {
		return nil, fmt.Errorf("migrate installed no trigger %s on integration_outbox (long-keys turns it off around its inserts; is its name still migrations.keyBound's?): %v", keyBoundTrigger, err)
	}
	if i := strings.Index(s.pgVer, " on "); i > 0 {
		s.pgVer = s.pgVer[:i]
	}

	var note string
	if s.natsBin, note, err = harness.NATSServerBinary(ctx, o.natsServer, s.work); err != nil {
		return nil, err
	}
	if note != "" {
		s.say("%s", note)
	}
	s.natsVer = strings.TrimPrefix(harness.NATSVersion(s.natsBin), "nats-server: ")
	if s.nats, err = harness.StartNATS(s.natsBin, s.work); err != nil {
		return nil, err
	}
	s.say("nats-server %s with JetStream at %s (store %s)", s.natsVer, s.nats.URL(), filepath.Join(s.work, "nats-store"))
	if s.nc, err = s.nats.Connect(ctx, 15*time.Second, nats.Name("outbox-relay-chaos"), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond)); err != nil {
		return nil, err
	}
	if s.js, err = jetstream.New(s.nc); err != nil {
		return nil, err
	}
	s.largeMax = min(largeMax, int(s.nc.MaxPayload())-largeHeadroom)
	s.largeMin = min(largeMin, s.largeMax/2)
	if s.largeMin <= 0 {
		return nil, fmt.Errorf("nats-server's max_payload is %d bytes: no room for a large payload", s.nc.MaxPayload())
	}
	if s.tap, err = startTap(s.nats.URL(), subjects, s.since); err != nil {
		return nil, err
	}

	// A held request outlives the relay's timeout by far, so the relay's
	// outcome is always "unknown", never a late answer; a slow answer comes
	// well within it, a crawling one (backpressure-drop) within it too (one
	// the relay gave up on first is recorded as unanswered).
	if s.hook, err = newReceiver(s.since, 10*o.hookTimeout, o.hookTimeout/2, o.hookTimeout*6/10); err != nil {
		return nil, err
	}
	natsHost := strings.TrimPrefix(s.nats.URL(), "nats://")
	for _, name := range []string{"relay-a", "relay-b"} {
		var hosts []string
		for _, c := range []*pgtest.Cluster{s.cluster, s.standby} {
			pg, err := netfault.Listen(fmt.Sprintf("127.0.0.1:%d", c.Port()))
			if err != nil {
				return nil, err
			}
			s.pgProxies = append(s.pgProxies, pg)
			hosts = append(hosts, pg.Addr())
		}
		np, err := netfault.Listen(natsHost)
		if err != nil {
			return nil, err
		}
		s.natsProxies = append(s.natsProxies, np)
		dbURL := fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write", strings.Join(hosts, ","), dbName)
		cfg, err := s.writeConfig(name, dbURL, "nats://"+np.Addr())
		if err != nil {
			return nil, err
		}
		s.relays = append(s.relays, newRelaySlot(name, o.relayBin, cfg, filepath.Join(s.work, name+".log")))
	}
	ok = true
	return s, nil
}

// writeConfig writes relay name's configuration: the same for both relays
// but for the addresses of PostgreSQL and nats-server, which are the
// relay's own proxies. Backoff is short and max_attempts high, so that the
// outage's backlog drains within the run and no event is dead-lettered for
// being retried during it.
func (s *stack) writeConfig(name, dbURL, natsURL string) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "database_url: %q\n", dbURL)
	fmt.Fprintf(&b, "data_dir: %q\n", filepath.Join(s.work, "relay-data"))
	fmt.Fprintf(&b, "source:\n  slot: %s\n  poll_interval: 500ms\n  replication_retry: %s\n", slotName, s.o.profile.replicationRetry)
	b.WriteString("delivery:\n  backoff: [500ms, 1s, 2s, 3s]\n  max_attempts: 1000\n")
	b.WriteString("sinks:\n")
	fmt.Fprintf(&b, "  - name: %s\n    type: nats\n    url: %q\n", natsAction, natsURL)
	fmt.Fprintf(&b, "    subject: %q\n", "chaos.{{.AggregateType}}.{{.EventType}}")
	fmt.Fprintf(&b, "    stream: {name: %s, subjects: [%q], create: true}\n", streamName, subjects)
	fmt.Fprintf(&b, "  - name: %s\n    type: webhook\n    url: %q\n    timeout: %s\n", hookAction, s.hook.url(), s.o.hookTimeout)
	fmt.Fprintf(&b, "    headers: {%s: %s}\n", relayHeader, name)
	b.WriteString("http: {listen: \"127.0.0.1:0\"}\n")
	b.WriteString("shutdown_timeout: 20s\n")
	// Retention prunes while everything else happens (keepPrunedSQL keeps
	// what it deletes for the checker): it must never remove a row the
	// slot may send again, or the event is delivered twice.
	b.WriteString("retention: {enabled: true, done_after: 10s, ledger_after: 10s, interval: 2s}\n")
	b.WriteString("log: {level: info, format: json}\n")
	path := filepath.Join(s.work, name+".yaml")
	return path, os.WriteFile(path, []byte(b.String()), 0o600)
}

// waitStreaming waits until some relay streams from the slot.
func (s *stack) waitStreaming(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		active, err := harness.SlotStreaming(ctx, s.pool, slotName)
		if err == nil && active {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no relay streams from slot %s after %s (logs in %s; last error %v)", slotName, timeout, s.work, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// leader returns the relay that leads the slot, waiting up to timeout for
// exactly one to lead.
func (s *stack) leader(ctx context.Context, timeout time.Duration) (*relaySlot, error) {
	deadline := time.Now().Add(timeout)
	for {
		var leading []*relaySlot
		for _, r := range s.relays {
			if r.leading() {
				leading = append(leading, r)
			}
		}
		if len(leading) == 1 {
			return leading[0], nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%d relays lead the slot after %s, want 1", len(leading), timeout)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// close stops whatever still runs and removes the work directory (unless
// -keep).
func (s *stack) close() {
	for _, r := range s.relays {
		r.mu.Lock()
		r.stopping = true
		r.mu.Unlock()
		r.kill()
	}
	for _, p := range append(s.pgProxies, s.natsProxies...) {
		_ = p.Close()
	}
	if s.hook != nil {
		s.hook.close()
	}
	if s.tap != nil {
		s.tap.stop()
	}
	if s.nc != nil {
		s.nc.Close()
	}
	if s.nats != nil {
		_ = s.nats.Stop(10 * time.Second)
	}
	if s.pool != nil {
		s.pool.Close()
	}
	for _, c := range []*pgtest.Cluster{s.cluster, s.standby} {
		if c != nil {
			_ = c.Close()
		}
	}
	if s.pgLog != nil {
		s.pgLog.Close()
	}
	if s.o.keep {
		fmt.Fprintf(s.out, "==> kept the work directory %s\n", s.work)
		return
	}
	_ = os.RemoveAll(s.work)
}

// standbyAppName is the standby's application_name (pgtest's), which the
// primary's synchronous_standby_names names.
const standbyAppName = "pgtest_standby"

// standbyOptions are the standby's: on port (0: a free one), copied online
// or cold, retrying its connection to the primary every 200 ms (not 5 s),
// so that synchronous commits resume soon after a primary restart.
func standbyOptions(port int, online bool, log io.Writer) pgtest.StandbyOptions {
	return pgtest.StandbyOptions{Port: port, Online: online, Log: log,
		Settings: map[string]string{"wal_retrieve_retry_interval": "200ms"}}
}

// setSyncStandby sets c's synchronous_standby_names to name ("" for none)
// and reloads: with a name, a commit returns once the standby has flushed
// it, so a failover loses no acknowledged commit.
func setSyncStandby(ctx context.Context, c *pgtest.Cluster, name string) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return fmt.Errorf("set synchronous_standby_names: %w", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "ALTER SYSTEM SET synchronous_standby_names = '"+name+"'"); err != nil {
		return fmt.Errorf("set synchronous_standby_names: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("reload after setting synchronous_standby_names: %w", err)
	}
	return nil
}

// sqlConn opens a single connection (the WAL monitor's).
func (s *stack) sqlConn(ctx context.Context) (*pgx.Conn, error) {
	return pgx.Connect(ctx, s.dbURL)
}
