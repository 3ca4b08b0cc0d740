package console

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/ledger/admin"
)

// flowingWithin: a relay that delivered within this long is flowing.
const flowingWithin = 30 * time.Second

// statusResponse is GET /api/v1/status: what `outbox-relay status --json`
// shows of the relays (admin.ReadRelays), with the rows by status from the
// relay's table gauges, and the flow of this process from its metrics.
type statusResponse struct {
	*admin.Status
	At     time.Time `json:"at"`
	Access access    `json:"access"`
	// State is flowing, waiting (rows wait, nothing delivered lately),
	// idle, stalled, standby (another relay leads) or starting; Summary
	// says it in a line.
	State   string     `json:"state"`
	Summary string     `json:"summary"`
	Relay   relayView  `json:"relay"`
	Sinks   []sinkView `json:"sinks"`
	// Errors are what needs a look: the relay's health, dead letters and
	// held events, failures of the last minutes.
	Errors []string  `json:"errors"`
	Chart  chartView `json:"chart"`
	Feed   feedView  `json:"feed"`
}

// relayView is this process as it sees itself.
type relayView struct {
	Health
	Leader bool `json:"leader"`
	// Mode is the mode this process delivers in (replication, poll), ""
	// while it stands by.
	Mode string `json:"mode"`
	// RowsCounted is false until the relay's table gauges have been read
	// once (they refresh every 10 s, without reading the whole table).
	RowsCounted bool `json:"rows_counted"`
	// FlowSince is how far back this process's flow goes.
	FlowSince time.Time `json:"flow_since"`
}

// sinkView is one sink's flow through this process.
type sinkView struct {
	Name   string   `json:"name"`
	Events []string `json:"events"`
	// SinceStart counts its pairs since the process started.
	SinceStart totals `json:"since_start"`
	// LastMinute is its flow over the last minute: rate and latency.
	LastMinute flow `json:"last_minute"`
	// RateLimit is its rate limit in events per second, 0 without one
	// (docs/sinks.md, "Rate limits"); the time its lane waited on it is
	// in since_start and last_minute.
	RateLimit float64 `json:"rate_limit_per_second"`
	// Paused is its pause, while an operator has paused it.
	Paused *admin.Pause `json:"paused,omitempty"`
}

type totals struct {
	Delivered float64 `json:"delivered"`
	Failed    float64 `json:"failed"`
	Retried   float64 `json:"retried"`
	Held      float64 `json:"held"`
	Diverted  float64 `json:"handed_off"`
	// RateLimitWaitSeconds is the time the lane waited on the rate limit.
	RateLimitWaitSeconds float64 `json:"rate_limit_wait_seconds"`
}

// chartView is the flow over the last minutes, one point per sample:
// deliveries per second and the p99 latency (seconds, null without
// deliveries), per sink.
type chartView struct {
	StepSeconds float64               `json:"step_seconds"`
	Times       []int64               `json:"times"` // Unix seconds
	Rate        map[string][]float64  `json:"rate"`
	P99         map[string][]*float64 `json:"p99"`
}

type feedView struct {
	Subscribers int  `json:"subscribers"`
	Payloads    bool `json:"payloads"`
}

func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) error {
	return s.serveCached(w, r, func() (any, error) {
		var (
			st *admin.Status
			b  *Backend
		)
		err := s.withDB(r.Context(), readTimeout, func(ctx context.Context, backend *Backend) (err error) {
			b = backend
			if st, err = admin.ReadRelays(ctx, b.DB, b.Tables, b.Where); err != nil {
				return err
			}
			st.Paused, err = admin.Pauses(ctx, b.DB, b.Tables.Outbox)
			return err
		})
		if err != nil {
			return nil, err
		}
		now, err := gather(s.cfg.Gatherer, time.Now())
		if err != nil {
			return nil, fmt.Errorf("read the relay's metrics: %w", err)
		}
		return s.status(st, b, now, requestAccess(r)), nil
	})
}

// status composes the answer from the relays' status st and the sample
// now, against the samples kept.
func (s *Server) status(st *admin.Status, b *Backend, now sample, a access) statusResponse {
	resp := statusResponse{Status: st, At: now.at, Access: a, Errors: []string{}}
	if b.Health != nil {
		resp.Relay.Health = b.Health()
	}
	resp.Relay.Leader, resp.Relay.Mode, resp.Relay.RowsCounted = now.leader, now.mode, now.rowsRefreshed

	// The rows by status are the relay's table gauges, not a count.
	for _, status := range admin.Statuses {
		st.Rows[status] = int64(now.rows[status])
	}
	st.Held, st.Failed = st.Rows["held"], st.Rows["failed"]
	if now.oldestPendingAge > 0 {
		age := now.oldestPendingAge
		st.OldestPendingSeconds = &age
	}

	oldest, ok := s.series.oldest()
	if !ok || oldest.at.After(now.at) {
		oldest = now
	}
	resp.Relay.FlowSince = oldest.at
	hourAgo, ok := s.series.before(now.at.Add(-time.Hour))
	if !ok {
		hourAgo = oldest
	}
	minuteAgo, ok := s.series.before(now.at.Add(-rateWindow))
	if !ok {
		minuteAgo = oldest
	}
	recent, ok := s.series.before(now.at.Add(-flowingWithin))
	if !ok {
		recent = oldest
	}
	delivering := false
	for _, sink := range b.Tables.Sinks {
		c := now.sinks[sink.Name]
		v := sinkView{Name: sink.Name, Events: sink.Events,
			SinceStart: totals{Delivered: c.delivered, Failed: c.failed, Retried: c.retried, Held: c.held, Diverted: c.diverted, RateLimitWaitSeconds: c.limitWait},
			LastMinute: flowBetween(minuteAgo, now, sink.Name), RateLimit: c.rateLimit}
		if v.Events == nil {
			v.Events = []string{"*"}
		}
		for _, p := range st.Paused {
			if p.Sink == sink.Name {
				v.Paused = &p
				resp.Errors = append(resp.Errors, fmt.Sprintf("sink %s is paused: its events wait with the claim path until it is resumed", sink.Name))
			}
		}
		resp.Sinks = append(resp.Sinks, v)
		st.DeliveredLastHour[sink.Name] = int64(flowBetween(hourAgo, now, sink.Name).Delivered)
		if flowBetween(recent, now, sink.Name).Delivered > 0 {
			delivering = true
		}
		if f := v.LastMinute; f.Failed+f.Retried+f.Held+f.Diverted > 0 {
			resp.Errors = append(resp.Errors, fmt.Sprintf("sink %s, last minute: %s", sink.Name, describeTrouble(f)))
		}
	}
	h := resp.Relay.Health
	var first []string
	if h.Stalled != "" {
		first = append(first, "stalled: "+h.Stalled)
	}
	if h.NotReady != "" {
		first = append(first, "not ready: "+h.NotReady)
	}
	first = append(first, h.SinksDown...)
	resp.Errors = append(first, resp.Errors...)
	if resp.Errors == nil {
		resp.Errors = []string{}
	}
	if st.Failed+st.Held > 0 {
		resp.Errors = append(resp.Errors, fmt.Sprintf("%d dead letters (failed) and %d held events wait for a decision: see Dead letters", st.Failed, st.Held))
	}
	if st.Slot.InvalidationReason != "" || st.Slot.WALStatus == "lost" {
		resp.Errors = append(resp.Errors, fmt.Sprintf("slot %s is invalidated (%s): the relay makes it again, the claim path delivers meanwhile", st.Slot.Name, strings.TrimSpace(st.Slot.WALStatus+" "+st.Slot.InvalidationReason)))
	}

	pending := st.Rows["pending"] + st.Rows["processing"]
	switch {
	case h.Stalled != "":
		resp.State, resp.Summary = "stalled", "stalled: "+h.Stalled
	case delivering:
		resp.State, resp.Summary = "flowing", fmt.Sprintf("flowing: delivering in %s mode", orWord(now.mode, "this"))
	case now.mode == "" && st.Leader != nil:
		resp.State, resp.Summary = "standby", fmt.Sprintf("standing by: the leader is pid %d (%s); its console shows the flow", st.Leader.PID, st.Leader.ApplicationName)
	case now.mode == "":
		resp.State, resp.Summary = "starting", "starting: not delivering yet"
	case pending > 0:
		resp.State, resp.Summary = "waiting", fmt.Sprintf("not flowing: %d rows pending, nothing delivered in the last %s", pending, flowingWithin)
	default:
		resp.State, resp.Summary = "idle", "idle: nothing to deliver"
	}

	resp.Chart = s.chart(now, b)
	if s.cfg.Feed != nil {
		resp.Feed = feedView{Subscribers: s.cfg.Feed.Subscribers(), Payloads: s.cfg.Feed.Payloads()}
	}
	return resp
}

// chart returns the flow between the samples of the last chartSpan, and
// up to now.
func (s *Server) chart(now sample, b *Backend) chartView {
	samples := append(s.series.since(now.at.Add(-chartSpan)), now)
	c := chartView{StepSeconds: sampleEvery.Seconds(), Rate: map[string][]float64{}, P99: map[string][]*float64{}}
	for i := 1; i < len(samples); i++ {
		if samples[i].at.Sub(samples[i-1].at) < time.Second {
			continue // now, just after a sample
		}
		c.Times = append(c.Times, samples[i].at.Unix())
		for _, sink := range b.Tables.Sinks {
			f := flowBetween(samples[i-1], samples[i], sink.Name)
			c.Rate[sink.Name] = append(c.Rate[sink.Name], f.RatePerSecond)
			c.P99[sink.Name] = append(c.P99[sink.Name], f.LatencyP99Second)
		}
	}
	if c.Times == nil {
		c.Times = []int64{}
	}
	return c
}

// describeTrouble says what went wrong in f.
func describeTrouble(f flow) string {
	var parts []string
	for _, p := range []struct {
		n    float64
		what string
	}{{f.Failed, "dead-lettered"}, {f.Held, "held"}, {f.Retried, "retried"}, {f.Diverted, "diverted to the claim path"}} {
		if p.n > 0 {
			parts = append(parts, fmt.Sprintf("%.0f %s", p.n, p.what))
		}
	}
	return strings.Join(parts, ", ")
}

func orWord(s, word string) string {
	if s == "" {
		return word
	}
	return s
}
