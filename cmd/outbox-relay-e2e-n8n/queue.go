package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Queue mode (docs/n8n.md "Queue mode"): n8n's database on PostgreSQL,
// Redis for the job queue, the main process (triggers, the editor), one
// webhook process that takes the relay's requests and waits for each
// execution's result, and workers that run the executions.

// queueWorkers is how many `n8n worker` processes the profile starts.
const queueWorkers = 2

// queueSetup is what the queue profile adds to an n8nServer.
type queueSetup struct {
	pgPort      int // the private cluster; n8n's database is n8nDatabase
	redisPort   int
	webhookPort int
	// brokerPorts are the task-runner broker ports of the webhook process
	// and of each worker (the main process uses n8nServer.brokerPort).
	brokerPorts []int
	db          *pgxpool.Pool // n8n's database, to count executions

	webhook *proc
	workers []*proc
}

// n8nDatabase is the database n8n keeps its own data in, in queue mode.
const n8nDatabase = "n8n"

// ensureRedis returns the redis-server binary, installing Debian's package
// with apt-get when it is missing and we are root (its service is not
// started: a policy-rc.d denies every start while it installs).
func ensureRedis(ctx context.Context, say func(string, ...any)) (string, error) {
	if bin, err := exec.LookPath("redis-server"); err == nil {
		return bin, nil
	}
	if os.Geteuid() != 0 {
		return "", errors.New("redis-server is missing and we are not root: apt-get install redis-server")
	}
	say("installing Debian's redis-server with apt-get")
	const policy = "/usr/sbin/policy-rc.d"
	if _, err := os.Stat(policy); errors.Is(err, os.ErrNotExist) {
		if err := os.WriteFile(policy, []byte("#!/bin/sh\nexit 101\n"), 0o755); err == nil {
			defer os.Remove(policy)
		}
	}
	for _, args := range [][]string{{"update", "-qq"}, {"install", "-y", "-qq", "--no-install-recommends", "redis-server"}} {
		cmd := exec.CommandContext(ctx, "apt-get", args...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if _, err := runLogged(ctx, "apt-get "+args[0], cmd); err != nil {
			return "", err
		}
	}
	return exec.LookPath("redis-server")
}

// startRedis starts a private redis-server on a free loopback port, without
// persistence, logging to log.
func startRedis(bin, dir string, log *logBuffer) (*proc, int, error) {
	ports, err := freePorts(1)
	if err != nil {
		return nil, 0, err
	}
	cmd := exec.Command(bin, "--port", strconv.Itoa(ports[0]), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir)
	p, err := startProc("redis-server", cmd, log)
	if err != nil {
		return nil, 0, err
	}
	return p, ports[0], nil
}

// newQueueSetup prepares the ports of the queue profile and connects to
// n8n's database on the private cluster.
func newQueueSetup(ctx context.Context, pgPort, redisPort int, pgURL string) (*queueSetup, error) {
	ports, err := freePorts(2 + queueWorkers)
	if err != nil {
		return nil, err
	}
	db, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		return nil, err
	}
	return &queueSetup{pgPort: pgPort, redisPort: redisPort, webhookPort: ports[0], brokerPorts: ports[1:], db: db}, nil
}

// queueEnv is the queue profile's part of every n8n process's environment.
func (q *queueSetup) env() []string {
	return []string{
		"DB_TYPE=postgresdb",
		"DB_POSTGRESDB_HOST=127.0.0.1",
		"DB_POSTGRESDB_PORT=" + strconv.Itoa(q.pgPort),
		"DB_POSTGRESDB_DATABASE=" + n8nDatabase,
		"DB_POSTGRESDB_USER=postgres",
		"DB_POSTGRESDB_PASSWORD=",
		"EXECUTIONS_MODE=queue",
		"QUEUE_BULL_REDIS_HOST=127.0.0.1",
		"QUEUE_BULL_REDIS_PORT=" + strconv.Itoa(q.redisPort),
		"QUEUE_HEALTH_CHECK_ACTIVE=false",
	}
}

// startHelpers starts the webhook process and the workers once the main
// process is up, and waits until the webhook process serves the workflow's
// webhook.
func (s *n8nServer) startHelpers(ctx context.Context, expectWebhook bool) error {
	q := s.queue
	start := func(name string, brokerPort int, args ...string) (*proc, error) {
		_, _ = fmt.Fprintf(s.log, "$ n8n %v (runner broker %d)\n", args, brokerPort)
		cmd := exec.Command(s.install.Bin, args...)
		cmd.Env = append(s.env(), "N8N_RUNNERS_BROKER_PORT="+strconv.Itoa(brokerPort))
		if name == "n8n webhook" {
			cmd.Env = append(cmd.Env, "N8N_PORT="+strconv.Itoa(q.webhookPort))
		}
		cmd.Dir = s.userFolder
		return startProc(name, cmd, s.log)
	}
	var err error
	if q.webhook, err = start("n8n webhook", q.brokerPorts[0], "webhook"); err != nil {
		return err
	}
	for i := range queueWorkers {
		w, err := start(fmt.Sprintf("n8n worker %d", i+1), q.brokerPorts[1+i], "worker", "--concurrency=10")
		if err != nil {
			return err
		}
		q.workers = append(q.workers, w)
	}
	deadline := time.Now().Add(2 * time.Minute)
	client := &http.Client{Timeout: 5 * time.Second}
	for {
		for _, p := range append([]*proc{q.webhook}, q.workers...) {
			if done, err := p.exited(); done {
				return fmt.Errorf("%s exited during startup (%v); end of the log:\n%s", p.name, err, s.log.Tail(30))
			}
		}
		ok, err := s.probe(ctx, client, expectWebhook)
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the n8n webhook process does not serve the webhook after 2 minutes: %v", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// stopHelpers stops the webhook process and the workers (SIGTERM; a worker
// finishes its running executions first).
func (s *n8nServer) stopHelpers() error {
	q := s.queue
	var errs []error
	for _, p := range append([]*proc{q.webhook}, q.workers...) {
		if p == nil {
			continue
		}
		if _, err := p.stop(40 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	q.webhook, q.workers = nil, nil
	return errors.Join(errs...)
}

// helpersRunning fails when the webhook process or a worker has exited.
func (s *n8nServer) helpersRunning() error {
	for _, p := range append([]*proc{s.queue.webhook}, s.queue.workers...) {
		if p == nil {
			return errors.New("n8n's webhook process or a worker is stopped")
		}
		if done, err := p.exited(); done {
			return fmt.Errorf("%s exited unexpectedly (%v); end of the log:\n%s", p.name, err, s.log.Tail(30))
		}
	}
	return nil
}

// queueExecutions counts the workflow's webhook executions in n8n's
// PostgreSQL database.
func (q *queueSetup) executions(ctx context.Context, workflowID string) (execCounts, error) {
	var c execCounts
	err := q.db.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE status = 'success'),
       count(*) FILTER (WHERE status NOT IN ('success', 'new', 'running', 'waiting')),
       count(*) FILTER (WHERE status IN ('new', 'running', 'waiting'))
  FROM execution_entity WHERE "workflowId" = $1 AND mode = 'webhook'`, workflowID).Scan(&c.Success, &c.Failed, &c.Running)
	if err != nil {
		return c, fmt.Errorf("count n8n's executions: %w", err)
	}
	return c, nil
}

// executionsContaining counts the workflow's webhook executions whose
// stored data contains text, in n8n's PostgreSQL database.
func (q *queueSetup) executionsContaining(ctx context.Context, workflowID, text string) (int64, error) {
	var n int64
	err := q.db.QueryRow(ctx, `
SELECT count(*) FROM execution_entity e JOIN execution_data d ON d."executionId" = e.id
 WHERE e."workflowId" = $1 AND e.mode = 'webhook' AND strpos(d.data, $2) > 0`, workflowID, text).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count n8n's executions containing %q: %w", text, err)
	}
	return n, nil
}

// queueLogPath is where the queue profile's Redis logs.
func queueLogPath(work string) string { return filepath.Join(work, "redis.log") }
