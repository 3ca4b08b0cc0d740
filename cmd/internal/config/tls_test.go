package config

import (
	"strings"
	"testing"
)

// TestTLSKeysFromEnvironment: the tls section and the metrics token are keys
// like any other: settable as RELAY_ variables, printed by Redacted.
func TestTLSKeysFromEnvironment(t *testing.T) {
	cfg, err := Load(Options{Environ: []string{
		"RELAY_SINKS=[{name: n, type: nats, url: 'nats://127.0.0.1:4222'}]",
		"RELAY_SINKS_0_TLS_INSECURE_SKIP_VERIFY=true",
		"RELAY_HTTP_METRICS_TOKEN=tok-SECRET",
	}})
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.Sinks[0].TLS.InsecureSkipVerify || cfg.HTTP.MetricsToken.Reveal() != "tok-SECRET" {
		t.Fatalf("tls %+v, token set %v", cfg.Sinks[0].TLS, cfg.HTTP.MetricsToken != "")
	}
	tc, err := cfg.Sinks[0].TLS.ClientConfig()
	if err != nil || tc == nil || !tc.InsecureSkipVerify {
		t.Fatalf("client config %v, %v", tc, err)
	}
	out, err := cfg.Redacted()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "tok-SECRET") || !strings.Contains(string(out), "insecure_skip_verify: true") {
		t.Errorf("redacted:\n%s", out)
	}
	if c, err := (TLSConfig{}).ClientConfig(); c != nil || err != nil {
		t.Errorf("zero tls section: %v, %v", c, err)
	}
}
