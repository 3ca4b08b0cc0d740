package console

import (
	"math"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// The flow over the last minutes comes from the relay's own metrics, read
// in memory (the Prometheus registry), never from the database: a sample
// every sampleEvery, kept for sampleKeep.
const (
	sampleEvery = 5 * time.Second
	sampleKeep  = time.Hour
	// chartSpan is how much of it the status shows as a chart.
	chartSpan = 15 * time.Minute
	// rateWindow is the window of the current rate and latency.
	rateWindow = time.Minute
)

// sinkCounts are one sink's counters at a sample, both paths summed.
type sinkCounts struct {
	delivered, failed, retried, held, diverted float64
	// rateLimit is the sink's rate limit (0: none), limitWait the seconds
	// its lane waited on it.
	rateLimit, limitWait float64
	latency              histogram
}

// histogram is a cumulative histogram: counts[i] observations at most
// bounds[i].
type histogram struct {
	bounds []float64
	counts []uint64
	count  uint64
	sum    float64
}

// add adds h2 (the same buckets) to h.
func (h *histogram) add(bounds []float64, counts []uint64, count uint64, sum float64) {
	if h.bounds == nil {
		h.bounds, h.counts = bounds, make([]uint64, len(counts))
	}
	if len(counts) != len(h.counts) {
		return
	}
	for i, c := range counts {
		h.counts[i] += c
	}
	h.count += count
	h.sum += sum
}

// quantile estimates the q-quantile of the observations between earlier
// and h (interpolating within a bucket, as histogram_quantile does); ok
// is false when there were none.
func (h histogram) quantile(q float64, earlier histogram) (float64, bool) {
	n := h.count - min(earlier.count, h.count)
	if n == 0 || len(h.counts) == 0 {
		return 0, false
	}
	rank := q * float64(n)
	lower, below := 0.0, uint64(0)
	for i, c := range h.counts {
		if len(earlier.counts) == len(h.counts) {
			c -= min(earlier.counts[i], c)
		}
		if float64(c) >= rank {
			inBucket := c - below
			if inBucket == 0 {
				return h.bounds[i], true
			}
			return lower + (h.bounds[i]-lower)*(rank-float64(below))/float64(inBucket), true
		}
		lower, below = h.bounds[i], c
	}
	// Beyond the last bound: say the last bound, as histogram_quantile does.
	return h.bounds[len(h.bounds)-1], true
}

// sample is what the registry showed at one moment.
type sample struct {
	at    time.Time
	sinks map[string]sinkCounts
	// The process's gauges.
	leader, stalled  bool
	mode             string // replication, poll, or "" (neither: standing by)
	rows             map[string]float64
	oldestPendingAge float64
	slotRetainedWAL  float64
	rowsRefreshed    bool // the table gauges have been set at least once
}

// gather reads a sample from g.
func gather(g prometheus.Gatherer, now time.Time) (sample, error) {
	s := sample{at: now, sinks: map[string]sinkCounts{}, rows: map[string]float64{}}
	families, err := g.Gather()
	if err != nil && len(families) == 0 {
		return s, err
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			sink := label(m, "sink")
			switch f.GetName() {
			case "outbox_relay_delivered_total":
				c := s.sinks[sink]
				c.delivered += m.GetCounter().GetValue()
				s.sinks[sink] = c
			case "outbox_relay_failed_total":
				c := s.sinks[sink]
				c.failed += m.GetCounter().GetValue()
				s.sinks[sink] = c
			case "outbox_relay_retried_total":
				c := s.sinks[sink]
				c.retried += m.GetCounter().GetValue()
				s.sinks[sink] = c
			case "outbox_relay_held_total":
				c := s.sinks[sink]
				c.held += m.GetCounter().GetValue()
				s.sinks[sink] = c
			case "outbox_relay_handed_off_total":
				c := s.sinks[sink]
				c.diverted += m.GetCounter().GetValue()
				s.sinks[sink] = c
			case "outbox_relay_sink_rate_limit":
				c := s.sinks[sink]
				c.rateLimit = m.GetGauge().GetValue()
				s.sinks[sink] = c
			case "outbox_relay_rate_limit_wait_seconds_total":
				c := s.sinks[sink]
				c.limitWait += m.GetCounter().GetValue()
				s.sinks[sink] = c
			case "outbox_relay_delivery_latency_seconds":
				h := m.GetHistogram()
				bounds := make([]float64, 0, len(h.GetBucket()))
				counts := make([]uint64, 0, len(h.GetBucket()))
				for _, b := range h.GetBucket() {
					bounds = append(bounds, b.GetUpperBound())
					counts = append(counts, b.GetCumulativeCount())
				}
				c := s.sinks[sink]
				c.latency.add(bounds, counts, h.GetSampleCount(), h.GetSampleSum())
				s.sinks[sink] = c
			case "outbox_relay_leader":
				s.leader = m.GetGauge().GetValue() == 1
			case "outbox_relay_stalled":
				s.stalled = m.GetGauge().GetValue() == 1
			case "outbox_relay_mode":
				if m.GetGauge().GetValue() == 1 {
					s.mode = label(m, "mode")
				}
			case "outbox_relay_rows":
				s.rows[label(m, "status")] = m.GetGauge().GetValue()
				s.rowsRefreshed = true
			case "outbox_relay_oldest_pending_age_seconds":
				s.oldestPendingAge = m.GetGauge().GetValue()
			case "outbox_relay_slot_retained_wal_bytes":
				s.slotRetainedWAL = m.GetGauge().GetValue()
			}
		}
	}
	return s, nil
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// series keeps the samples of the last sampleKeep, oldest first.
type series struct {
	mu      sync.Mutex
	samples []sample
}

func (s *series) add(x sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cut := 0
	for cut < len(s.samples) && x.at.Sub(s.samples[cut].at) > sampleKeep {
		cut++
	}
	s.samples = append(s.samples[cut:], x)
}

// since returns the samples taken at or after t, oldest first.
func (s *series) since(t time.Time) []sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, _ := slices.BinarySearchFunc(s.samples, t, func(x sample, t time.Time) int { return x.at.Compare(t) })
	return slices.Clone(s.samples[i:])
}

// before returns the newest sample taken at or before t, and whether there
// is one.
func (s *series) before(t time.Time) (sample, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := len(s.samples) - 1; i >= 0; i-- {
		if !s.samples[i].at.After(t) {
			return s.samples[i], true
		}
	}
	return sample{}, false
}

// oldest returns the oldest sample, and whether there is one.
func (s *series) oldest() (sample, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.samples) == 0 {
		return sample{}, false
	}
	return s.samples[0], true
}

// flow is a sink's flow between two samples.
type flow struct {
	Seconds   float64 `json:"seconds"`
	Delivered float64 `json:"delivered"`
	Failed    float64 `json:"failed"`
	Retried   float64 `json:"retried"`
	Held      float64 `json:"held"`
	Diverted  float64 `json:"handed_off"`
	// RateLimitWaitSeconds is the time the sink's lane waited on its rate
	// limit.
	RateLimitWaitSeconds float64  `json:"rate_limit_wait_seconds"`
	RatePerSecond        float64  `json:"rate_per_second"`
	LatencyP50Second     *float64 `json:"latency_p50_seconds"`
	LatencyP99Second     *float64 `json:"latency_p99_seconds"`
}

// flowBetween is sink's flow from a to b.
func flowBetween(a, b sample, sink string) flow {
	x, y := a.sinks[sink], b.sinks[sink]
	f := flow{
		Seconds:   b.at.Sub(a.at).Seconds(),
		Delivered: nonNegative(y.delivered - x.delivered),
		Failed:    nonNegative(y.failed - x.failed),
		Retried:   nonNegative(y.retried - x.retried),
		Held:      nonNegative(y.held - x.held),
		Diverted:  nonNegative(y.diverted - x.diverted),

		RateLimitWaitSeconds: nonNegative(y.limitWait - x.limitWait),
	}
	if f.Seconds > 0 {
		f.RatePerSecond = f.Delivered / f.Seconds
	}
	if q, ok := y.latency.quantile(0.5, x.latency); ok {
		f.LatencyP50Second = &q
	}
	if q, ok := y.latency.quantile(0.99, x.latency); ok {
		f.LatencyP99Second = &q
	}
	return f
}

func nonNegative(v float64) float64 {
	if v < 0 || math.IsNaN(v) {
		return 0
	}
	return v
}
