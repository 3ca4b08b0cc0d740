package webhook_test

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/sink/webhook"
)

func TestNewValidates(t *testing.T) {
	t.Parallel()
	const u = "http://127.0.0.1:5678/webhook/outbox"
	tests := []struct {
		name string
		cfg  webhook.Config
		want string // substring of the error; "" means valid
	}{
		{name: "defaults", cfg: webhook.Config{Name: "n8n", URL: u}},
		{name: "https", cfg: webhook.Config{Name: "n8n", URL: "https://n8n.example.com/webhook/x"}},
		{name: "every auth", cfg: webhook.Config{Name: "n8n", URL: u, Auth: webhook.Auth{Type: webhook.AuthJWT, Secret: "s"}}},
		{name: "no name", cfg: webhook.Config{URL: u}, want: "name is required"},
		{name: "no url", cfg: webhook.Config{Name: "n8n"}, want: "url"},
		{name: "relative url", cfg: webhook.Config{Name: "n8n", URL: "/webhook/outbox"}, want: "url"},
		{name: "ftp url", cfg: webhook.Config{Name: "n8n", URL: "ftp://host/x"}, want: "url"},
		{name: "url password not echoed", cfg: webhook.Config{Name: "n8n", URL: "ftp://user:hunter2@host/x"}, want: "url"},
		{name: "negative timeout", cfg: webhook.Config{Name: "n8n", URL: u, Timeout: -time.Second}, want: "negative"},
		{name: "negative concurrency", cfg: webhook.Config{Name: "n8n", URL: u, Concurrency: -1}, want: "negative"},
		{name: "permanent 302", cfg: webhook.Config{Name: "n8n", URL: u, PermanentStatuses: []int{302}}, want: "302"},
		{name: "permanent 401", cfg: webhook.Config{Name: "n8n", URL: u, PermanentStatuses: []int{401}}, want: "sink-level"},
		{name: "unknown auth", cfg: webhook.Config{Name: "n8n", URL: u, Auth: webhook.Auth{Type: "oauth"}}, want: `"oauth"`},
		{name: "jwt without secret", cfg: webhook.Config{Name: "n8n", URL: u, Auth: webhook.Auth{Type: webhook.AuthJWT}}, want: "secret"},
		{name: "standard-webhooks without secret", cfg: webhook.Config{Name: "n8n", URL: u,
			Auth: webhook.Auth{Type: webhook.AuthStandardWebhooks}}, want: "secret"},
		{name: "standard-webhooks bad whsec", cfg: webhook.Config{Name: "n8n", URL: u,
			Auth: webhook.Auth{Type: webhook.AuthStandardWebhooks, Secret: "whsec_hunter2!!"}}, want: "base64"},
		{name: "header without value", cfg: webhook.Config{Name: "n8n", URL: u,
			Auth: webhook.Auth{Type: webhook.AuthHeader, Header: "X-Key"}}, want: "value"},
		{name: "header auth on a sink header", cfg: webhook.Config{Name: "n8n", URL: u,
			Auth: webhook.Auth{Type: webhook.AuthHeader, Header: "webhook-id", Value: "v"}}, want: "Webhook-Id"},
		{name: "basic username with colon", cfg: webhook.Config{Name: "n8n", URL: u,
			Auth: webhook.Auth{Type: webhook.AuthBasic, Username: "a:b", Password: "p"}}, want: "colon"},
		{name: "static header replaces the id", cfg: webhook.Config{Name: "n8n", URL: u,
			Headers: map[string]string{"idempotency-key": "x"}}, want: "Idempotency-Key"},
		{name: "static Authorization with jwt", cfg: webhook.Config{Name: "n8n", URL: u,
			Auth:    webhook.Auth{Type: webhook.AuthJWT, Secret: "s"},
			Headers: map[string]string{"Authorization": "x"}}, want: "Authorization"},
		{name: "static Authorization without auth", cfg: webhook.Config{Name: "n8n", URL: u,
			Headers: map[string]string{"Authorization": "Bearer static"}}},
		{name: "static header bad name", cfg: webhook.Config{Name: "n8n", URL: u,
			Headers: map[string]string{"X Bad": "v"}}, want: "X Bad"},
		{name: "static header line break", cfg: webhook.Config{Name: "n8n", URL: u,
			Headers: map[string]string{"X-Ok": "a\r\nX-Evil: 1"}}, want: "line breaks"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := webhook.New(tt.cfg)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				if s.Name() != tt.cfg.Name {
					t.Fatalf("Name() = %q", s.Name())
				}
				return
			}
			if err == nil {
				t.Fatalf("New succeeded, want an error containing %q", tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %q does not contain %q", err, tt.want)
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Fatalf("error %q repeats a secret", err)
			}
		})
	}
}
