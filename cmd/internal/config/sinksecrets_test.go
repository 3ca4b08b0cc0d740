package config_test

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

// TestLoad_SinkSecretsOptional: for a command that never sends, a sink
// secret whose variable is unset, or whose file is missing, is no error and
// the auth type does not require it; the sinks' names and events load, and
// every other unset variable is still an error.
func TestLoad_SinkSecretsOptional(t *testing.T) {
	doc := `database_url: ${TEST_DB:-postgres://localhost/app}
sinks:
  - name: n8n
    type: webhook
    url: https://n8n.example.com/webhook/outbox
    events: ["order.*"]
    auth: {type: header, header: X-Outbox-Token, value: ${N8N_TOKEN}}
  - name: signed
    type: webhook
    url: https://hooks.example.com/in
    auth:
      type: standard-webhooks
      secret_file: /nonexistent/whsec
  - name: bus
    type: nats
    url: nats://nats.example:4222
    token: ${NATS_TOKEN}
`
	path := MustWriteFile(t, "relay.yaml", doc)
	_, err := config.Load(config.Options{Path: path, Environ: []string{}})
	requireErrorContains(t, err, "N8N_TOKEN", "NATS_TOKEN", "/nonexistent/whsec")

	c, err := config.Load(config.Options{Path: path, Environ: []string{}, SinkSecretsOptional: true})
	if err != nil {
		t.Fatalf("SinkSecretsOptional: %v", err)
	}
	if len(c.Sinks) != 3 || c.Sinks[0].Name != "n8n" || c.Sinks[0].Events[0] != "order.*" || c.Sinks[2].Name != "bus" {
		t.Errorf("sinks: %+v", c.Sinks)
	}
	if c.Sinks[0].Webhook.Auth.Value != "" || c.Sinks[2].NATS.Token != "" {
		t.Errorf("a secret was filled: %+v", c.Sinks)
	}

	_, err = config.Load(config.Options{Path: MustWriteFile(t, "relay.yaml", "database_url: ${DB_URL}\nsinks:\n  - {name: n8n, type: webhook, url: '${N8N_URL}'}\n"),
		Environ: []string{}, SinkSecretsOptional: true})
	requireErrorContains(t, err, "DB_URL", "N8N_URL")
}
