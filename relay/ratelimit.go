package relay

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"golang.org/x/time/rate"
)

// A sink's rate limit (docs/sinks.md, "Rate limits") is a token bucket
// (golang.org/x/time/rate) each event sent takes one token of — a run or
// a batch of n events takes n. The lane's dispatcher, which both paths'
// pairs go through, sends a pair when its token comes, as long as the pair
// has then been in the lane at most lane_block_max; a pair that would wait
// longer — behind the pairs queued before it, or for its token — goes to
// the claim path without an attempt, due when its token would have come,
// so the limit never holds the slot. The limiter
// belongs to the Route, not the lane, so every engine term of the process
// shares it.

var (
	sinkRateLimit = promauto.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "sink_rate_limit",
		Help: "The sink's rate limit in events per second (sinks[].rate_limit.per_second); 0 without a limit.",
	}, []string{"sink"})
	rateLimitWait = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "rate_limit_wait_seconds_total",
		Help: "Seconds the sink's lane waited on its rate limit before sending.",
	}, []string{"sink"})
)

// NewRateLimit returns the limiter of a sink limited to perSecond events a
// second with bursts of burst, for Route.RateLimit.
func NewRateLimit(perSecond float64, burst int) *rate.Limiter {
	return rate.NewLimiter(rate.Limit(perSecond), burst)
}

// admit takes t's token from the sink's rate limit, waiting for it as long
// as t has then been in the lane at most LaneBlockMax (no wait while
// draining). When the token is further off, or the wait is cut short, it
// completes t — deferred to when the token would have come, without an
// attempt — and reports false.
func (l *lane) admit(ctx context.Context, t *task) bool {
	lim := l.route.RateLimit
	if lim == nil {
		return true
	}
	now := time.Now()
	r := lim.ReserveN(now, 1)
	delay := r.DelayFrom(now)
	if delay == 0 {
		return true
	}
	if now.Add(delay).Sub(t.since) > l.e.cfg.Policy.LaneBlockMax || l.e.draining.Load() {
		r.CancelAt(now)
		l.complete(t, l.notSent(t, Outcome{Kind: Deferred, Reason: "over the sink's rate limit", Until: now.Add(delay), Why: "rate_limited"}), true)
		return false
	}
	if !l.waitLimit(ctx, delay) {
		r.Cancel()
		l.complete(t, l.notSent(t, Outcome{Kind: Deferred, Reason: "not sent: its source stopped", Until: time.Now(), Why: "stopping"}), true)
		return false
	}
	return true
}

// admitMore takes n more tokens for the rest of a run, waiting as long as
// they take: the run's first event was admitted, and a run is never split.
// The wait is bounded by n at the limit's rate.
func (l *lane) admitMore(ctx context.Context, n int) {
	lim := l.route.RateLimit
	if lim == nil || n <= 0 {
		return
	}
	for n > 0 {
		take := min(n, max(lim.Burst(), 1))
		n -= take
		r := lim.ReserveN(time.Now(), take)
		if !r.OK() || !l.waitLimit(ctx, r.Delay()) {
			return
		}
	}
}

// waitLimit waits d, counting it as time spent on the rate limit; it
// reports false when ctx ends first.
func (l *lane) waitLimit(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return true
	}
	start := time.Now()
	timer := time.NewTimer(d)
	defer timer.Stop()
	defer func() { rateLimitWait.WithLabelValues(l.name).Add(time.Since(start).Seconds()) }()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// notSent is o for a pair not sent, keeping the attempts this pass counted.
func (l *lane) notSent(t *task, o Outcome) Outcome {
	if t.counted > 0 {
		return Outcome{Kind: Retry, Reason: t.last + "; then " + o.Reason, Until: o.Until, Counted: t.counted, Unknown: t.p.Outcome.Unknown}
	}
	return o
}
