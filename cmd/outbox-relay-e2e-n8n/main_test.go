package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestShippedWorkflow checks that deploy/n8n/outbox-workflow.json has the
// shape the end-to-end run relies on, without n8n: a fixed id, one Webhook
// node on path "outbox" with header auth and responseMode lastNode, and one
// Header Auth and one Postgres credential referenced by id.
func TestShippedWorkflow(t *testing.T) {
	wf, err := readWorkflow(filepath.Join("..", "..", "deploy", "n8n", "outbox-workflow.json"))
	if err != nil {
		t.Fatal(err)
	}
	if wf.ID != "outboxRelayApply" || wf.WebhookPath != "outbox" {
		t.Errorf("id %q, webhook path %q; want outboxRelayApply, outbox (docs/n8n.md names both)", wf.ID, wf.WebhookPath)
	}
	if wf.HeaderCred != (credRef{"outboxRelayToken", "outbox-relay"}) || wf.PostgresCre != (credRef{"outboxRelayPgsql", "outbox-relay-postgres"}) {
		t.Errorf("credentials %+v, %+v; docs/n8n.md documents outboxRelayToken/outbox-relay and outboxRelayPgsql/outbox-relay-postgres", wf.HeaderCred, wf.PostgresCre)
	}
}

// TestShippedWorkflowAnswersWhenANodeFails: in n8n 2.8.4 an execution that
// fails before its Respond to Webhook node answers 200 with an empty body,
// which the relay reads as "every event delivered" (docs/n8n.md). So the
// shipped workflow has no Code node (Code nodes run in n8n's task runner,
// which a SIGTERM stops before the executions in flight, failing them), and
// its nodes that reach the database before the answer either answer
// themselves when they fail (Claim events: 503, nothing was claimed) or
// let the answer go on (the business step, Settle claims).
func TestShippedWorkflowAnswersWhenANodeFails(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "deploy", "n8n", "outbox-workflow.json"))
	if err != nil {
		t.Fatal(err)
	}
	var wf struct {
		Nodes []struct {
			Name, Type, OnError string
		} `json:"nodes"`
	}
	if err := json.Unmarshal(raw, &wf); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"Claim events":                        "continueErrorOutput",
		"Apply business effect (placeholder)": "continueRegularOutput",
		"Settle claims":                       "continueRegularOutput",
	}
	for _, n := range wf.Nodes {
		if n.Type == "n8n-nodes-base.code" {
			t.Errorf("node %q is a Code node: it fails while n8n shuts down, and the execution then answers 200", n.Name)
		}
		if w, ok := want[n.Name]; ok {
			if n.OnError != w {
				t.Errorf("node %q: onError %q, want %q", n.Name, n.OnError, w)
			}
			delete(want, n.Name)
		}
	}
	for name := range want {
		t.Errorf("no node %q", name)
	}
}

func TestReadWorkflowRefuses(t *testing.T) {
	tests := []struct {
		name, json, want string
	}{
		{"no id", `{"nodes": []}`, "no id"},
		{"respond immediately", `{"id": "w", "nodes": [{"name": "Webhook", "type": "n8n-nodes-base.webhook",
			"parameters": {"path": "outbox", "responseMode": "onReceived", "authentication": "headerAuth"}}]}`, "want lastNode or responseNode"},
		{"no credentials", `{"id": "w", "nodes": [{"name": "Webhook", "type": "n8n-nodes-base.webhook",
			"parameters": {"path": "outbox", "responseMode": "lastNode", "authentication": "headerAuth"}}]}`, "by id"},
		{"unknown credential", `{"id": "w", "nodes": [{"name": "Slack", "type": "x",
			"credentials": {"slackApi": {"id": "s", "name": "s"}}}]}`, "slackApi"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "wf.json")
			if err := os.WriteFile(path, []byte(tt.json), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := readWorkflow(path)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("readWorkflow = %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

func TestExplainMissing(t *testing.T) {
	str := func(s string) *string { return &s }
	now := time.Now()
	rows := []missingRow{
		{ID: 7, Key: "a", Status: "pending", DivertedAt: &now, LastError: str(`sink n8n: transient: webhook n8n: event "a": request not written: connection refused`)},
		{ID: 8, Key: "b", Status: "pending", DivertedAt: &now, LastError: str(`sink n8n: transient: webhook n8n: event "b": request not written: connection refused`)},
		{ID: 9, Key: "c", Status: "pending", DivertedAt: &now, LastError: str("sink n8n: circuit open: sink is down")},
		{ID: 12, Key: "d", Status: "failed", LastError: str("permanent: 404 Cannot POST /webhook/outbox")},
		{ID: 13, Key: "e", Status: "pending", Ledger: str("delivered")},
	}
	got := explainMissing(rows, 90*time.Second)
	for _, want := range []string{
		"5 events have no business effect after waiting 1m30s",
		"1 LOST: the relay's ledger says delivered", "ids 13;",
		"3 PENDING WITH handoff_at", "ids 7-9;",
		`last_error: (2) sink n8n: transient: webhook n8n: event "…": request not written: connection refused`,
		"last_error: (1) sink n8n: circuit open: sink is down",
		"1 DEAD-LETTERED (status failed): ids 12;",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("explainMissing does not say %q:\n%s", want, got)
		}
	}
}

func TestParseFlags(t *testing.T) {
	if _, err := parseFlags(nil); err == nil || !strings.Contains(err.Error(), "--relay") {
		t.Errorf("parseFlags without --relay = %v, want an error naming --relay", err)
	}
	o, err := parseFlags([]string{"--relay", "bin/outbox-relay", "--events", "10"})
	if err != nil {
		t.Fatal(err)
	}
	if o.events != 10 || o.outageEvents != 200 || o.outage != 20*time.Second || !strings.HasSuffix(o.n8nDir, filepath.Join(".cache", "outbox-relay", "n8n-2.8.4")) {
		t.Errorf("options %+v", o)
	}
}
