package notify

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// Results of a notification, the result label.
const (
	resultSent   = "sent"
	resultFailed = "failed"
)

// notificationsTotal counts the notifications this relay sent, per channel
// and result (docs/operations.md, "Metrics").
var notificationsTotal = promauto.NewCounterVec(prometheus.CounterOpts{
	Namespace: "outbox_relay", Name: "notifications_total",
	Help: "Dead-letter notifications this relay sent, per sink (\"*\": dead letters that name no sink) and result: sent (accepted with a 2xx) or failed (sent again, with what accumulated, at the next interval).",
}, []string{"sink", "result"})
