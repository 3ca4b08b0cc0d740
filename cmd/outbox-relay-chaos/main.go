// Command outbox-relay-chaos runs the relay binary under continuous load
// while it injects the faults docs/guarantees.md names, then checks the guarantees and
// prints a markdown table. `make chaos` runs it; exit status 1 means an
// invariant was violated (the violations are listed), 2 a usage error.
//
// It starts everything it needs under a fresh work directory: a private
// PostgreSQL cluster (migrations/pgtest, fsync on) with a synchronous
// physical standby, reached by everyone through a multi-host URL with
// target_session_attrs=read-write, an external nats-server with
// JetStream and a file store (built from the module in go.mod), a webhook
// receiver, and two `outbox-relay run` processes on one configuration — a
// leader and a standby. Writers insert continuously (single-row, multi-row
// and now and then a few hundred rows in one transaction) over a few hundred
// aggregates; every payload carries the event's sequence number within its
// aggregate. Another table, outside the publication, takes about 2 MB/s of
// WAL, so the slot must keep releasing WAL it does not need.
//
// Faults, on a schedule drawn from -seed (each cycle runs every kind once,
// in a shuffled order, with quiet time after each — except that about a
// third are followed by the next fault within 1–3 s, while they are still
// recovering):
//
//	relay-kill        kill -9 of every relay process, restarted at once
//	                  (repeated a few times in a row)
//	postgres-restart  SIGKILL of the postmaster (crash), then start
//	nats-restart      SIGKILL of nats-server, then start on the same port
//	                  and store
//	webhook-outage    the receiver answers 503, then holds requests past the
//	                  relay's webhook timeout (outcome unknown), then answers
//	                  2xx slowly (deliveries queue up), then heals; halfway
//	                  through the slow phase, cycle 1 drops the slot, cycle 2
//	                  kills the leader, cycle 3 kills both relays (for every
//	                  seed, so each profile covers the first)
//	slot-drop         the walsender terminated and the slot dropped
//	leader-kill       kill -9 of the HA leader; the standby takes over and
//	                  the killed relay comes back as the standby
//	backpressure-drop the receiver answers 2xx after 0.6 × the relay's
//	                  timeout, so the lanes fill and decoding waits; then
//	                  the walsender is terminated; then the receiver heals
//	unstorable-reply  the receiver refuses a few events for good: 400 with
//	                  a long multi-byte UTF-8 body holding a NUL byte
//	slot-create-crash the slot dropped, then kill -9 of both relays as soon
//	                  as it exists again (created by the leader), restarted
//	settle-lock       LOCK TABLE of the ledger IN EXCLUSIVE MODE held for a
//	                  few seconds: settlement writes wait while replication
//	                  goes on
//	pg-blackhole      each relay reaches PostgreSQL and nats-server through
//	nats-blackhole    its own netfault proxy: the open connections are
//	                  black-holed (sockets open, nothing forwarded, new
//	                  connections pass), then healed
//	pg-slow           300 ms added to every round trip to PostgreSQL
//	failover          kill -9 of the primary, pg_promote of its synchronous
//	                  standby; relays and writers follow the multi-host
//	                  URL; a new synchronous standby is built on the old
//	                  primary's port (pg_basebackup, or a cold copy where
//	                  the bin dir has none)
//	graceful-stop     SIGTERM of the HA leader while it delivers: it must
//	                  record what is in flight and exit 0; restarted
//	poll-fallback     the publication dropped and the walsender ended:
//	                  auto mode polls, then streams again once restored
//	lock-cut          the leader's lock session ended while it delivers
//	handover-delete   the receiver slow, the slot dropped, rows with a
//	                  NULL status committed while no slot exists; once the
//	                  new slot's hand-over has read its rows, a few pending
//	                  rows the webhook has not got deleted (the
//	                  application's cleanup); the walsender terminated: the
//	                  hand-over must be recorded, and streaming resume,
//	                  each within 60 s
//	long-keys         legacy rows (migration 012's trigger off around the
//	                  insert) with event_keys of 2,049–2,690 bytes between
//	                  rows with normal keys, in one transaction
//
// Retention runs in the relays throughout, with ages of seconds; what it
// prunes is kept aside for the checks.
//
// Writers also insert, now and then, a row with a NULL available_at (due
// now) and one scheduled a few seconds ahead (its aggregate's later events
// wait for it); a few rows in a thousand with a NULL status; and a few a
// minute with a payload of 300–900 KiB (under nats-server's max_payload).
//
// Afterwards — writers stopped, everything delivered (or -quiesce passed),
// the relays stopped with SIGTERM — it checks: no committed event missing at
// either sink, except the events the receiver refused for good, which must
// be dead-lettered; every (event_key, action) has one delivered ledger row
// and every delivered row is done; every repeat carries the
// same idempotency id and a byte-identical body, and the receiver applied
// each event's side effect exactly once (deduplicating by webhook-id);
// per-aggregate order; the WAL retained by the slot stayed under
// -wal-bound and no relay's peak memory (VmHWM) grew past -rss-bound; every
// failed row has a reason, and only refused events and over-long keys
// failed, those naming the limit, sent nowhere, the rows beside them
// delivered; the rows with a NULL status and the large payloads arrived
// (whole) like any other. A row handover-delete deleted need reach no
// sink, but where it did it is judged like any other, order included. Synchronous
// replication keeps every acknowledged commit across a failover; a commit
// in flight when the primary died is resolved by looking for its rows on
// the new one, and written again when they are not there. Before
// PostgreSQL 17 the relay may have delivered such a row already: a copy
// with the same key whose body differs only in id and created_at is
// counted (the report's failover row), not a violation.
// docs/chaos-report.md has a full run's figures.
//
// Recovery times are measured from the moment a fault was healed (the
// process restarted, the server up again, the receiver answering again) to
// the first event committed afterwards reaching both sinks, and to every
// event committed before it having reached both sinks (backlog drained).
// They are reported, never asserted.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/harness"
)

// profile sizes a run. Both profiles inject the same faults and check the
// same invariants; full repeats the cycle and waits longer between faults.
type profile struct {
	name        string
	warmup      time.Duration // load before the first fault
	cycles      int           // times every fault kind is injected
	gap         time.Duration // quiet time after each fault (±20%)
	kills       int           // kill -9 rounds per relay-kill fault
	killSpacing time.Duration // between those rounds (±50%)
	outage503   time.Duration // webhook outage: the 503 phase …
	outageHang  time.Duration // … then the phase of requests held past the timeout …
	outageSlow  time.Duration // … then 2xx answers after half the timeout
	rate        float64       // events/s from all writers together
	writers     int
	aggregates  int
	quiesce     time.Duration // longest wait for the last deliveries
	crawl       time.Duration // backpressure-drop: crawling answers before the walsender is terminated
	poison      int           // unstorable-reply: events refused for good per fault
	lockHold    time.Duration // settle-lock: how long the lock is held
	blackhole   time.Duration // pg-blackhole, nats-blackhole: how long
	slowFor     time.Duration // pg-slow: how long
	deletes     int           // handover-delete: pending rows deleted per fault
	longKeys    int           // long-keys: over-long keys per fault
	// replicationRetry is the relays' source.replication_retry: how long
	// auto mode polls before it tries to stream again (poll-fallback).
	replicationRetry time.Duration
}

var profiles = map[string]profile{
	"ci": {name: "ci", warmup: 8 * time.Second, cycles: 2, gap: 6 * time.Second, kills: 2, killSpacing: 3 * time.Second,
		outage503: 6 * time.Second, outageHang: 5 * time.Second, outageSlow: 4 * time.Second, rate: 150, writers: 4, aggregates: 160, quiesce: 120 * time.Second,
		crawl: 4 * time.Second, poison: 3, lockHold: 5 * time.Second, blackhole: 5 * time.Second, slowFor: 5 * time.Second,
		deletes: 4, longKeys: 2, replicationRetry: 4 * time.Second},
	"full": {name: "full", warmup: 15 * time.Second, cycles: 3, gap: 15 * time.Second, kills: 3, killSpacing: 4 * time.Second,
		outage503: 12 * time.Second, outageHang: 8 * time.Second, outageSlow: 6 * time.Second, rate: 200, writers: 6, aggregates: 300, quiesce: 180 * time.Second,
		crawl: 6 * time.Second, poison: 5, lockHold: 10 * time.Second, blackhole: 10 * time.Second, slowFor: 8 * time.Second,
		deletes: 6, longKeys: 3, replicationRetry: 6 * time.Second},
}

// options are the command-line flags.
type options struct {
	relayBin    string
	natsServer  string
	profile     profile
	seed        uint64
	walBound    int64 // bytes
	rssBound    int64 // bytes
	hookTimeout time.Duration
	keep        bool
}

func main() {
	var o options
	var profileName string
	var walBoundMB, rssBoundMB int64
	var rate float64
	var writers, aggregates int
	fs := flag.NewFlagSet("outbox-relay-chaos", flag.ExitOnError)
	fs.StringVar(&o.relayBin, "relay", "", "path to the outbox-relay binary (default: bin/outbox-relay)")
	fs.StringVar(&o.natsServer, "nats-server", "", "nats-server binary (default: build github.com/nats-io/nats-server/v2 from go.mod, else nats-server in PATH)")
	fs.StringVar(&profileName, "profile", "full", "ci (about 5 minutes) or full (about 12 minutes): the same faults and invariants")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the fault schedule and the load")
	fs.Int64Var(&walBoundMB, "wal-bound", 256, "largest WAL the relay's slot may retain (restart_lsn to the current position), MB")
	fs.Int64Var(&rssBoundMB, "rss-bound", 300, "largest peak resident memory (VmHWM) of each relay, large payloads among the load, MB (sampled every second)")
	fs.DurationVar(&o.hookTimeout, "hook-timeout", time.Second, "the relay's webhook timeout (the outage holds requests past it)")
	fs.Float64Var(&rate, "rate", 0, "events/s from all writers together (0: the profile's)")
	fs.IntVar(&writers, "writers", 0, "writer connections (0: the profile's)")
	fs.IntVar(&aggregates, "aggregates", 0, "distinct aggregates, at least 100 (0: the profile's)")
	fs.BoolVar(&o.keep, "keep", false, "keep the work directory (relay and server logs, config, WAL samples, webhook deliveries, faults)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: outbox-relay-chaos [flags]\n\nRuns the relay under faults and load, checks the guarantees of docs/guarantees.md, prints a markdown table.\n\n")
		fs.PrintDefaults()
	}
	_ = fs.Parse(os.Args[1:])
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "outbox-relay-chaos: unexpected arguments %q\n", fs.Args())
		os.Exit(2)
	}
	p, ok := profiles[profileName]
	if !ok {
		fmt.Fprintf(os.Stderr, "outbox-relay-chaos: -profile: unknown profile %q (profiles: %s)\n", profileName, strings.Join(profileNames(), ", "))
		os.Exit(2)
	}
	if rate > 0 {
		p.rate = rate
	}
	if writers > 0 {
		p.writers = writers
	}
	if aggregates > 0 {
		p.aggregates = aggregates
	}
	o.profile = p
	o.walBound = walBoundMB << 20
	o.rssBound = rssBoundMB << 20
	if err := o.validate(); err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-chaos: %v\n", err)
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	violations, err := run(ctx, o, os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-chaos: %v\n", err)
		stop()
		os.Exit(1)
	}
	if violations > 0 {
		stop()
		os.Exit(1)
	}
}

func profileNames() []string {
	var names []string
	for n := range profiles {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// validate checks the flags and resolves the relay binary.
func (o *options) validate() error {
	bin, err := harness.RelayBinary(o.relayBin)
	if err != nil {
		return err
	}
	o.relayBin = bin
	p := o.profile
	switch {
	case p.rate <= 0 || p.writers <= 0:
		return fmt.Errorf("-rate and -writers must be positive")
	case p.aggregates < 100 || p.aggregates < p.writers:
		return fmt.Errorf("-aggregates must be at least 100 and at least -writers")
	case o.walBound <= 0 || o.rssBound <= 0:
		return fmt.Errorf("-wal-bound and -rss-bound must be positive")
	case o.hookTimeout < 100*time.Millisecond:
		return fmt.Errorf("-hook-timeout must be at least 100ms")
	}
	return nil
}
