package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Metrics of decoding on a standby (docs/operations.md).
var (
	// StandbyReplayLag is the standby's replay lag as StandbyWatch measures
	// it.
	StandbyReplayLag = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "standby_replay_lag_seconds",
		Help: "How long the oldest WAL the primary flushed and the standby the stream decodes on (source.standby_url) has not replayed has waited; 0 when it is caught up.",
	})
	// StandbyMoves counts the moves of delivery off the standby (to
	// "primary", reason "unreachable" or "lagging") and back (to
	// "standby", reason "healthy").
	StandbyMoves = promauto.NewCounterVec(prometheus.CounterOpts{
		Namespace: "outbox_relay", Name: "standby_moves_total",
		Help: "Moves of delivery off the standby the stream decodes on to the primary (to=primary, reason unreachable or lagging) and back (to=standby, reason healthy).",
	}, []string{"to", "reason"})
	// DecodingOnStandby is 1 while the stream decodes on the standby.
	DecodingOnStandby = promauto.NewGauge(prometheus.GaugeOpts{
		Namespace: "outbox_relay", Name: "decoding_on_standby",
		Help: "1 while the stream decodes on the standby (source.standby_url), 0 while delivery runs on the primary.",
	})
)

// Reasons of a StandbyUnavailableError.
const (
	StandbyUnreachable = "unreachable"
	StandbyLagging     = "lagging"
)

// StandbyUnavailableError reports that the standby the stream decodes on is
// unreachable, or lags its primary, past StandbyWatchConfig.MaxLag.
type StandbyUnavailableError struct {
	// Kind is StandbyUnreachable or StandbyLagging.
	Kind string
	// Lag is how far behind the standby is (or how long it has been
	// unreachable).
	Lag time.Duration
	// Err is the last connection error, when unreachable.
	Err error
}

func (e *StandbyUnavailableError) Error() string {
	return "the standby the stream decodes on is unavailable: " + e.UnavailableReason()
}

// UnavailableReason says why, for the log.
func (e *StandbyUnavailableError) UnavailableReason() string {
	if e.Kind == StandbyUnreachable {
		return fmt.Sprintf("unreachable for %s (source.standby_max_lag): %v", e.Lag.Round(time.Millisecond), e.Err)
	}
	return fmt.Sprintf("its replay lags the primary by %s, past source.standby_max_lag", e.Lag.Round(time.Millisecond))
}

func (e *StandbyUnavailableError) Unwrap() error { return e.Err }

// StandbyWatchConfig configures a StandbyWatch.
type StandbyWatchConfig struct {
	// ConnString names the standby (source.standby_url).
	ConnString string
	// Primary gives the primary's flushed WAL position.
	Primary interface {
		WALFlushPosition(ctx context.Context) (relay.LSN, error)
	}
	// MaxLag is the bound (source.standby_max_lag): a standby unreachable,
	// or whose replay lags, longer than this is unavailable.
	MaxLag time.Duration
	// Every is how often the positions are read [min(MaxLag/4, 1s), at
	// least 50 ms].
	Every time.Duration
	// Void, when set, is called once the standby is found unavailable,
	// before Watch returns: it records on the primary that the slot on the
	// standby no longer carries delivery (its hand-over is void), so that
	// the slot is made again through the hand-over when delivery returns
	// to it, even after a restart of the relay. It is retried until it
	// succeeds or ctx ends.
	Void   func(ctx context.Context) error
	Logger zerolog.Logger
}

// StandbyWatch measures how far the standby the stream decodes on is
// behind its primary: every Every it reads the primary's flushed WAL
// position and the standby's replayed one, and the lag is the age of the
// oldest position the primary had flushed that the standby has not
// replayed (0 when it has replayed everything). Unlike
// pg_last_xact_replay_timestamp() this is 0 on an idle primary, and it
// grows while the standby is cut off from its primary but reachable. Create
// it with NewStandbyWatch.
type StandbyWatch struct {
	cfg StandbyWatchConfig
	log zerolog.Logger
	// conn is the watch's connection to the standby; one goroutine at a
	// time uses it (Watch and WaitHealthy are not called concurrently).
	conn *pgx.Conn
}

// NewStandbyWatch validates cfg and fills in defaults. It does not connect.
func NewStandbyWatch(cfg StandbyWatchConfig) (*StandbyWatch, error) {
	if cfg.Primary == nil {
		return nil, errors.New("standby watch: Primary is nil")
	}
	if cfg.MaxLag <= 0 {
		return nil, errors.New("standby watch: MaxLag must be positive")
	}
	if _, err := pgx.ParseConfig(cfg.ConnString); err != nil {
		return nil, fmt.Errorf("standby watch: connection string: %w", err)
	}
	if cfg.Every <= 0 {
		cfg.Every = max(min(cfg.MaxLag/4, time.Second), 50*time.Millisecond)
	}
	return &StandbyWatch{cfg: cfg, log: cfg.Logger}, nil
}

// sample is a primary's flushed position and when it was read.
type sample struct {
	at  time.Time
	lsn relay.LSN
}

// lagMeter keeps the primary's positions the standby has not replayed.
type lagMeter struct {
	pending []sample
	// unreachableSince is when the standby stopped answering; zero while
	// it answers.
	unreachableSince time.Time
	lastErr          error
}

// observe records one round: the primary's position (ok false when it
// could not be read) and the standby's replayed one (err when it could not
// be read).
func (m *lagMeter) observe(now time.Time, primary relay.LSN, primaryOK bool, replayed relay.LSN, err error) {
	if primaryOK && (len(m.pending) == 0 || primary > m.pending[len(m.pending)-1].lsn) {
		m.pending = append(m.pending, sample{at: now, lsn: primary})
	}
	if err != nil {
		if m.unreachableSince.IsZero() {
			m.unreachableSince = now
		}
		m.lastErr = err
		return
	}
	m.unreachableSince, m.lastErr = time.Time{}, nil
	i := 0
	for i < len(m.pending) && m.pending[i].lsn <= replayed {
		i++
	}
	m.pending = m.pending[i:]
}

// lag is the age of the oldest position not replayed.
func (m *lagMeter) lag(now time.Time) time.Duration {
	if len(m.pending) == 0 {
		return 0
	}
	return now.Sub(m.pending[0].at)
}

// verdict returns the standby's state against maxLag: nil when it is
// available.
func (m *lagMeter) verdict(now time.Time, maxLag time.Duration) *StandbyUnavailableError {
	if !m.unreachableSince.IsZero() {
		if d := now.Sub(m.unreachableSince); d > maxLag {
			return &StandbyUnavailableError{Kind: StandbyUnreachable, Lag: d, Err: m.lastErr}
		}
		return nil
	}
	if lag := m.lag(now); lag > maxLag {
		return &StandbyUnavailableError{Kind: StandbyLagging, Lag: lag}
	}
	return nil
}

// round reads both positions once.
func (w *StandbyWatch) round(ctx context.Context, m *lagMeter) {
	primary, perr := w.cfg.Primary.WALFlushPosition(ctx)
	if perr != nil && ctx.Err() == nil {
		w.log.Debug().Err(perr).Msg("standby watch: read the primary's position")
	}
	replayed, err := w.replayed(ctx)
	if ctx.Err() != nil {
		return
	}
	now := time.Now()
	m.observe(now, primary, perr == nil, replayed, err)
	StandbyReplayLag.Set(m.lag(now).Seconds())
}

// replayed reads the standby's replayed position, connecting when needed.
func (w *StandbyWatch) replayed(ctx context.Context) (relay.LSN, error) {
	if w.conn == nil {
		cfg, err := pgx.ParseConfig(w.cfg.ConnString)
		if err != nil {
			return 0, err
		}
		cfg.DialFunc = relay.Dial
		if cfg.ConnectTimeout == 0 || cfg.ConnectTimeout > w.cfg.MaxLag {
			cfg.ConnectTimeout = max(min(relay.ConnectTimeout, w.cfg.MaxLag), time.Second)
		}
		if w.conn, err = pgx.ConnectConfig(ctx, cfg); err != nil {
			w.conn = nil
			return 0, err
		}
	}
	qctx, cancel := context.WithTimeout(ctx, max(w.cfg.MaxLag/2, time.Second))
	defer cancel()
	var lsn relay.LSN
	if err := w.conn.QueryRow(qctx, replayPositionSQL).Scan(&lsn); err != nil {
		w.close()
		return 0, err
	}
	return lsn, nil
}

func (w *StandbyWatch) close() {
	if w.conn != nil {
		closeConn(w.conn)
		w.conn = nil
	}
}

// Watch measures the standby's lag until ctx ends, then returns nil. It
// returns a *StandbyUnavailableError, after Void has succeeded, once the
// standby has been unreachable, or its replay has lagged, longer than
// MaxLag. It must not be called concurrently with itself or WaitHealthy.
func (w *StandbyWatch) Watch(ctx context.Context) error {
	defer w.close()
	var m lagMeter
	tick := time.NewTicker(w.cfg.Every)
	defer tick.Stop()
	for {
		w.round(ctx, &m)
		if bad := m.verdict(time.Now(), w.cfg.MaxLag); bad != nil {
			if err := w.void(ctx); err != nil {
				return nil // ctx ended
			}
			return bad
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// void runs Void until it succeeds or ctx ends.
func (w *StandbyWatch) void(ctx context.Context) error {
	if w.cfg.Void == nil {
		return nil
	}
	for {
		err := w.cfg.Void(ctx)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		w.log.Warn().Err(err).Msg("standby watch: record on the primary that the slot on the standby no longer carries delivery; retrying")
		if !relay.Sleep(ctx, time.Second) {
			return ctx.Err()
		}
	}
}

// healthyRounds is how many consecutive rounds WaitHealthy wants the
// standby reachable and within half the bound.
const healthyRounds = 3

// WaitHealthy returns nil once the standby has replayed the position the
// primary had flushed when the wait began, and then answered and lagged
// less than half of MaxLag for healthyRounds rounds in a row — so delivery
// does not move back to a standby still cut off or catching up — or
// returns ctx's error. It must not be called concurrently with itself or
// Watch.
func (w *StandbyWatch) WaitHealthy(ctx context.Context) error {
	defer w.close()
	var m lagMeter
	tick := time.NewTicker(w.cfg.Every)
	defer tick.Stop()
	var first relay.LSN // the primary's position when the wait began
	caughtUp, good := false, 0
	for {
		w.round(ctx, &m)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if first == 0 && len(m.pending) > 0 {
			first = m.pending[0].lsn
		}
		reachable := m.unreachableSince.IsZero()
		// A sample is dropped once replayed: the first one gone means
		// the standby has replayed where the primary was.
		caughtUp = caughtUp || (reachable && first != 0 && (len(m.pending) == 0 || m.pending[0].lsn > first))
		if caughtUp && reachable && m.lag(time.Now()) <= w.cfg.MaxLag/2 {
			good++
		} else {
			good = 0
		}
		if good >= healthyRounds {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}
