package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// readyLine is what n8n logs once its HTTP server is up. Webhooks are
// registered around the same time, which the OPTIONS probe confirms.
const readyLine = "Editor is now accessible via"

// workflowInfo is what the test needs to know about the shipped workflow.
type workflowInfo struct {
	Path        string // the workflow file
	ID          string // the workflow id n8n stores it under
	WebhookPath string // the Webhook node's path
	HeaderCred  credRef
	PostgresCre credRef
}

// credRef is a credential a node references.
type credRef struct{ ID, Name string }

// readWorkflow reads the workflow file and finds its id, the Webhook node's
// path and the credentials the nodes reference. It fails when the file is
// not the shape the test expects (one webhook with header auth and
// responseMode lastNode, Postgres nodes with one credential).
func readWorkflow(path string) (*workflowInfo, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the workflow: %w", err)
	}
	var wf struct {
		ID    string `json:"id"`
		Nodes []struct {
			Name        string                     `json:"name"`
			Type        string                     `json:"type"`
			Parameters  map[string]any             `json:"parameters"`
			Credentials map[string]json.RawMessage `json:"credentials"`
		} `json:"nodes"`
	}
	if err := json.Unmarshal(raw, &wf); err != nil {
		return nil, fmt.Errorf("parse %s: %w", path, err)
	}
	info := &workflowInfo{Path: path, ID: wf.ID}
	if info.ID == "" {
		return nil, fmt.Errorf("%s: the workflow has no id (the test imports it under a fixed id to publish it)", path)
	}
	for _, n := range wf.Nodes {
		for credType, rawRef := range n.Credentials {
			var ref struct{ ID, Name string }
			if err := json.Unmarshal(rawRef, &ref); err != nil {
				return nil, fmt.Errorf("%s: node %q: credential %s: %w", path, n.Name, credType, err)
			}
			target := map[string]*credRef{"httpHeaderAuth": &info.HeaderCred, "postgres": &info.PostgresCre}[credType]
			if target == nil {
				return nil, fmt.Errorf("%s: node %q uses a %s credential; the test creates only httpHeaderAuth and postgres", path, n.Name, credType)
			}
			if target.ID != "" && target.ID != ref.ID {
				return nil, fmt.Errorf("%s: two %s credentials (%s, %s); the test creates one", path, credType, target.ID, ref.ID)
			}
			*target = credRef{ID: ref.ID, Name: ref.Name}
		}
		if n.Type == "n8n-nodes-base.webhook" {
			if info.WebhookPath != "" {
				return nil, fmt.Errorf("%s: more than one Webhook node", path)
			}
			info.WebhookPath, _ = n.Parameters["path"].(string)
			// A 2xx must mean the workflow ran: it answers when its last
			// node finished, or from a Respond to Webhook node (the
			// shipped workflow's last node, answering per event).
			if m, _ := n.Parameters["responseMode"].(string); m != "lastNode" && m != "responseNode" {
				return nil, fmt.Errorf("%s: Webhook responseMode is %q, want lastNode or responseNode (a 2xx must mean the workflow ran)", path, m)
			}
			if a, _ := n.Parameters["authentication"].(string); a != "headerAuth" {
				return nil, fmt.Errorf("%s: Webhook authentication is %q; the test sets up headerAuth", path, a)
			}
		}
	}
	switch {
	case info.WebhookPath == "":
		return nil, fmt.Errorf("%s: no Webhook node with a path", path)
	case info.HeaderCred.ID == "" || info.PostgresCre.ID == "":
		return nil, fmt.Errorf("%s: the workflow must reference an httpHeaderAuth and a postgres credential by id", path)
	}
	return info, nil
}

// n8nServer runs one n8n instance from an install, with its user folder (the
// sqlite database, the encryption key) in a private directory, listening on
// loopback only. Its methods are not safe for concurrent use.
type n8nServer struct {
	install    *n8nInstall
	userFolder string
	port       int
	brokerPort int
	workflow   *workflowInfo
	log        *logBuffer
	proc       *proc // nil while stopped
	// queue is set in the queue profile: PostgreSQL, Redis, a webhook
	// process and workers beside the main process.
	queue *queueSetup
}

// newN8NServer prepares a server: user folder under workDir, two free
// loopback ports (HTTP and the task-runner broker), the log in workDir/n8n.log.
func newN8NServer(install *n8nInstall, workDir string, wf *workflowInfo) (*n8nServer, error) {
	folder := filepath.Join(workDir, "n8n-user")
	if err := os.MkdirAll(folder, 0o700); err != nil {
		return nil, err
	}
	log, err := newLogBuffer(filepath.Join(workDir, "n8n.log"))
	if err != nil {
		return nil, err
	}
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	return &n8nServer{install: install, userFolder: folder, port: ports[0], brokerPort: ports[1], workflow: wf, log: log}, nil
}

// env is the environment every n8n command runs with: loopback only, no
// telemetry or update checks, sqlite in the user folder.
func (s *n8nServer) env() []string {
	env := append(os.Environ(),
		"N8N_USER_FOLDER="+s.userFolder,
		"N8N_PORT="+strconv.Itoa(s.port),
		"N8N_LISTEN_ADDRESS=127.0.0.1",
		"N8N_HOST=127.0.0.1",
		"WEBHOOK_URL="+s.baseURL()+"/",
		"N8N_RUNNERS_BROKER_LISTEN_ADDRESS=127.0.0.1",
		"N8N_RUNNERS_BROKER_PORT="+strconv.Itoa(s.brokerPort),
		"N8N_DIAGNOSTICS_ENABLED=false",
		"N8N_VERSION_NOTIFICATIONS_ENABLED=false",
		"N8N_TEMPLATES_ENABLED=false",
		"N8N_PERSONALIZATION_ENABLED=false",
	)
	if s.queue != nil {
		return append(env, s.queue.env()...)
	}
	return append(env, "DB_TYPE=sqlite")
}

func (s *n8nServer) baseURL() string { return fmt.Sprintf("http://127.0.0.1:%d", s.port) }

// WebhookURL is the production URL of the workflow's Webhook node: on the
// webhook process in the queue profile.
func (s *n8nServer) WebhookURL() string {
	if s.queue != nil {
		return fmt.Sprintf("http://127.0.0.1:%d/webhook/%s", s.queue.webhookPort, s.workflow.WebhookPath)
	}
	return s.baseURL() + "/webhook/" + s.workflow.WebhookPath
}

// DatabasePath is n8n's sqlite database.
func (s *n8nServer) DatabasePath() string {
	return filepath.Join(s.userFolder, ".n8n", "database.sqlite")
}

// cli runs one n8n CLI command to completion (they take about 9 s each) and
// fails unless it exits 0 and prints want.
func (s *n8nServer) cli(ctx context.Context, want string, args ...string) error {
	cmd := exec.CommandContext(ctx, s.install.Bin, args...)
	cmd.Env = s.env()
	cmd.Dir = s.userFolder
	name := "n8n " + strings.Join(args, " ")
	out, err := runLogged(ctx, name, cmd)
	_, _ = s.log.Write([]byte("$ " + name + "\n" + out))
	if err != nil {
		return err
	}
	if !strings.Contains(out, want) {
		return fmt.Errorf("%s: exited 0 without %q:\n%s", name, want, lastLines(out, 20))
	}
	return nil
}

// ImportCredentials imports credentials (n8n's export format: an array of
// {id, name, type, data}; data given as an object is encrypted on import
// with the user folder's key, so no --decrypted flag is needed).
func (s *n8nServer) ImportCredentials(ctx context.Context, path string) error {
	return s.cli(ctx, "Successfully imported", "import:credentials", "--input="+path)
}

// Deploy stores the workflow again while n8n is stopped, and publishes it
// or not. import:workflow always stores a workflow unpublished; importing
// before every start also clears webhook registrations a previous run left,
// which would otherwise answer during startup and leave crashed executions.
func (s *n8nServer) Deploy(ctx context.Context, publish bool) error {
	if s.proc != nil {
		return errors.New("n8n must be stopped to import or publish a workflow")
	}
	if err := s.cli(ctx, "Successfully imported 1 workflow", "import:workflow", "--input="+s.workflow.Path); err != nil {
		return err
	}
	if publish {
		return s.cli(ctx, "Publishing workflow with ID: "+s.workflow.ID, "publish:workflow", "--id="+s.workflow.ID)
	}
	return s.cli(ctx, "Workflow unpublished successfully", "unpublish:workflow", "--id="+s.workflow.ID)
}

// Start starts n8n and waits until it serves: the log line readyLine and,
// when expectWebhook, an OPTIONS preflight on the webhook answering with
// the allowed methods OPTIONS and POST (that probe creates no execution).
// With expectWebhook false it waits until a POST to the webhook answers
// n8n's 404 "not registered", which also creates no execution. On failure
// n8n is stopped again.
func (s *n8nServer) Start(ctx context.Context, expectWebhook bool) (time.Duration, error) {
	if s.proc != nil {
		return 0, errors.New("n8n is already running")
	}
	start := time.Now()
	off := s.log.Len()
	_, _ = fmt.Fprintf(s.log, "$ n8n start (port %d, runner broker %d)\n", s.port, s.brokerPort)
	cmd := exec.Command(s.install.Bin, "start")
	cmd.Env = s.env()
	cmd.Dir = s.userFolder
	p, err := startProc("n8n", cmd, s.log)
	if err != nil {
		return 0, err
	}
	s.proc = p
	err = s.waitReady(ctx, off, expectWebhook)
	if err == nil && s.queue != nil {
		err = s.startHelpers(ctx, expectWebhook)
	}
	if err != nil {
		_, _ = s.Stop()
		return 0, err
	}
	return time.Since(start), nil
}

func (s *n8nServer) waitReady(ctx context.Context, off int, expectWebhook bool) error {
	deadline := time.Now().Add(2 * time.Minute)
	client := &http.Client{Timeout: 5 * time.Second}
	logged := false
	for {
		if done, err := s.proc.exited(); done {
			return fmt.Errorf("n8n exited during startup (%v); end of its log:\n%s", err, s.log.Tail(30))
		}
		if !logged {
			logged = strings.Contains(s.log.Since(off), readyLine)
		}
		if logged && s.queue != nil {
			return nil // the webhook process serves the webhook: startHelpers waits for it
		}
		if logged {
			ok, err := s.probe(ctx, client, expectWebhook)
			if ok {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("n8n logged %q but the webhook probe never passed: %v", readyLine, err)
			}
		} else if time.Now().After(deadline) {
			return fmt.Errorf("n8n did not log %q within 2 minutes; end of its log:\n%s", readyLine, s.log.Tail(30))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// probe checks the webhook's registration without running the workflow.
func (s *n8nServer) probe(ctx context.Context, client *http.Client, registered bool) (bool, error) {
	var req *http.Request
	var err error
	if registered {
		req, err = http.NewRequestWithContext(ctx, http.MethodOptions, s.WebhookURL(), nil)
		if err != nil {
			return false, err
		}
		req.Header.Set("Origin", s.baseURL())
		req.Header.Set("Access-Control-Request-Method", "POST")
	} else {
		// No auth header: an unregistered path answers 404 before any
		// authentication, a registered one would answer 403 without running.
		req, err = http.NewRequestWithContext(ctx, http.MethodPost, s.WebhookURL(), strings.NewReader("{}"))
		if err != nil {
			return false, err
		}
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := client.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	body := make([]byte, 512)
	n, _ := resp.Body.Read(body)
	if registered {
		allow := resp.Header.Get("Access-Control-Allow-Methods")
		if strings.Contains(allow, "POST") {
			return true, nil
		}
		return false, fmt.Errorf("OPTIONS %s: %s, Access-Control-Allow-Methods %q", s.WebhookURL(), resp.Status, allow)
	}
	if resp.StatusCode == http.StatusNotFound && strings.Contains(string(body[:n]), "is not registered") {
		return true, nil
	}
	return false, fmt.Errorf("POST %s: %s %s", s.WebhookURL(), resp.Status, body[:n])
}

// Stop sends SIGTERM to n8n's main process and waits for it (about 3 s);
// in the queue profile to the webhook process and the workers first.
// Stopping a stopped server does nothing.
func (s *n8nServer) Stop() (time.Duration, error) {
	if s.proc == nil {
		return 0, nil
	}
	start := time.Now()
	var helpersErr error
	if s.queue != nil {
		helpersErr = s.stopHelpers()
	}
	_, err := s.proc.stop(40 * time.Second)
	s.proc = nil
	return time.Since(start), errors.Join(helpersErr, err)
}

// Running reports whether n8n is running; when it exited on its own it
// returns an error quoting its log.
func (s *n8nServer) Running() error {
	if s.proc == nil {
		return errors.New("n8n is stopped")
	}
	if done, err := s.proc.exited(); done {
		return fmt.Errorf("n8n exited unexpectedly (%v); end of its log:\n%s", err, s.log.Tail(30))
	}
	if s.queue != nil {
		return s.helpersRunning()
	}
	return nil
}

// execCounts are n8n's executions of the workflow from its webhook.
type execCounts struct {
	Success int64 // finished with status success
	Failed  int64 // finished otherwise: error, crashed, canceled
	Running int64 // not finished: new, running, waiting
}

// Executions counts the workflow's webhook executions in n8n's sqlite
// database, read-only (safe while n8n runs; there is no CLI export of
// executions in n8n 2.8.4, and the REST API needs an owner account).
func (s *n8nServer) Executions(ctx context.Context) (execCounts, error) {
	if s.queue != nil {
		return s.queue.executions(ctx, s.workflow.ID)
	}
	var c execCounts
	if _, err := os.Stat(s.DatabasePath()); err != nil {
		return c, fmt.Errorf("n8n database: %w", err)
	}
	query := fmt.Sprintf(`SELECT coalesce(sum(status = 'success'), 0),
  coalesce(sum(status NOT IN ('success', 'new', 'running', 'waiting')), 0),
  coalesce(sum(status IN ('new', 'running', 'waiting')), 0)
FROM execution_entity WHERE workflowId = '%s' AND mode = 'webhook';`, strings.ReplaceAll(s.workflow.ID, "'", "''"))
	cmd := exec.CommandContext(ctx, "sqlite3", "-readonly", "-separator", " ", s.DatabasePath(), query)
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return c, fmt.Errorf("sqlite3 %s: %w: %s", s.DatabasePath(), err, strings.TrimSpace(errOut.String()))
	}
	if _, err := fmt.Sscan(out.String(), &c.Success, &c.Failed, &c.Running); err != nil {
		return c, fmt.Errorf("sqlite3: unexpected output %q: %w", out.String(), err)
	}
	return c, nil
}

// ExecutionsContaining counts the workflow's webhook executions whose
// stored data (every node's output, the answer among them) contains text.
func (s *n8nServer) ExecutionsContaining(ctx context.Context, text string) (int64, error) {
	if s.queue != nil {
		return s.queue.executionsContaining(ctx, s.workflow.ID, text)
	}
	query := fmt.Sprintf(`SELECT count(*) FROM execution_entity e JOIN execution_data d ON d.executionId = e.id
 WHERE e.workflowId = '%s' AND e.mode = 'webhook' AND instr(d.data, '%s') > 0;`,
		strings.ReplaceAll(s.workflow.ID, "'", "''"), strings.ReplaceAll(text, "'", "''"))
	cmd := exec.CommandContext(ctx, "sqlite3", "-readonly", s.DatabasePath(), query)
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("sqlite3 %s: %w: %s", s.DatabasePath(), err, strings.TrimSpace(errOut.String()))
	}
	var n int64
	if _, err := fmt.Sscan(out.String(), &n); err != nil {
		return 0, fmt.Errorf("sqlite3: unexpected output %q: %w", out.String(), err)
	}
	return n, nil
}

// freePorts returns n distinct free TCP ports on 127.0.0.1. They are free
// when returned; another process may still take one before it is bound.
func freePorts(n int) ([]int, error) {
	var ports []int
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free port: %w", err)
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
