package config_test

import (
	"testing"
	"time"
)

// TestLoad_ScalarsAndNulls pins the rules Load keeps where yaml.v3 alone
// would decode differently: it truncates 1.5 to the integer 1, reads "yes"
// and "on" as true and a quoted "42" as no integer, and sets a list or map
// to nil for a null value instead of leaving its default.
func TestLoad_ScalarsAndNulls(t *testing.T) {
	c := MustLoad(t, "source:\n  batch_size: \"42\"\n  notify_trigger: \"True\"\ndelivery:\n  backoff: ${EMPTY:-}\nsinks:\n  - name: a\n    type: webhook\n    url: http://h/\n    events:\n    permanent_statuses: ~\n    headers:\n")
	if c.Source.BatchSize != 42 || !c.Source.NotifyTrigger {
		t.Errorf("source = %+v", c.Source)
	}
	if len(c.Delivery.Backoff) != 8 || c.Delivery.Backoff[0] != sec(time.Second) {
		t.Errorf("backoff = %v, want the default", c.Delivery.Backoff)
	}
	if s := c.Sinks[0]; len(s.Events) != 1 || len(s.Webhook.PermanentStatuses) != 4 || s.Webhook.Headers != nil {
		t.Errorf("sink = %+v, want the default events, statuses and no headers", s)
	}

	_, err := load(t, "source:\n  batch_size: 1.5\n  notify_trigger: yes\nretention:\n  batch: 0x10\n  enabled: on\n")
	requireErrorContains(t, err,
		`relay.yaml:2: source.batch_size: expected an integer, got "1.5"`,
		`relay.yaml:3: source.notify_trigger: expected true or false, got "yes"`,
		`relay.yaml:5: retention.batch: expected an integer, got "0x10"`,
		`relay.yaml:6: retention.enabled: expected true or false, got "on"`,
	)
}

// TestLoad_LibraryErrorsLocated: the errors yaml.v3 reports by node name
// the key path and origin, in the file, in a RELAY_ value and in a sink.
func TestLoad_LibraryErrorsLocated(t *testing.T) {
	_, err := load(t, "source:\n  poll_interval: [1s]\nsinks:\n  - name: a\n    type: webhook\n    url: http://h/\n    headers: {X: [1]}\n    max_body: 1XB\n  - x\n",
		"RELAY_SINKS_0_TLS=[a]", "RELAY_HTTP={listen: {a: b}}")
	requireErrorContains(t, err,
		"relay.yaml:2: source.poll_interval: expected a single value, got a list",
		"relay.yaml:7: sinks[0].headers.X: expected a single value, got a list",
		`relay.yaml:8: sinks[0].max_body: invalid size "1XB"`,
		"relay.yaml:9: sinks[1]: expected a mapping of keys, got a single value",
		"RELAY_SINKS_0_TLS: sinks[0].tls: expected a mapping of keys, got a list",
		"RELAY_HTTP: http.listen: expected a single value, got a mapping",
	)
}
