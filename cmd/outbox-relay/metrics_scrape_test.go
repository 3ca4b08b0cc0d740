package main

import (
	"fmt"
	"math"
	"net/http"
	"os"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/outbox-relay/outbox-relay/deploy"
	"github.com/outbox-relay/outbox-relay/migrations/pgtest"
)

// scrapeFamilies GETs addr's /metrics and parses it.
func scrapeFamilies(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return fams
}

// labelValues returns the sorted values label takes in a family's series.
func labelValues(f *dto.MetricFamily, label string) []string {
	seen := map[string]bool{}
	for _, m := range f.GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == label {
				seen[lp.GetValue()] = true
			}
		}
	}
	var out []string
	for v := range seen {
		out = append(out, v)
	}
	sort.Strings(out)
	return out
}

// sample returns the value of the series of f whose labels are exactly
// labels ("k=v" pairs), and whether there is one.
func sample(f *dto.MetricFamily, labels ...string) (float64, bool) {
	for _, m := range f.GetMetric() {
		var got []string
		for _, lp := range m.GetLabel() {
			got = append(got, lp.GetName()+"="+lp.GetValue())
		}
		if !slices.Equal(got, labels) { // the exposition sorts labels by name
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		}
	}
	return 0, false
}

// startServingMetrics starts a relay process on a database of its own,
// serving its metrics on the address it returns, and waits for its slot; a
// failed test gets the relay's log.
func startServingMetrics(t *testing.T) (*setup, string) {
	s, addr, _ := startServingMetricsProcess(t)
	return s, addr
}

// startServingMetricsProcess is startServingMetrics, with the relay's
// process id.
func startServingMetricsProcess(t *testing.T) (*setup, string, int) {
	t.Helper()
	s := newSetup(t, pgtest.NewDatabase(t))
	addr := freeAddr(t)
	cfgPath := s.configFileWith(t, "", fmt.Sprintf("http: {listen: %q}\n", addr))
	cfg, _ := readFile(cfgPath)
	writeFile(t, cfgPath, strings.Replace(cfg, `http: {listen: "127.0.0.1:0"}`, "", 1))
	var logs syncBuffer
	proc := s.startProcess(t, cfgPath, &logs)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("relay log:\n%s", logs.String())
		}
	})
	s.waitSlot(t)
	return s, addr, proc.Process.Pid
}

// TestMetricsScrape: every metric the shipped alert rules and dashboard
// query (deploy.Queries: deploy/prometheus/alerts.yml and
// deploy/grafana/outbox-relay.json) is on a running relay's /metrics from
// its start, before any event, with a series per sink (and per path) at 0:
// a panel shows 0 rather than "no data", and the dead-letter alert's
// increase() sees the first dead letter as a rise from 0. The relay's
// outbox_relay_* families are exactly deploy.Metrics, names and types, the
// list the deploy tests hold the files to. The relay is the built binary, a
// process of its own, so no other test's observations fill its registry; it
// has a webhook sink ("hook") and a NATS sink ("nats"). After one event,
// the same series count it at both sinks.
func TestMetricsScrape(t *testing.T) {
	s, addr := startServingMetrics(t)

	var fams map[string]*dto.MetricFamily
	eventually(t, 20*time.Second, "the relay streaming (mode replication 1) with its table gauges published", func() bool {
		fams = scrapeFamilies(t, addr)
		mode, _ := sample(fams["outbox_relay_mode"], "mode=replication")
		return mode == 1 && fams["outbox_relay_rows"] != nil
	})

	// The families are deploy.Metrics.
	for name, f := range fams {
		if !strings.HasPrefix(name, "outbox_relay_") {
			continue
		}
		want, ok := deploy.Metrics[name]
		if !ok {
			t.Errorf("/metrics has %s (%s), which deploy.Metrics (deploy/metrics.go) does not list", name, f.GetType())
		} else if got := strings.ToLower(f.GetType().String()); got != want {
			t.Errorf("/metrics has %s as a %s, deploy.Metrics says %s", name, got, want)
		}
	}

	// Every queried metric is there, with its per-sink series.
	queries, err := deploy.Queries()
	if err != nil {
		t.Fatal(err)
	}
	missing := map[string][]string{}
	for _, q := range queries {
		names, err := deploy.MetricNames(q.Expr)
		if err != nil {
			t.Errorf("%s: %v", q.Where, err)
			continue
		}
		for _, n := range names {
			base := deploy.BaseMetric(n)
			if f := fams[base]; f == nil || len(f.GetMetric()) == 0 {
				missing[base] = append(missing[base], q.Where)
			}
		}
	}
	for name, where := range missing {
		t.Errorf("%s is not on /metrics at start; queried by %s", name, strings.Join(where, ", "))
	}
	sinks := []string{"hook", "nats"}
	perSink := map[string][]string{ // family: the sinks it must have series for
		"outbox_relay_delivered_total":              sinks,
		"outbox_relay_failed_total":                 sinks,
		"outbox_relay_retried_total":                sinks,
		"outbox_relay_held_total":                   sinks,
		"outbox_relay_handed_off_total":             sinks,
		"outbox_relay_delivery_latency_seconds":     sinks,
		"outbox_relay_nats_duplicates_stored_total": {"nats"},
	}
	for name, want := range perSink {
		f := fams[name]
		if f == nil {
			continue // reported above
		}
		if got := labelValues(f, "sink"); !slices.Equal(got, want) {
			t.Errorf("%s has series for sinks %v at start, want %v", name, got, want)
		}
		if paths := labelValues(f, "path"); len(f.GetMetric()) > 0 && slices.ContainsFunc(f.GetMetric()[0].GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == "path" }) &&
			!slices.Equal(paths, []string{"claim", "stream"}) {
			t.Errorf("%s has series for paths %v at start, want [claim stream]", name, paths)
		}
		for _, m := range f.GetMetric() {
			if v := m.GetCounter().GetValue() + float64(m.GetHistogram().GetSampleCount()); v != 0 {
				t.Errorf("%s %v = %v before any event, want 0", name, m.GetLabel(), v)
			}
		}
	}
	if modes := labelValues(fams["outbox_relay_mode"], "mode"); !slices.Equal(modes, []string{"poll", "replication"}) {
		t.Errorf("outbox_relay_mode has modes %v, want [poll replication]", modes)
	}
	if v, ok := sample(fams["outbox_relay_leader"]); !ok || v != 1 {
		t.Errorf("outbox_relay_leader = %v (%v), want 1", v, ok)
	}

	// One event: the pre-created series are the ones that count it.
	if _, err := s.pool.Exec(t.Context(), `SELECT outbox_publish('order.placed', 'order', 'o1', 'scrape-1', '{}')`); err != nil {
		t.Fatal(err)
	}
	s.waitAllDelivered(t, 30*time.Second, map[string]bool{"scrape-1": true})
	eventually(t, 10*time.Second, "delivered_total and the latency histogram at 1 for both sinks", func() bool {
		fams = scrapeFamilies(t, addr)
		for _, sink := range sinks {
			d, _ := sample(fams["outbox_relay_delivered_total"], "path=stream", "sink="+sink)
			l, _ := sample(fams["outbox_relay_delivery_latency_seconds"], "path=stream", "sink="+sink)
			if d != 1 || l != 1 {
				return false
			}
		}
		return true
	})
	if got := labelValues(fams["outbox_relay_delivered_total"], "sink"); !slices.Equal(got, sinks) {
		t.Errorf("outbox_relay_delivered_total sinks %v after an event, want %v", got, sinks)
	}
}

// TestRunLeavesTheRuntimeAlone: run starts once, with the Go runtime's and
// the kernel's defaults (docs/deploy.md, "Runtime settings"): no setting
// added to its environment, GOMAXPROCS as the runtime sets it, the
// garbage collector at GOGC=100 without a memory limit — and these stay so
// while it delivers and after it has been quiet.
func TestRunLeavesTheRuntimeAlone(t *testing.T) {
	s, addr, pid := startServingMetricsProcess(t)
	environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err != nil {
		t.Fatal(err)
	}
	for kv := range strings.SplitSeq(string(environ), "\x00") {
		if strings.HasPrefix(kv, "GODEBUG=") || strings.HasPrefix(kv, "GOGC=") || strings.HasPrefix(kv, "GOMEMLIMIT=") || strings.HasPrefix(kv, "GOMAXPROCS=") {
			t.Errorf("the running relay's environment holds %s; want the runtime's defaults", kv)
		}
	}
	check := func(when string) {
		fams := scrapeFamilies(t, addr)
		want := map[string]float64{
			"go_sched_gomaxprocs_threads": float64(runtime.GOMAXPROCS(0)),
			"go_gc_gogc_percent":          100,
			"go_gc_gomemlimit_bytes":      math.MaxInt64,
		}
		for name, w := range want {
			got, ok := sample(fams[name])
			if !ok {
				t.Fatalf("%s: %s not exported", when, name)
			}
			if got != w {
				t.Errorf("%s: %s = %v, want %v (the runtime's default)", when, name, got, w)
			}
		}
	}
	check("at start")
	if _, err := s.pool.Exec(t.Context(), `SELECT outbox_publish('order.placed', 'order', 'o1', 'defaults-1', '{}')`); err != nil {
		t.Fatal(err)
	}
	s.waitAllDelivered(t, 30*time.Second, map[string]bool{"defaults-1": true})
	check("after a delivery")
}
