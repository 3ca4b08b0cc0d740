package relay

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// Metrics, namespace outbox_relay. The names are part of the interface:
// deploy/grafana and deploy/prometheus use them.
var (
	deliveredTotal = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "delivered_total",
		Help: "Events delivered, per sink and path (stream or claim).",
	}, []string{"sink", "path"})
	failedTotal = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "failed_total",
		Help: "Events dead-lettered (status failed), per sink and path.",
	}, []string{"sink", "path"})
	retriedTotal = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "retried_total",
		Help: "Failed attempts that will be retried, per sink and path.",
	}, []string{"sink", "path"})
	heldTotal = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "held_total",
		Help: "Events held for a person after an unknown outcome, per sink and path.",
	}, []string{"sink", "path"})
	divertedTotal = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "handed_off_total",
		Help: "Events the stream diverted to the claim path, per sink and reason.",
	}, []string{"sink", "reason"})
	deliveryLatency = promauto.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "outbox_relay", Name: "delivery_latency_seconds",
		Help:    "Time from the event's commit (stream) or creation (claim path) to the sink's acknowledgement.",
		Buckets: []float64{.0005, .001, .002, .003, .005, .0075, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
	}, []string{"sink", "path"})
	receiverOrderViolations = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "receiver_order_violations_total",
		Help: "Events a receiver with batch.ordered answered ok after an earlier event of their aggregate in the same request that it answered retry or fail: it broke the ordered-batch contract. They are recorded delivered, as answered.",
	}, []string{"sink"})
	decodeLatency = promauto.NewHistogram(prometheus.HistogramOpts{
		Namespace: "outbox_relay", Name: "decode_latency_seconds",
		Help:    "Time from the event's commit to its arrival in the engine, decoded (stream path): what the walsender and the decoder add before any sink. Each event counts once per process: events the slot sends again (a reconnect, a PostgreSQL restart) are not counted again.",
		Buckets: []float64{.0005, .001, .002, .003, .005, .0075, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
	})

	// WalSenderLag is, per transaction streamed, the time from its commit to
	// the walsender sending its Commit message (both PostgreSQL's clocks):
	// what the server adds, apart from what the relay adds after it.
	WalSenderLag = promauto.NewHistogram(prometheus.HistogramOpts{
		Namespace: "outbox_relay", Name: "walsender_lag_seconds",
		Help:    "Time from a streamed transaction's commit to the walsender sending its Commit message (PostgreSQL's timestamps): the server's share of decode_latency_seconds.",
		Buckets: []float64{.0005, .001, .002, .003, .005, .0075, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
	})

	// ModeGauge is 1 for the current source mode (replication, poll).
	ModeGauge = promauto.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "mode",
		Help: "1 for the current source mode (replication or poll), 0 otherwise.",
	}, []string{"mode"})
	// LeaderGauge is 1 while this instance is the leader for its slot.
	LeaderGauge = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "leader",
		Help: "1 while this instance holds the leader lock for its slot.",
	})
	// RowsGauge, PendingRows, OldestPendingAge, StuckRows and
	// SlotRetainedWAL are refreshed from the database on an interval, not
	// per scrape.
	RowsGauge = promauto.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "rows",
		Help: "Outbox rows by status.",
	}, []string{"status"})
	PendingRows = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "pending_rows",
		Help: "Rows pending or processing.",
	})
	OldestPendingAge = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "oldest_pending_age_seconds",
		Help: "Age of the oldest pending row.",
	})
	StuckRows = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "stuck_rows",
		Help: "Rows the stream owns that have been pending longer than sweep_after.",
	})
	SlotRetainedWAL = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "slot_retained_wal_bytes",
		Help: "WAL the replication slot retains (pg_current_wal_lsn - restart_lsn).",
	})
	// NATSDuplicatesStored counts, per NATS sink, retries JetStream stored
	// as new messages though their event is older than the duplicate
	// window: each may be a second copy (sink/nats counts them).
	NATSDuplicatesStored = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "nats_duplicates_stored_total",
		Help: "Retries JetStream stored as new messages though their event is older than the duplicate window: each may be a second copy; consumers deduplicate on Outbox-Event-Key.",
	}, []string{"sink"})
	settleWaitingRows = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "settle_invisible_total",
		Help: "Outcome writes put off because the row was not visible yet (its commit waits, e.g. for a synchronous standby); the event stays unsettled meanwhile.",
	}, []string{"path"})
	settleGone = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "settle_gone_total",
		Help: "Events settled without their outcome because their row was deleted before it was written (by hand, or a cleanup job), per path.",
	}, []string{"path"})
	settleRowDataErrors = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "settle_row_data_errors_total",
		Help: "Outcome writes PostgreSQL refused because of one row's data; the row is isolated and the others settle.",
	}, []string{"path"})
	settleErrors = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "settle_errors_total",
		Help: "Outcome writes that failed and are retried (database unreachable, tables locked, privileges); nothing settles meanwhile.",
	}, []string{"path"})
	// Stalled and LastProgress are the stall detector's
	// (docs/operations-health.md), which cmd/outbox-relay runs.
	Stalled = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "stalled",
		Help: "1 while the relay holds events it has not settled or acknowledged and has made no progress for http.stall_after (/healthz fails); 0 otherwise.",
	})
	LastProgress = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "last_progress_timestamp_seconds",
		Help: "When the relay last made progress (Unix time): the stream acknowledged a new position or the claim path settled an event, or nothing was waiting.",
	})
	// VerifyGaps and VerifyLastRun are the continuous verify's
	// (docs/operations.md, "verify"), which cmd/outbox-relay runs; the kind
	// label takes ledger/admin's gap kinds.
	VerifyGaps = promauto.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "verify_gaps",
		Help: "Gaps the last continuous verify found in its window, by kind: missing, stuck, unrouted, orphaned (verify.interval; 0 while it is off).",
	}, []string{"kind"})
	VerifyLastRun = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "verify_last_run_timestamp_seconds",
		Help: "When the last continuous verify pass ended (Unix time); 0 while it is off or has not ended a pass.",
	})
	up = promauto.NewGauge(prometheus.GaugeOpts{Namespace: "outbox_relay", Name: "up", Help: "1 while the relay runs."})
)

func init() { up.Set(1) }

// SetMode sets ModeGauge to mode.
func SetMode(mode string) {
	for _, m := range []string{"replication", "poll"} {
		v := 0.0
		if m == mode {
			v = 1
		}
		ModeGauge.WithLabelValues(m).Set(v)
	}
}

// divertReasons are the reason label values of handed_off_total: why the
// stream diverted an event to the claim path (Outcome.Why; "retries" for a
// counted failure). TestDivertReasons holds the list to the code.
var divertReasons = []string{"retries", "scheduled", "lane_blocked", "sink_down", "ordering", "stopping", "claimed", "paused", "rate_limited"}

// InitMetrics creates at 0 the labelled series of each route's sink (both
// paths, every diversion reason) and of both modes, which would otherwise
// appear only at their first event: a dashboard panel then shows 0 rather
// than no data, and Prometheus's increase() sees a sink's first dead letter
// as a rise from 0 (a counter series that appears at 1 shows no increase),
// so the OutboxRelayDeadLetters alert fires for it
// (deploy/prometheus/alerts_test.yml). Existing series keep their values.
func InitMetrics(routes []Route) {
	for _, m := range []string{"replication", "poll"} {
		ModeGauge.WithLabelValues(m)
	}
	for _, r := range routes {
		sink := r.Sink.Name()
		for _, p := range []Path{PathStream, PathClaim} {
			path := string(p)
			deliveredTotal.WithLabelValues(sink, path)
			failedTotal.WithLabelValues(sink, path)
			retriedTotal.WithLabelValues(sink, path)
			heldTotal.WithLabelValues(sink, path)
			deliveryLatency.WithLabelValues(sink, path)
		}
		receiverOrderViolations.WithLabelValues(sink)
		sinkPaused.WithLabelValues(sink)
		rateLimitWait.WithLabelValues(sink)
		limit := 0.0
		if r.RateLimit != nil {
			limit = float64(r.RateLimit.Limit())
		}
		sinkRateLimit.WithLabelValues(sink).Set(limit)
		for _, reason := range divertReasons {
			divertedTotal.WithLabelValues(sink, reason)
		}
	}
}

// observeDiverted counts a diversion from the stream.
func observeDiverted(sink, reason string) { divertedTotal.WithLabelValues(sink, reason).Inc() }

// sinkMetrics are one sink's stream-path series, resolved once: looking a
// series up by its labels hashes them, which the per-event path should not.
type sinkMetrics struct {
	delivered, failed, retried, held prometheus.Counter
	latency                          prometheus.Observer
}

func newSinkMetrics(sink string, p Path) sinkMetrics {
	path := string(p)
	return sinkMetrics{
		delivered: deliveredTotal.WithLabelValues(sink, path),
		failed:    failedTotal.WithLabelValues(sink, path),
		retried:   retriedTotal.WithLabelValues(sink, path),
		held:      heldTotal.WithLabelValues(sink, path),
		latency:   deliveryLatency.WithLabelValues(sink, path),
	}
}

func (m sinkMetrics) observeDelivered(since time.Time) {
	m.delivered.Inc()
	if !since.IsZero() {
		m.latency.Observe(time.Since(since).Seconds())
	}
}
