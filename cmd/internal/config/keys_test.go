package config_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/cmd/internal/config"
)

func TestKeys_Examples(t *testing.T) {
	keys := map[string]config.Key{}
	for _, k := range config.Keys() {
		if _, dup := keys[k.Path]; dup {
			t.Errorf("%s is listed twice", k.Path)
		}
		keys[k.Path] = k
	}
	for _, want := range []config.Key{
		{Path: "database_url", Type: "secret"},
		{Path: "source.mode", Type: "auto | replication | poll", Default: "auto"},
		{Path: "source.poll_interval", Type: "duration", Default: "1s"},
		{Path: "source.slot_max_retained", Type: "size", Default: "1GiB"},
		{Path: "source.notify_trigger", Type: "boolean", Default: "false"},
		{Path: "delivery.backoff", Type: "list of durations", Default: "[1s, 5s, 30s, 2m, 5m, 15m, 30m, 1h]"},
		{Path: "sinks[].name", Type: "string"},
		{Path: "sinks[].events", Type: "list of strings", Default: "['*']"},
		{Path: "sinks[].tls.ca_file", Type: "string"},
		{Path: "sinks[].format", Type: "envelope | cloudevents", Default: "envelope"},
		{Path: "sinks[].cloudevents.source", Type: "string"},
		{Path: "sinks[].timeout", Type: "duration", Default: "10s", Sink: config.SinkWebhook},
		{Path: "sinks[].auth.type", Type: "none | jwt | header | basic | standard-webhooks", Default: "none", Sink: config.SinkWebhook},
		{Path: "sinks[].headers", Type: "map of strings", Sink: config.SinkWebhook},
		{Path: "sinks[].permanent_statuses", Type: "list of integers", Default: "[400, 413, 415, 422]", Sink: config.SinkWebhook},
		{Path: "sinks[].stream.duplicate_window", Type: "duration", Default: "10m", Sink: config.SinkNATS},
		{Path: "sinks[].stream.max_msg_size", Type: "size", Default: "0", Sink: config.SinkNATS},
		{Path: "retention.batch", Type: "integer", Default: "1000"},
		{Path: "http.stall_after", Type: "duration", Default: "5m"},
	} {
		if got := keys[want.Path]; got != want {
			t.Errorf("key %s = %+v, want %+v", want.Path, got, want)
		}
	}
	for _, section := range []string{"source", "sinks", "sinks[].auth", "sinks[].stream", "sinks[].cloudevents"} {
		if _, ok := keys[section]; ok {
			t.Errorf("section %s is listed as a key", section)
		}
	}
}

// TestKeys_Load: every listed key is one Load accepts, and its default,
// set as a flag, loads as the default.
func TestKeys_Load(t *testing.T) {
	for _, k := range config.Keys() {
		t.Run(k.Path, func(t *testing.T) {
			yaml, path := "", k.Path
			if rest, ok := strings.CutPrefix(k.Path, "sinks[]."); ok {
				typ := k.Sink
				if typ == "" {
					typ = config.SinkWebhook
				}
				yaml = fmt.Sprintf("sinks:\n  - {name: s, type: %s, url: %s}\n", typ, map[config.SinkType]string{
					config.SinkWebhook: "http://h/", config.SinkNATS: "nats://h:4222",
				}[typ])
				path = "sinks[0]." + rest
			}
			want := MustLoad(t, yaml)
			opts := config.Options{Environ: []string{}, Overrides: map[string]string{path: k.Default}}
			if k.Default == "" {
				opts.Overrides[path] = "x" // an empty one would be ignored
			}
			if yaml != "" {
				opts.Path = MustWriteFile(t, "relay.yaml", yaml)
			}
			got, err := config.Load(opts)
			if k.Default == "" {
				if err != nil && strings.Contains(err.Error(), "unknown key") {
					t.Fatal(err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			assertEqualConfig(t, got, want)
		})
	}
}

// TestKeys_Printed: every key the config command prints is listed.
func TestKeys_Printed(t *testing.T) {
	c := MustLoad(t, fullFile)
	out, err := c.Redacted()
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(out, &doc); err != nil {
		t.Fatal(err)
	}
	var printed []string
	var collect func(n *yaml.Node, path string)
	collect = func(n *yaml.Node, path string) {
		switch {
		case path == "sinks":
			for _, s := range n.Content {
				collect(s, "sinks[]")
			}
		case n.Kind == yaml.MappingNode && !strings.HasSuffix(path, "headers"):
			for i := 0; i < len(n.Content); i += 2 {
				collect(n.Content[i+1], strings.TrimPrefix(path+"."+n.Content[i].Value, "."))
			}
		default:
			printed = append(printed, path)
		}
	}
	collect(doc.Content[0], "")
	var listed []string
	for _, k := range config.Keys() {
		listed = append(listed, k.Path)
	}
	for _, p := range printed {
		if !slices.Contains(listed, p) {
			t.Errorf("%s is printed but not listed", p)
		}
	}
	if len(printed) < 60 {
		t.Errorf("only %d keys printed:\n%s", len(printed), out)
	}
}
