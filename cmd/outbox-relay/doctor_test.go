package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
	"github.com/outbox-relay/outbox-relay/relay"
	natssink "github.com/outbox-relay/outbox-relay/sink/nats"
	"github.com/outbox-relay/outbox-relay/sink/nats/natstest"
)

// requireLines fails unless out contains every string in want.
func requireLines(t *testing.T, out string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q", w)
		}
	}
}

// withUser returns dbURL connecting as user.
func withUser(t *testing.T, dbURL, user string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(user)
	return u.String()
}

// TestDoctor_ReplicaClusterRoleWithoutReplication: wal_level=replica and a
// role without REPLICATION or grants — every failing check prints its fix,
// and doctor exits non-zero. In auto mode (the default) the relay polls
// there by design: wal_level and REPLICATION are warnings with the
// trade-off, and the poll-mode wake-up is suggested; in source.mode
// replication they fail.
func TestDoctor_ReplicaClusterRoleWithoutReplication(t *testing.T) {
	c := pgtest.NewCluster(t, pgtest.Options{WALLevel: "replica"})
	ctx := context.Background()
	if err := c.CreateDatabase(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := execute(t, "migrate", "--database-url", c.URL("app")); code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	conn := newPGConn(t, c.URL("app"))
	for _, sql := range []string{
		`CREATE ROLE relay_app LOGIN`,
		`GRANT SELECT ON integration_outbox TO relay_app`,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	hook := newN8NLike(t, map[string][]string{"outbox": {"POST"}})
	cfg := writeOpsConfig(t, withUser(t, c.URL("app"), "relay_app"), fmt.Sprintf(`
  - name: n8n
    type: webhook
    url: %s/webhook/outbox`, hook.URL))

	code, out, errOut := execute(t, "doctor", "--config", cfg)
	t.Logf("doctor:\n%s", out)
	if code != exitFailure || !strings.Contains(errOut, "doctor: 3 checks failed") {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	requireLines(t, out,
		"warn  wal_level", "auto mode polls here", "source.notify_trigger: true",
		"fix: ALTER SYSTEM SET wal_level = logical;", "-- then restart PostgreSQL", "or, to poll by choice, set source.mode: poll",
		"warn  REPLICATION", `fix: ALTER ROLE "relay_app" WITH REPLICATION;`,
		"warn  notify_trigger", "fix: set source.notify_trigger: true, then run outbox-relay migrate --config FILE",
		"FAIL  privileges on public.integration_outbox", `fix: GRANT UPDATE, DELETE ON "public"."integration_outbox" TO "relay_app";`,
		"FAIL  privileges on public.integration_idempotency", `fix: GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."integration_idempotency" TO "relay_app";`,
		"FAIL  privileges on public.relay_checkpoint", `fix: GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."relay_checkpoint" TO "relay_app";`,
		"ok    schema", "ok    least privilege",
		"ok    sink n8n", "n8n webhook POST /webhook/outbox is registered",
		"warn  max_slot_wal_keep_size", "ALTER SYSTEM SET max_slot_wal_keep_size = '10GB';",
		"3 failed",
	)
	if regexp.MustCompile(`(?m)^\S+\s+replication connection\s`).MatchString(out) {
		t.Error("tried a replication connection that cannot work")
	}

	// source.mode replication does not start here: both fail.
	replCfg := writeOpsConfig(t, withUser(t, c.URL("app"), "relay_app"), fmt.Sprintf(`
  - name: n8n
    type: webhook
    url: %s/webhook/outbox`, hook.URL), "source: {mode: replication}")
	code, out, errOut = execute(t, "doctor", "--config", replCfg)
	if code != exitFailure || !strings.Contains(errOut, "doctor: 5 checks failed") {
		t.Fatalf("source.mode replication: exit %d, stderr %q\n%s", code, errOut, out)
	}
	requireLines(t, out, "FAIL  wal_level", "source.mode replication needs logical", "FAIL  REPLICATION")
	if strings.Contains(out, "notify_trigger") {
		t.Errorf("source.mode replication: the poll-mode wake-up suggested:\n%s", out)
	}

	// --json: the same findings, machine-readable.
	code, out, _ = execute(t, "doctor", "--config", replCfg, "--json")
	var report struct {
		OK     bool          `json:"ok"`
		Checks []admin.Check `json:"checks"`
	}
	if err := json.Unmarshal([]byte(out), &report); err != nil {
		t.Fatalf("doctor --json: %v\n%s", err, out)
	}
	failed := 0
	for _, c := range report.Checks {
		if c.Status == admin.Fail {
			failed++
			if c.Fix == "" {
				t.Errorf("failing check %q has no fix", c.Name)
			}
		}
	}
	if code != exitFailure || report.OK || failed != 5 {
		t.Fatalf("doctor --json: exit %d ok %v, %d failed\n%s", code, report.OK, failed, out)
	}
}

// TestDoctor_Healthy: a logical cluster, migrated, a superuser, reachable
// sinks — warnings (superuser, unlimited slot WAL), exit 0.
func TestDoctor_Healthy(t *testing.T) {
	d := newOpsDB(t)
	hook := newN8NLike(t, map[string][]string{"outbox": {"POST"}})
	ns := natstest.Start(t)
	cfg := writeOpsConfig(t, d.url, fmt.Sprintf(`
  - name: n8n
    type: webhook
    url: %s/webhook/outbox
  - name: nats
    type: nats
    url: %s
  - name: embedded
    type: nats
    subject: "embedded.{{.EventType}}"
    stream: {name: EMBEDDED, subjects: ["embedded.>"]}`, hook.URL, ns.URL()))

	code, out, errOut := execute(t, "doctor", "--config", cfg)
	t.Logf("doctor:\n%s", out)
	if code != exitOK {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	requireLines(t, out,
		"ok    connection", "ok    wal_level", "ok    REPLICATION", "ok    replication connection", "ok    schema",
		"warn  least privilege", "is a superuser", `CREATE ROLE "outbox_relay" LOGIN REPLICATION`,
		"ok    publication outbox_relay", "ok    slot outbox_relay", "does not exist yet",
		"warn  max_slot_wal_keep_size",
		"ok    sink n8n", "ok    sink nats ", "connected to NATS",
		"ok    sink nats stream OUTBOX", "does not exist yet: run creates it",
		"ok    sink embedded", "embedded NATS server",
		", 0 failed",
	)

	// The stream as run creates it.
	js := jetStream(t, ns)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"outbox.>"}, Duplicates: 10 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	code, out, _ = execute(t, "doctor", "--config", cfg)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, out)
	}
	requireLines(t, out, `ok    sink nats stream OUTBOX`, `subjects ["outbox.>"] capture "outbox.*.*"`,
		"ok    sink nats duplicate_window", "deduplicates over 10m (the sink's stream.duplicate_window: 10m)")
}

// TestDoctor_SinkFailures: each way a sink can be unusable is a FAIL with
// its fix.
func TestDoctor_SinkFailures(t *testing.T) {
	d := newOpsDB(t)
	closed := freeAddr(t)
	tlsHook := httptest.NewUnstartedServer(http.NotFoundHandler())
	tlsHook.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshake
	tlsHook.StartTLS()                                   // self-signed: not trusted here
	defer tlsHook.Close()
	ns := natstest.Start(t)
	if _, err := jetStream(t, ns).CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "OUTBOX", Subjects: []string{"other.>"}, Duplicates: 30 * time.Second}); err != nil {
		t.Fatal(err)
	}
	cfg := writeOpsConfig(t, d.url, fmt.Sprintf(`
  - name: down
    type: webhook
    url: http://%s/webhook/outbox
  - name: tls
    type: webhook
    url: %s/webhook/outbox
  - name: bus
    type: nats
    url: %s
    stream: {name: OUTBOX, create: false}
  - name: nobus
    type: nats
    url: nats://%s
  - name: missing
    type: nats
    url: %s
    stream: {name: MISSING, create: false}`, closed, tlsHook.URL, ns.URL(), closed, ns.URL()))

	code, out, errOut := execute(t, "doctor", "--config", cfg)
	t.Logf("doctor:\n%s", out)
	if code != exitFailure || !strings.Contains(errOut, "doctor: 5 checks failed") {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	requireLines(t, out,
		"FAIL  sink down ", "unreachable", "fix: check sinks[0].url",
		"FAIL  sink tls ", "TLS handshake", "certificate",
		"FAIL  sink bus stream OUTBOX", `do not capture the sink's subjects "outbox.*.*"`, `fix: nats stream edit OUTBOX --subjects "other.>,outbox.>"`,
		"warn  sink bus duplicate_window", "deduplicates over 30s, less than the sink's stream.duplicate_window 10m", "fix: nats stream edit OUTBOX --dupe-window 10m\n",
		"FAIL  sink nobus ", "cannot connect to NATS", "fix: check sinks[3].url",
		"FAIL  sink missing stream MISSING", `fix: nats stream add MISSING --subjects "outbox.>" --dupe-window 10m --storage file`,
	)
}

// n8nLike answers as n8n 2.8 does (docs/n8n.md, "doctor's probe"): an
// OPTIONS preflight (Origin, Access-Control-Request-Method) on
// /webhook/PATH lists the methods registered for PATH in
// Access-Control-Allow-Methods and answers 204 when POST is one of them,
// else 500; on the test URL /webhook-test/PATH, 404 "not registered" (no
// test listening); on any other path, 404 "Cannot OPTIONS". It counts the
// requests that are not OPTIONS: the probe must send none.
type n8nLike struct {
	*httptest.Server
	sent atomic.Int64
}

func newN8NLike(t *testing.T, registered map[string][]string) *n8nLike {
	t.Helper()
	n := &n8nLike{}
	n.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodOptions {
			n.sent.Add(1)
			w.WriteHeader(http.StatusOK)
			return
		}
		switch path, live := strings.CutPrefix(r.URL.Path, "/webhook/"); {
		case live:
			methods := registered[path]
			if r.Header.Get("Origin") == "" {
				w.WriteHeader(http.StatusNoContent)
				return
			}
			w.Header().Set("Access-Control-Allow-Methods", strings.Join(append([]string{"OPTIONS"}, methods...), ", "))
			if !slices.Contains(methods, r.Header.Get("Access-Control-Request-Method")) {
				w.Header().Set("Content-Type", "text/html; charset=utf-8")
				w.WriteHeader(http.StatusInternalServerError)
				io.WriteString(w, "<!DOCTYPE html>\n<html lang=\"en\">\n<body>\n<pre>Internal Server Error</pre>\n</body>\n</html>\n")
				return
			}
			w.Header().Set("Access-Control-Allow-Origin", r.Header.Get("Origin"))
			w.WriteHeader(http.StatusNoContent)
		case strings.HasPrefix(r.URL.Path, "/webhook-test/"):
			w.Header().Set("Content-Type", "application/json; charset=utf-8")
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, `{"code":404,"message":"The requested webhook \"%s\" is not registered.","hint":"Click the 'Execute workflow' button on the canvas, then try again."}`,
				strings.TrimPrefix(r.URL.Path, "/webhook-test/"))
		default:
			w.Header().Set("Content-Type", "text/html; charset=utf-8")
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, "<pre>Cannot OPTIONS %s</pre>", r.URL.Path)
		}
	}))
	t.Cleanup(n.Close)
	return n
}

// TestDoctor_WebhookProbe: doctor sends each webhook sink an OPTIONS
// preflight, which n8n answers without running a workflow, and recognises
// a registered webhook, a path n8n has not registered (a wrong path or a
// workflow not published), n8n's test URL, a webhook registered for
// another method, a path the server does not have, and credentials a
// proxy refuses, each with its fix. Nothing is delivered.
func TestDoctor_WebhookProbe(t *testing.T) {
	d := newOpsDB(t)
	n8n := newN8NLike(t, map[string][]string{"outbox": {"POST"}, "getonly": {"GET"}})
	var authSeen atomic.Int64
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "relay" || p != "right" || r.Header.Get("X-Tenant") != "acme" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		authSeen.Add(1)
		w.WriteHeader(http.StatusNoContent)
	}))
	defer proxy.Close()
	cfg := writeOpsConfig(t, d.url, fmt.Sprintf(`
  - {name: registered, type: webhook, url: %[1]s/webhook/outbox}
  - {name: unregistered, type: webhook, url: %[1]s/webhook/nope}
  - {name: testurl, type: webhook, url: %[1]s/webhook-test/outbox}
  - {name: getonly, type: webhook, url: %[1]s/webhook/getonly}
  - {name: nosuchpath, type: webhook, url: %[1]s/hooks/outbox}
  - {name: refused, type: webhook, url: %[2]s/hook, auth: {type: basic, username: relay, password: wrong}, headers: {X-Tenant: acme}}
  - {name: admitted, type: webhook, url: %[2]s/hook, auth: {type: basic, username: relay, password: right}, headers: {X-Tenant: acme}}`, n8n.URL, proxy.URL),
		"source: {mode: poll}")

	code, out, errOut := execute(t, "doctor", "--config", cfg)
	t.Logf("doctor:\n%s", out)
	if code != exitFailure || !strings.Contains(errOut, "doctor: 5 checks failed") {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	requireLines(t, out,
		"ok    sink registered ", "n8n webhook POST /webhook/outbox is registered (OPTIONS probe; nothing delivered)",
		"FAIL  sink unregistered ", `n8n has no active workflow taking POST /webhook/nope`,
		`fix: publish (activate) the workflow whose Webhook node has HTTP Method POST and Path "nope"`,
		"copy the Webhook node's Production URL into sinks[1].url",
		"FAIL  sink testurl ", "n8n's test URL (/webhook-test/)",
		fmt.Sprintf("fix: set sinks[2].url to its production URL %s/webhook/outbox and publish (activate) the workflow", n8n.URL),
		"FAIL  sink getonly ", "n8n webhook /webhook/getonly takes GET, not POST",
		"fix: set the Webhook node's HTTP Method to POST, then publish the workflow again",
		"FAIL  sink nosuchpath ", "404 Not Found", "Cannot OPTIONS /hooks/outbox",
		"fix: check sinks[4].url's path: for n8n it is the Webhook node's Production URL, http(s)://HOST/webhook/PATH",
		"FAIL  sink refused ", "401 Unauthorized", "fix: check sinks[5].auth (type basic) and sinks[5].headers",
		"ok    sink admitted ", "answered the OPTIONS probe with 204 No Content",
	)
	if n := n8n.sent.Load(); n != 0 {
		t.Errorf("doctor sent %d requests other than OPTIONS", n)
	}
	if authSeen.Load() == 0 {
		t.Error("the probe did not carry the sink's credentials and headers")
	}
}

func TestSubjectPattern(t *testing.T) {
	for text, want := range map[string][2]string{
		"outbox.{{.AggregateType}}.{{.EventType}}": {"outbox.*.*", "outbox.>"},
		"events.{{.EventType}}":                    {"events.*", "events.>"},
		"{{.AggregateType}}.x":                     {"*.x", ">"},
		"fixed.subject":                            {"fixed.subject", "fixed.subject"},
		"a.pre{{.EventKey}}post.b":                 {"a.*.b", "a.>"},
	} {
		got, err := subjectPattern(text)
		if err != nil || got != want[0] || literalPrefix(got) != want[1] {
			t.Errorf("subjectPattern(%q) = %q (prefix %q), %v; want %q, %q", text, got, literalPrefix(got), err, want[0], want[1])
		}
	}
	if _, err := subjectPattern("outbox.{{.Payload}}"); err == nil {
		t.Error("a template naming the payload was accepted")
	}
}

func jetStream(t *testing.T, ns *natstest.Server) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(ns.URL(), ns.ClientOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// freeAddr returns a 127.0.0.1 address nothing listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// TestDoctor_AnotherDeploymentOnTheSubjects: the stream holds, on the NATS
// sink's subjects, messages another deployment published (its
// Outbox-Deployment is not this one's): doctor warns, naming the other
// deployment and the fix, and still exits 0. Messages of this deployment,
// of none (an earlier version's) or on other subjects raise nothing.
func TestDoctor_AnotherDeploymentOnTheSubjects(t *testing.T) {
	d := newOpsDB(t)
	ns := natstest.Start(t)
	cfg := writeOpsConfig(t, d.url, fmt.Sprintf(`
  - name: nats
    type: nats
    url: %s`, ns.URL()))
	js := jetStream(t, ns)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"outbox.>", "other.>"}, Duplicates: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	id, err := admin.ReadIdentity(context.Background(), d.pool)
	if err != nil {
		t.Fatal(err)
	}
	ours := natssink.DeploymentID(id.SystemIdentifier, id.Database, relay.QualifiedName{Schema: "public", Name: "integration_outbox"}.Quoted())
	publish := func(subject, deployment string) {
		t.Helper()
		m := nats.NewMsg(subject)
		if deployment != "" {
			m.Header.Set(natssink.HeaderDeployment, deployment)
		}
		if _, err := js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}
	}
	publish("outbox.order.placed", ours)
	publish("outbox.order.placed", "")
	publish("other.order.placed", "billing")

	code, out, errOut := execute(t, "doctor", "--config", cfg)
	if code != exitOK || !regexp.MustCompile(`ok    sink nats deployment +`+ours+`; the stream's last 3 messages hold, on the sink's subjects, 1 of this deployment and 1 of none`).MatchString(out) {
		t.Fatalf("doctor with this deployment's messages only: exit %d, want ok naming %s:\n%s%s", code, ours, out, errOut)
	}

	publish("outbox.order.placed", "billing")
	code, out, errOut = execute(t, "doctor", "--config", cfg)
	t.Logf("doctor:\n%s", out)
	if code != exitOK {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	requireLines(t, out, "warn  sink nats deployment", `messages of other deployments: billing (1) among its last 4; this one is `+ours,
		"fix: give each deployment subjects and a stream of its own")
}
