// Package deploy holds the deployment files (Dockerfile, compose, Kubernetes,
// systemd, the Grafana dashboard and the Prometheus alert rules). This Go
// file names the metrics the shipped dashboard and alert rules query, for
// the tests that hold them to the relay's /metrics: deploy/deploy_test.go
// against the list below, cmd/outbox-relay's TestMetricsScrape against a
// running relay. The relay binary does not import it.
package deploy

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Metrics is the relay's metric names and types (namespace outbox_relay):
// the names its /metrics exports (relay/metrics.go), which the dashboard and
// the alert rules may query. The deploy tests check every query against this
// list; TestMetricsScrape in cmd/outbox-relay checks the list against a
// running relay's /metrics.
var Metrics = map[string]string{
	"outbox_relay_delivered_total":                   "counter",
	"outbox_relay_failed_total":                      "counter",
	"outbox_relay_retried_total":                     "counter",
	"outbox_relay_held_total":                        "counter",
	"outbox_relay_handed_off_total":                  "counter",
	"outbox_relay_receiver_order_violations_total":   "counter",
	"outbox_relay_sink_paused":                       "gauge",
	"outbox_relay_sink_rate_limit":                   "gauge",
	"outbox_relay_rate_limit_wait_seconds_total":     "counter",
	"outbox_relay_delivery_latency_seconds":          "histogram",
	"outbox_relay_decode_latency_seconds":            "histogram",
	"outbox_relay_walsender_lag_seconds":             "histogram",
	"outbox_relay_rows":                              "gauge",
	"outbox_relay_pending_rows":                      "gauge",
	"outbox_relay_oldest_pending_age_seconds":        "gauge",
	"outbox_relay_stuck_rows":                        "gauge",
	"outbox_relay_slot_retained_wal_bytes":           "gauge",
	"outbox_relay_mode":                              "gauge",
	"outbox_relay_leader":                            "gauge",
	"outbox_relay_nats_duplicates_stored_total":      "counter",
	"outbox_relay_up":                                "gauge",
	"outbox_relay_stalled":                           "gauge",
	"outbox_relay_last_progress_timestamp_seconds":   "gauge",
	"outbox_relay_decoding_on_standby":               "gauge",
	"outbox_relay_standby_replay_lag_seconds":        "gauge",
	"outbox_relay_verify_gaps":                       "gauge",
	"outbox_relay_verify_last_run_timestamp_seconds": "gauge",
}

// KnownSeries reports whether name is a series the relay exports: a listed
// name, or a histogram's _bucket, _sum or _count series.
func KnownSeries(name string) bool {
	if _, ok := Metrics[name]; ok {
		return Metrics[name] != "histogram" // a histogram is queried by its series
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && Metrics[base] == "histogram" {
			return true
		}
	}
	return false
}

// BaseMetric maps a series name to its name in Metrics (a histogram's
// _bucket, _sum and _count series to the histogram).
func BaseMetric(series string) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(series, suffix); ok && Metrics[base] == "histogram" {
			return base
		}
	}
	return series
}

// --- PromQL metric names --------------------------------------------------

var (
	promQLStrings  = regexp.MustCompile("\"(?:[^\"\\\\]|\\\\.)*\"|'(?:[^'\\\\]|\\\\.)*'|`[^`]*`")
	promQLMatchers = regexp.MustCompile(`\{[^{}]*\}`)
	promQLRanges   = regexp.MustCompile(`\[[^\[\]]*\]`)
	promQLGrouping = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)`)
	grafanaVars    = regexp.MustCompile(`\$\{?\w+\}?`)
)

// promQLFunctions are the functions and aggregations the files may call; an
// unknown one is reported, so a typo cannot hide a metric name.
var promQLFunctions = map[string]bool{
	"abs": true, "absent": true, "absent_over_time": true, "avg": true, "avg_over_time": true,
	"ceil": true, "changes": true, "clamp_max": true, "clamp_min": true, "count": true,
	"count_over_time": true, "delta": true, "deriv": true, "floor": true, "group": true,
	"histogram_quantile": true, "increase": true, "irate": true, "label_replace": true,
	"last_over_time": true, "max": true, "max_over_time": true, "min": true, "min_over_time": true,
	"present_over_time": true, "quantile": true, "rate": true, "resets": true, "round": true,
	"scalar": true, "sort": true, "sort_desc": true, "stddev": true, "sum": true,
	"sum_over_time": true, "time": true, "timestamp": true, "topk": true, "bottomk": true, "vector": true,
}

var promQLKeywords = map[string]bool{
	"and": true, "or": true, "unless": true, "bool": true, "offset": true, "inf": true, "nan": true,
}

// MetricNames returns the metric names expr selects. Label matchers,
// ranges, grouping clauses, strings and Grafana variables are removed first;
// what is left is functions (an identifier followed by "("), keywords,
// numbers and metric names. Unknown functions are errors.
func MetricNames(expr string) ([]string, error) {
	s := promQLStrings.ReplaceAllString(expr, `""`)
	s = grafanaVars.ReplaceAllString(s, "")
	s = promQLMatchers.ReplaceAllString(s, " ")
	s = promQLRanges.ReplaceAllString(s, " ")
	s = promQLGrouping.ReplaceAllString(s, " ")
	var names []string
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c >= '0' && c <= '9' || c == '.':
			for i < len(s) && (isIdent(s[i]) || s[i] == '.') {
				i++
			}
		case isIdentStart(c):
			j := i
			for j < len(s) && isIdent(s[j]) {
				j++
			}
			word := s[i:j]
			k := j
			for k < len(s) && (s[k] == ' ' || s[k] == '\t' || s[k] == '\n') {
				k++
			}
			switch {
			case k < len(s) && s[k] == '(':
				if !promQLFunctions[word] {
					return nil, fmt.Errorf("unknown function %q in %q", word, expr)
				}
			case promQLKeywords[strings.ToLower(word)]:
			default:
				names = append(names, word)
			}
			i = j
		default:
			i++
		}
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("%q selects no metric", expr)
	}
	return names, nil
}

func isIdentStart(c byte) bool {
	return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

func isIdent(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }

// The shipped files whose queries name metrics.
var (
	//go:embed prometheus/alerts.yml
	alertRules []byte
	//go:embed grafana/outbox-relay.json
	dashboard []byte
)

// Query is one PromQL expression a shipped file runs.
type Query struct {
	Where string // file and alert, panel or variable
	Expr  string
}

var labelValues = regexp.MustCompile(`^label_values\((\w+)`)

// Queries returns every expression of the alert rules
// (deploy/prometheus/alerts.yml) and the dashboard
// (deploy/grafana/outbox-relay.json: panel targets, and the metric of each
// label_values variable).
func Queries() ([]Query, error) {
	var rules struct {
		Groups []struct {
			Rules []struct{ Alert, Record, Expr string }
		}
	}
	if err := yaml.Unmarshal(alertRules, &rules); err != nil {
		return nil, fmt.Errorf("deploy/prometheus/alerts.yml: %w", err)
	}
	var qs []Query
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			qs = append(qs, Query{Where: "deploy/prometheus/alerts.yml " + r.Alert + r.Record, Expr: r.Expr})
		}
	}

	type panel struct {
		Title   string
		Targets []struct{ Expr string }
		Panels  []json.RawMessage
	}
	var dash struct {
		Panels     []json.RawMessage
		Templating struct {
			List []struct {
				Name, Type string
				Query      json.RawMessage
			}
		}
	}
	const file = "deploy/grafana/outbox-relay.json"
	if err := json.Unmarshal(dashboard, &dash); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	var walk func([]json.RawMessage) error
	walk = func(raw []json.RawMessage) error {
		for _, r := range raw {
			var p panel
			if err := json.Unmarshal(r, &p); err != nil {
				return fmt.Errorf("%s: %w", file, err)
			}
			for _, t := range p.Targets {
				qs = append(qs, Query{Where: fmt.Sprintf("%s panel %q", file, p.Title), Expr: t.Expr})
			}
			if err := walk(p.Panels); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(dash.Panels); err != nil {
		return nil, err
	}
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		// The query is a string or {"query": "..."}.
		var q string
		if json.Unmarshal(v.Query, &q) != nil {
			var obj struct{ Query string }
			json.Unmarshal(v.Query, &obj)
			q = obj.Query
		}
		m := labelValues.FindStringSubmatch(q)
		if m == nil {
			return nil, fmt.Errorf("%s: variable %s: query %q is not label_values(metric, label)", file, v.Name, q)
		}
		qs = append(qs, Query{Where: fmt.Sprintf("%s variable %s", file, v.Name), Expr: m[1]})
	}
	return qs, nil
}
