package config_test

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

const notifySinks = "sinks:\n  - {name: n8n, type: webhook, url: 'http://h/x'}\n  - {name: bus, type: nats}\n"

// TestNotify_Defaults: notifications are off (no url) with the documented
// defaults; the file, the environment and a url file set them.
func TestNotify_Defaults(t *testing.T) {
	c := MustLoad(t, "")
	want := config.NotifyConfig{Format: config.NotifySlack, Interval: sec(time.Minute), Timeout: sec(10 * time.Second), Auth: config.AuthConfig{Type: config.AuthNone}}
	if c.Notify.URL != "" || c.Notify.Format != want.Format || c.Notify.Interval != want.Interval || c.Notify.Timeout != want.Timeout || c.Notify.Auth != want.Auth {
		t.Fatalf("notify defaults = %+v, want %+v", c.Notify, want)
	}

	c = MustLoad(t, notifySinks+"notify: {url: 'https://hooks.slack.com/services/T0/B0/secret', format: json, sinks: [n8n, '*'], console_url: 'http://127.0.0.1:9187/console/', headers: {X-Team: ops}}\n",
		"RELAY_NOTIFY_INTERVAL=5m", "RELAY_NOTIFY_TIMEOUT=30s")
	n := c.Notify
	if n.URL.Reveal() != "https://hooks.slack.com/services/T0/B0/secret" || n.Format != config.NotifyJSON || n.Interval != sec(5*time.Minute) ||
		n.Timeout != sec(30*time.Second) || !slices.Equal(n.Sinks, []string{"n8n", "*"}) || n.ConsoleURL != "http://127.0.0.1:9187/console/" || n.Headers["X-Team"] != "ops" {
		t.Fatalf("notify = %+v", n)
	}
	out, err := c.Redacted()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "secret") || !strings.Contains(string(out), "notify:") {
		t.Errorf("the printed configuration shows the notify url:\n%s", out)
	}

	file := MustWriteFile(t, "slack-url", "https://hooks.slack.com/services/T1/B1/fromfile\n")
	c = MustLoad(t, notifySinks+"notify: {url_file: '"+filepath.ToSlash(file)+"', auth: {type: header, header: X-Token, value: v}}\n")
	if c.Notify.URL.Reveal() != "https://hooks.slack.com/services/T1/B1/fromfile" || c.Notify.Auth.Value.Reveal() != "v" {
		t.Fatalf("notify from a url file = %+v", c.Notify)
	}
}

// TestNotify_Invalid: each bad value is an error naming its key; nothing is
// checked while notifications are off.
func TestNotify_Invalid(t *testing.T) {
	for _, c := range []struct {
		yaml string
		want []string
	}{
		{"notify: {url: 'ftp://x/secret-token'}\n", []string{"notify.url", "not an absolute http"}},
		{"notify: {url: 'http://x', format: xml}\n", []string{"notify.format", `"xml" is not one of slack, json`}},
		{"notify: {url: 'http://x', interval: 0s}\n", []string{"notify.interval", "greater than zero"}},
		{"notify: {url: 'http://x', interval: 10s, timeout: 10s}\n", []string{"notify.timeout", "not shorter than notify.interval"}},
		{"notify: {url: 'http://x', sinks: [erp]}\n", []string{"notify.sinks[0]", `"erp" is not the name of a configured sink`}},
		{"notify: {url: 'http://x', sinks: [n8n, n8n]}\n", []string{"notify.sinks[1]", "listed twice"}},
		{"notify: {url: 'http://x', console_url: '/console/'}\n", []string{"notify.console_url", "not an absolute http"}},
		{"notify: {url: 'http://x', headers: {'bad header': v}}\n", []string{"notify.headers", "not a valid header name"}},
		{"notify: {url: 'http://x', auth: {type: jwt}}\n", []string{"notify.auth.secret", "required for auth type jwt"}},
		{"notify: {url: 'http://x', url_file: /run/secrets/u}\n", []string{"notify.url_file", "notify.url is set too"}},
		{"notify: {url: 'http://x', colour: red}\n", []string{"notify.colour"}},
	} {
		_, err := load(t, notifySinks+c.yaml)
		requireErrorContains(t, err, c.want...)
		if err != nil && strings.Contains(err.Error(), "secret-token") {
			t.Errorf("the error shows the url: %v", err)
		}
	}
	// Off: the other keys wait until a url is set.
	MustLoad(t, notifySinks+"notify: {url: '', sinks: [erp], auth: {type: jwt}}\n")
	// The embedded NATS sink is a sink too.
	MustLoad(t, "embedded_nats: true\nnotify: {url: 'http://x', sinks: [nats]}\n")
}
