package console

import (
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// testMetrics are the relay's metrics the flow is read from, in a registry
// of their own.
type testMetrics struct {
	reg                        *prometheus.Registry
	delivered, failed, retried *prometheus.CounterVec
	latency                    *prometheus.HistogramVec
	rows                       *prometheus.GaugeVec
	mode                       *prometheus.GaugeVec
	leader                     prometheus.Gauge
}

func newTestMetrics() *testMetrics {
	m := &testMetrics{reg: prometheus.NewRegistry()}
	counter := func(name string) *prometheus.CounterVec {
		c := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "outbox_relay", Name: name}, []string{"sink", "path"})
		m.reg.MustRegister(c)
		return c
	}
	m.delivered, m.failed, m.retried = counter("delivered_total"), counter("failed_total"), counter("retried_total")
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "outbox_relay", Name: "delivery_latency_seconds",
		Buckets: []float64{.001, .002, .005, .01, .1, 1}}, []string{"sink", "path"})
	m.rows = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "outbox_relay", Name: "rows"}, []string{"status"})
	m.mode = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "outbox_relay", Name: "mode"}, []string{"mode"})
	m.leader = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "outbox_relay", Name: "leader"})
	m.reg.MustRegister(m.latency, m.rows, m.mode, m.leader)
	return m
}

func mustGather(t *testing.T, m *testMetrics, at time.Time) sample {
	t.Helper()
	s, err := gather(m.reg, at)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestFlow_RatesAndLatencyFromTheMetrics: a sink's rate and latency
// percentiles over a window are the differences of its counters and
// histogram buckets, both paths summed, interpolated within a bucket as
// histogram_quantile does.
func TestFlow_RatesAndLatencyFromTheMetrics(t *testing.T) {
	m := newTestMetrics()
	t0 := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	// Before the window: 100 slow deliveries, which must not count.
	for range 100 {
		m.delivered.WithLabelValues("hook", "stream").Inc()
		m.latency.WithLabelValues("hook", "stream").Observe(0.5)
	}
	a := mustGather(t, m, t0)
	// In the window: 90 fast on the stream, 10 slower on the claim path.
	for range 90 {
		m.delivered.WithLabelValues("hook", "stream").Inc()
		m.latency.WithLabelValues("hook", "stream").Observe(0.0015)
	}
	for range 10 {
		m.delivered.WithLabelValues("hook", "claim").Inc()
		m.latency.WithLabelValues("hook", "claim").Observe(0.008)
	}
	m.failed.WithLabelValues("hook", "claim").Add(2)
	m.retried.WithLabelValues("hook", "stream").Add(5)
	b := mustGather(t, m, t0.Add(10*time.Second))

	f := flowBetween(a, b, "hook")
	if f.Delivered != 100 || f.RatePerSecond != 10 || f.Failed != 2 || f.Retried != 5 || f.Seconds != 10 {
		t.Errorf("flow: %+v", f)
	}
	// p50: rank 50 among 90 in (0.001, 0.002]: 0.001 + 0.001 × 50/90.
	if f.LatencyP50Second == nil || math.Abs(*f.LatencyP50Second-(0.001+0.001*50/90)) > 1e-9 {
		t.Errorf("p50 = %v", deref(f.LatencyP50Second))
	}
	// p99: rank 99 among the 10 in (0.005, 0.01]: 0.005 + 0.005 × 9/10.
	if f.LatencyP99Second == nil || math.Abs(*f.LatencyP99Second-0.0095) > 1e-9 {
		t.Errorf("p99 = %v", deref(f.LatencyP99Second))
	}
	// No deliveries: no latency, and a sink never seen is all zeros.
	if f := flowBetween(b, b, "hook"); f.LatencyP99Second != nil || f.Delivered != 0 {
		t.Errorf("an empty window: %+v", f)
	}
	if f := flowBetween(a, b, "nats"); f.Delivered != 0 || f.LatencyP50Second != nil {
		t.Errorf("an unknown sink: %+v", f)
	}
}

// TestSeries_KeepsTheLastHour: samples older than an hour go.
func TestSeries_KeepsTheLastHour(t *testing.T) {
	var s series
	t0 := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	for i := range 800 {
		s.add(sample{at: t0.Add(time.Duration(i) * sampleEvery)})
	}
	last := t0.Add(799 * sampleEvery)
	oldest, _ := s.oldest()
	if got := last.Sub(oldest.at); got != sampleKeep {
		t.Errorf("oldest sample %s before the last, want %s", got, sampleKeep)
	}
	if got := len(s.since(last.Add(-time.Minute))); got != 13 {
		t.Errorf("%d samples in the last minute, want 13", got)
	}
	if x, ok := s.before(last.Add(-time.Minute - time.Second)); !ok || !x.at.Equal(last.Add(-time.Minute-sampleEvery)) {
		t.Errorf("sample before a minute ago: %v %v", x.at, ok)
	}
}

// TestStatus_State: the overview's state says whether events flow.
func TestStatus_State(t *testing.T) {
	m := newTestMetrics()
	s := New(Config{AdminToken: "x", Gatherer: m.reg})
	b := &Backend{Tables: admin.Tables{Sinks: []admin.Sink{{Name: "hook"}}}}
	t0 := time.Now()
	state := func(at time.Time, st *admin.Status) string {
		t.Helper()
		if st == nil {
			st = &admin.Status{Rows: map[string]int64{}, DeliveredLastHour: map[string]int64{}}
		}
		return s.status(st, b, mustGather(t, m, at), accessAdmin).State
	}
	if got := state(t0, nil); got != "starting" {
		t.Errorf("no mode: %s", got)
	}
	if got := state(t0, &admin.Status{Rows: map[string]int64{}, DeliveredLastHour: map[string]int64{}, Leader: &admin.Leader{By: "lock"}}); got != "standby" {
		t.Errorf("another relay leads: %s", got)
	}
	m.mode.WithLabelValues("replication").Set(1)
	if got := state(t0, nil); got != "idle" {
		t.Errorf("nothing pending: %s", got)
	}
	m.rows.WithLabelValues("pending").Set(5)
	if got := state(t0, nil); got != "waiting" {
		t.Errorf("rows pending, nothing delivered: %s", got)
	}
	s.series.add(mustGather(t, m, t0))
	m.delivered.WithLabelValues("hook", "stream").Inc()
	if got := state(t0.Add(sampleEvery), nil); got != "flowing" {
		t.Errorf("a delivery in the last 30 s: %s", got)
	}
	b.Health = func() Health { return Health{Stalled: "no progress for 5m"} }
	resp := s.status(&admin.Status{Rows: map[string]int64{}, DeliveredLastHour: map[string]int64{}}, b, mustGather(t, m, t0.Add(sampleEvery)), accessAdmin)
	if resp.State != "stalled" || len(resp.Errors) == 0 || resp.Errors[0] != "stalled: no progress for 5m" {
		t.Errorf("stalled: %s %v", resp.State, resp.Errors)
	}
}

func deref(p *float64) any {
	if p == nil {
		return nil
	}
	return *p
}
