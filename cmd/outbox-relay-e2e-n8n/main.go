// Command outbox-relay-e2e-n8n runs the relay against a real n8n and checks
// that every outbox event is applied exactly once by the workflow the project
// ships (deploy/n8n/outbox-workflow.json). `make e2e-n8n` runs it.
//
// It installs n8n 2.8.4 from the npm registry into a cache directory outside
// the clone (default $HOME/.cache/outbox-relay/n8n-2.8.4; reused while it
// works), starts a private PostgreSQL cluster (migrations/pgtest), migrates it
// with the relay binary and creates the workflow's tables
// (deploy/n8n/tables.sql), imports the workflow's credentials and the
// workflow into a throwaway n8n user folder, publishes it, starts n8n on a
// free loopback port and runs `outbox-relay run` with one webhook sink
// pointing at it. Then it runs its scenarios, each checked by polling the
// counts until they are stable; the first four:
//
//  1. bulk: events published with outbox_publish become as many successful
//     n8n executions and one business effect each;
//  2. duplicate: the envelope of a delivered event is POSTed to the webhook
//     a second time with the same headers; the workflow answers 2xx and
//     applies nothing;
//  3. outage: n8n is stopped (SIGTERM) for 20 s while events are being
//     published, then started again; every event must end with exactly one
//     effect. Events the relay diverted to the claim path during the outage
//     are listed by id when nothing delivers them;
//  4. unpublished: the workflow is unpublished, the relay gets n8n's 404
//     "not registered", opens the sink's circuit (checked in its log) and
//     events wait; once the workflow is published again they must flow.
//
// Scenarios 5-8 do the same through a batched sink (batch.go): a bulk of
// events each its own aggregate, n8n restarted mid-run, one event in each
// batch whose business step fails once, and a bulk over -aggregates (50). In
// every scenario each event must be applied exactly once, and the events of
// an aggregate in their order.
//
// It prints a summary table and exits 1 when a scenario fails, 2 on bad
// usage. Every process it started (n8n, the relay, PostgreSQL) is stopped on
// exit, also on failure and on Ctrl-C. The work directory with the logs
// (relay.log, n8n.log, n8n's sqlite database) is kept when a scenario fails
// or with --keep.
//
// Requirements: Node.js 20.19-24.x with npm (and gcc, make and the Node.js
// headers for the first install), the sqlite3 command-line tool, and the
// PostgreSQL server binaries (pg_config --bindir).
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// sinkName is the relay's name for the n8n sink: the ledger's action.
const sinkName = "n8n"

// batchSinkName is the relay's second sink: the same workflow, batched
// (docs/sinks.md "Batched delivery"), for the events of type batch.*.
const batchSinkName = "n8n-batch"

// tokenHeader is the header the workflow's Header Auth credential checks.
const tokenHeader = "X-Outbox-Token"

// options are the command-line flags.
type options struct {
	relayBin     string
	n8nDir       string
	workflowPath string
	tablesPath   string
	events       int
	outageEvents int
	outage       time.Duration
	stall        time.Duration
	timeout      time.Duration
	keep         bool
	// Batched scenarios (5-8): events, the sink's batch.max_events,
	// concurrency and batch.ordered, and the aggregates the events of
	// scenarios 6-8 fall on.
	batchEvents      int
	batchMax         int
	batchConcurrency int
	batchOrdered     bool
	aggregates       int
	// concurrency is the one-event-per-request sink's.
	concurrency int
	// only runs the scenarios whose number is listed ("" runs all).
	only string
	// profile is "regular" (one n8n process, sqlite) or "queue".
	profile string
}

func main() {
	opts, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-e2e-n8n: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err = run(ctx, opts, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "outbox-relay-e2e-n8n: FAIL: %v\n", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (*options, error) {
	fs := flag.NewFlagSet("outbox-relay-e2e-n8n", flag.ContinueOnError)
	o := &options{}
	home, _ := os.UserHomeDir()
	fs.StringVar(&o.relayBin, "relay", "", "the outbox-relay binary to test (required; make e2e-n8n passes bin/outbox-relay)")
	fs.StringVar(&o.n8nDir, "n8n-dir", filepath.Join(home, ".cache", "outbox-relay", "n8n-"+n8nVersion), "where n8n is installed and cached between runs (outside the clone: 2.3 GB)")
	fs.StringVar(&o.workflowPath, "workflow", "", "the workflow to test (default: deploy/n8n/outbox-workflow.json in this module)")
	fs.StringVar(&o.tablesPath, "tables", "", "SQL creating the workflow's tables (default: deploy/n8n/tables.sql in this module)")
	fs.IntVar(&o.events, "events", 500, "events published in the bulk scenario")
	fs.IntVar(&o.outageEvents, "outage-events", 200, "events published while n8n is stopped and restarted")
	fs.DurationVar(&o.outage, "outage", 20*time.Second, "how long n8n stays stopped in the outage scenario")
	fs.DurationVar(&o.stall, "stall", 90*time.Second, "a scenario gives up when its counts have not changed for this long")
	fs.DurationVar(&o.timeout, "timeout", 5*time.Minute, "longest a scenario waits for its events")
	fs.IntVar(&o.batchEvents, "batch-events", 2000, "events published in each batched throughput scenario (5, 8); scenarios 6 and 7 publish a quarter each")
	fs.IntVar(&o.concurrency, "concurrency", 8, "the one-event-per-request sink's concurrency (scenarios 1-4)")
	fs.IntVar(&o.batchMax, "batch-max", 100, "the batched sink's batch.max_events")
	fs.IntVar(&o.batchConcurrency, "batch-concurrency", 4, "the batched sink's concurrency (requests in flight)")
	fs.BoolVar(&o.batchOrdered, "batch-ordered", true, "the batched sink's batch.ordered: a batch may carry several events of one aggregate (false: one per aggregate per request)")
	fs.IntVar(&o.aggregates, "aggregates", 50, "the aggregates the events of scenarios 6, 7 and 8 fall on, in turn (scenario 5: one per event)")
	fs.StringVar(&o.only, "only", "", "run only these scenarios, by number (e.g. 1,5,6,7)")
	fs.StringVar(&o.profile, "profile", "regular", "regular: one n8n process on sqlite; queue: n8n's queue mode (PostgreSQL, a private redis-server, main + webhook process + 2 workers), scenarios 1, 5, 6, 7, 8 unless -only says otherwise")
	fs.BoolVar(&o.keep, "keep", false, "keep the work directory (logs, n8n database) even when every scenario passes")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case o.profile != "regular" && o.profile != "queue":
		return nil, fmt.Errorf("-profile %q is not regular or queue", o.profile)
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	case o.relayBin == "":
		return nil, errors.New("--relay is required (the outbox-relay binary; `make e2e-n8n` builds and passes it)")
	case o.events < 1 || o.outageEvents < 1:
		return nil, errors.New("--events and --outage-events must be positive")
	case o.aggregates < 1:
		return nil, errors.New("--aggregates must be positive")
	}
	return o, nil
}

// e2e is what the scenarios share.
type e2e struct {
	opts  *options
	out   io.Writer
	start time.Time
	pool  *pgxpool.Pool
	n8n   *n8nServer
	relay *proc
	token string
}

// say prints a progress line with the time since start.
func (e *e2e) say(format string, args ...any) {
	fmt.Fprintf(e.out, "[%6.1fs] ==> %s\n", time.Since(e.start).Seconds(), fmt.Sprintf(format, args...))
}

// timing is one setup step and how long it took, for the summary.
type timing struct {
	step string
	took time.Duration
	note string
}

func run(ctx context.Context, opts *options, out io.Writer) (err error) {
	e := &e2e{opts: opts, out: out, start: time.Now()}
	var timings []timing
	step := func(name string, since time.Time, note string) {
		timings = append(timings, timing{name, time.Since(since), note})
	}

	if err := e.locateFiles(); err != nil {
		return err
	}
	wf, err := readWorkflow(opts.workflowPath)
	if err != nil {
		return err
	}
	if _, err := exec.LookPath("sqlite3"); err != nil {
		return fmt.Errorf("the sqlite3 command-line tool is needed to count n8n's executions (apt-get install sqlite3): %w", err)
	}
	if opts.relayBin, err = filepath.Abs(opts.relayBin); err != nil {
		return err
	}
	if _, err := os.Stat(opts.relayBin); err != nil {
		return fmt.Errorf("--relay: %w (run make build)", err)
	}

	t := time.Now()
	install, err := ensureN8N(ctx, opts.n8nDir, e.say)
	if err != nil {
		return err
	}
	if install.Took > 0 {
		step("install n8n "+n8nVersion+" (npm)", t, "")
	} else {
		step("check the cached n8n install", t, install.Dir)
	}

	work, err := os.MkdirTemp("", "outbox-relay-e2e-n8n-")
	if err != nil {
		return err
	}
	defer func() {
		if err == nil && !opts.keep {
			_ = os.RemoveAll(work)
			return
		}
		fmt.Fprintf(out, "work directory kept: %s (relay.log, n8n.log, relay.yaml, n8n-user/.n8n/database.sqlite)\n", work)
	}()
	e.say("work directory %s", work)

	t = time.Now()
	e.say("starting a private PostgreSQL (wal_level=logical) from the local binaries")
	cluster, err := pgtest.StartCluster(ctx, pgtest.Options{})
	if err != nil {
		return fmt.Errorf("start PostgreSQL: %w", err)
	}
	defer func() {
		e.say("stopping PostgreSQL")
		if cerr := cluster.Close(); cerr != nil {
			fmt.Fprintf(out, "stop PostgreSQL: %v\n", cerr)
		}
	}()
	if err := cluster.CreateDatabase(ctx, "outbox"); err != nil {
		return err
	}
	dbURL := cluster.URL("outbox")
	step("start PostgreSQL, create the database", t, fmt.Sprintf("port %d", cluster.Port()))

	t = time.Now()
	if _, err := runLogged(ctx, "outbox-relay migrate", exec.CommandContext(ctx, opts.relayBin, "migrate", "--database-url", dbURL)); err != nil {
		return err
	}
	e.pool, err = pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer e.pool.Close()
	tables, err := os.ReadFile(opts.tablesPath)
	if err != nil {
		return err
	}
	if _, err := e.pool.Exec(ctx, string(tables)); err != nil {
		return fmt.Errorf("create the workflow's tables (%s): %w", opts.tablesPath, err)
	}
	step("outbox-relay migrate, the workflow's tables", t, "")

	// n8n: credentials, workflow, publish, start.
	e.n8n, err = newN8NServer(install, work, wf)
	if err != nil {
		return err
	}
	if opts.profile == "queue" {
		if opts.only == "" {
			opts.only = "1,5,6,7,8"
		}
		t = time.Now()
		redisBin, err := ensureRedis(ctx, e.say)
		if err != nil {
			return err
		}
		redisLog, err := newLogBuffer(queueLogPath(work))
		if err != nil {
			return err
		}
		redis, redisPort, err := startRedis(redisBin, work, redisLog)
		if err != nil {
			return err
		}
		defer func() {
			e.say("stopping redis-server")
			if _, serr := redis.stop(10 * time.Second); serr != nil {
				fmt.Fprintf(out, "stop redis-server: %v\n", serr)
			}
		}()
		if err := cluster.CreateDatabase(ctx, n8nDatabase); err != nil {
			return err
		}
		if e.n8n.queue, err = newQueueSetup(ctx, cluster.Port(), redisPort, cluster.URL(n8nDatabase)); err != nil {
			return err
		}
		defer e.n8n.queue.db.Close()
		step("queue profile: redis-server, n8n's database on PostgreSQL", t, fmt.Sprintf("redis port %d", redisPort))
	}
	defer func() {
		if e.n8n.proc == nil {
			return
		}
		e.say("stopping n8n (SIGTERM to pid %d)", e.n8n.proc.Pid())
		if _, serr := e.n8n.Stop(); serr != nil {
			fmt.Fprintf(out, "stop n8n: %v\n", serr)
		}
	}()
	e.token, err = randomHex(24)
	if err != nil {
		return err
	}
	credPath := filepath.Join(work, "credentials.json")
	if err := writeCredentials(credPath, wf, e.token, cluster.Port()); err != nil {
		return err
	}
	t = time.Now()
	e.say("n8n: import:credentials (Header Auth %q, Postgres %q)", wf.HeaderCred.Name, wf.PostgresCre.Name)
	if err := e.n8n.ImportCredentials(ctx, credPath); err != nil {
		return err
	}
	step("n8n import:credentials (first run: n8n's migrations)", t, "")
	t = time.Now()
	e.say("n8n: import:workflow %s, publish:workflow --id=%s", filepath.Base(wf.Path), wf.ID)
	if err := e.n8n.Deploy(ctx, true); err != nil {
		return err
	}
	step("n8n import:workflow + publish:workflow", t, "")
	e.say("n8n: start on 127.0.0.1:%d (runner broker %d)", e.n8n.port, e.n8n.brokerPort)
	took, err := e.n8n.Start(ctx, true)
	if err != nil {
		return err
	}
	timings = append(timings, timing{"n8n start until the webhook is registered", took, e.n8n.WebhookURL()})
	e.say("n8n ready in %s: %s", took.Round(100*time.Millisecond), e.n8n.WebhookURL())

	// The relay.
	t = time.Now()
	if err := e.startRelay(ctx, work, dbURL); err != nil {
		return err
	}
	defer func() {
		if done, _ := e.relay.exited(); done {
			return
		}
		e.say("stopping the relay (SIGTERM to pid %d)", e.relay.Pid())
		if _, serr := e.relay.stop(45 * time.Second); serr != nil {
			fmt.Fprintf(out, "stop the relay: %v\n", serr)
		}
		if _, werr := e.relay.exited(); werr != nil {
			fmt.Fprintf(out, "the relay exited with %v\n", werr)
		}
	}()
	step("outbox-relay run until its slot streams", t, "")

	results := e.runScenarios(ctx)
	printSummary(out, timings, results)
	if ctx.Err() != nil {
		return errors.New("interrupted")
	}
	var failed []string
	for _, r := range results {
		if r.Err != nil {
			failed = append(failed, r.Name)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("%d of %d scenarios failed: %s (details above)", len(failed), len(results), strings.Join(failed, "; "))
	}
	return nil
}

// locateFiles fills in the default workflow and tables paths from the
// module root (the directory of go.mod above the working directory).
func (e *e2e) locateFiles() error {
	if e.opts.workflowPath != "" && e.opts.tablesPath != "" {
		return nil
	}
	dir, err := os.Getwd()
	if err != nil {
		return err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return errors.New("run from inside the outbox-relay module, or pass --workflow and --tables")
		}
		dir = parent
	}
	if e.opts.workflowPath == "" {
		e.opts.workflowPath = filepath.Join(dir, "deploy", "n8n", "outbox-workflow.json")
	}
	if e.opts.tablesPath == "" {
		e.opts.tablesPath = filepath.Join(dir, "deploy", "n8n", "tables.sql")
	}
	return nil
}

// writeCredentials writes the two credentials the workflow references, in
// the format n8n import:credentials reads, with the data unencrypted (n8n
// encrypts an object on import).
func writeCredentials(path string, wf *workflowInfo, token string, pgPort int) error {
	creds := []map[string]any{
		{
			"id": wf.HeaderCred.ID, "name": wf.HeaderCred.Name, "type": "httpHeaderAuth",
			"data": map[string]any{"name": tokenHeader, "value": token},
		},
		{
			"id": wf.PostgresCre.ID, "name": wf.PostgresCre.Name, "type": "postgres",
			"data": map[string]any{
				"host": "127.0.0.1", "port": pgPort, "database": "outbox", "user": "postgres",
				"password": "", "ssl": "disable", "maxConnections": 20,
			},
		},
	}
	raw, err := json.MarshalIndent(creds, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, raw, 0o600)
}

// relayConfig is the relay's configuration: two webhook sinks to the same
// n8n workflow with header auth, the token from the environment: one event
// per request for the e2e.* events, batched for the batch.* events (ordered:
// the shipped workflow keeps the contract of docs/sinks.md "Ordered
// batches"); a claim-path backoff shorter than the scenarios' stall limit.
const relayConfig = `# written by outbox-relay-e2e-n8n
database_url: %q
data_dir: %q
sinks:
  - name: %[3]s
    type: webhook
    url: %[4]s
    events: ['e2e.*']
    timeout: 30s
    concurrency: %[9]d
    auth: {type: header, header: %[5]s, value: ${N8N_TOKEN}}
  - name: %[6]s
    type: webhook
    url: %[4]s
    events: ['batch.*']
    timeout: 60s
    concurrency: %[7]d
    batch: {max_events: %[8]d, max_wait: 20ms, ordered: %[10]t}
    auth: {type: header, header: %[5]s, value: ${N8N_TOKEN}}
# Retries of events diverted to the claim path come within 30 s (the
# default schedule reaches 2m at the fourth attempt, past -stall): an event
# whose requests failed while n8n restarted is retried while the scenario
# still waits for it.
delivery:
  backoff: [1s, 5s, 15s, 30s]
http:
  listen: 127.0.0.1:0
log: {level: info, format: json}
`

// startRelay writes the configuration, starts `outbox-relay run` and waits
// until its replication slot is active: rows written before the slot exists
// belong to the claim path, so the scenarios publish only after that.
func (e *e2e) startRelay(ctx context.Context, work, dbURL string) error {
	cfgPath := filepath.Join(work, "relay.yaml")
	cfg := fmt.Sprintf(relayConfig, dbURL, filepath.Join(work, "relay-data"), sinkName, e.n8n.WebhookURL(), tokenHeader,
		batchSinkName, e.opts.batchConcurrency, e.opts.batchMax, e.opts.concurrency, e.opts.batchOrdered)
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return err
	}
	log, err := newLogBuffer(filepath.Join(work, "relay.log"))
	if err != nil {
		return err
	}
	e.say("outbox-relay run --config %s (webhook sinks %s and %s, batched: %s)", cfgPath, sinkName, batchSinkName, e.n8n.WebhookURL())
	cmd := exec.Command(e.opts.relayBin, "run", "--config", cfgPath)
	cmd.Env = append(os.Environ(), "N8N_TOKEN="+e.token)
	e.relay, err = startProc("outbox-relay", cmd, log)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(time.Minute)
	for {
		var active bool
		err := e.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = 'outbox_relay' AND active)`).Scan(&active)
		if err != nil {
			return err
		}
		if active {
			return nil
		}
		if done, werr := e.relay.exited(); done {
			return fmt.Errorf("the relay exited before streaming (%v); end of its log:\n%s", werr, log.Tail(20))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the relay's slot outbox_relay is not active after a minute; end of its log:\n%s", log.Tail(20))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// printSummary prints the setup timings, the scenario table and each
// failure's details.
func printSummary(out io.Writer, timings []timing, results []result) {
	fmt.Fprintln(out)
	fmt.Fprintln(out, "Setup")
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	for _, t := range timings {
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", t.step, t.took.Round(100*time.Millisecond), t.note)
	}
	_ = tw.Flush()
	fmt.Fprintln(out)
	fmt.Fprintln(out, "Scenarios")
	tw = tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "  scenario\tresult\tevents\texecutions\teffects\tduplicates absorbed\ttime\tnote")
	for _, r := range results {
		status := "PASS"
		if r.Err != nil {
			status = "FAIL"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%d\t%d\t%d\t%d\t%s\t%s\n", r.Name, status, r.Events, r.Executions, r.Effects, r.Duplicates,
			r.Took.Round(100*time.Millisecond), r.Note)
	}
	_ = tw.Flush()
	for _, r := range results {
		if r.Err != nil {
			fmt.Fprintf(out, "\nFAIL %s:\n  %s\n", r.Name, strings.ReplaceAll(r.Err.Error(), "\n", "\n  "))
		}
	}
	fmt.Fprintln(out)
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}
