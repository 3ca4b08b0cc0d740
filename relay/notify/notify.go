// Package notify tells a person about new dead letters: every interval it
// reads the events dead-lettered (status failed) or held since the last
// notification, from the database, and sends one summary per sink — how
// many, the first few, the last error, the command that acts on them — at
// most once per interval per sink (docs/operations.md, "Dead-letter
// notifications").
//
// The notifier reads the database, not the engine's memory: the outbox is
// the record of every dead letter on every path and every relay, and the
// marks it keeps per sink (how far it has notified) live beside it, so a
// restart neither repeats nor loses a notification and two relays never
// send the same one. A notification that fails is not an event: it is sent
// again, with what accumulated meanwhile, at the next interval, and it
// never holds delivery back.
package notify

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/relay"
)

// AnySink is the channel of the dead letters whose last_error names no
// configured sink (relay.ReasonSinks): a key the ledger cannot hold, an
// outcome PostgreSQL refused to store, a sink since renamed.
const AnySink = "*"

// Defaults applied by New to zero Config fields.
const (
	DefaultInterval = time.Minute
	// DefaultMaxRows bounds one pass's read. A pass keeps counters and
	// the first few events per sink, never the rows: its memory does not
	// grow with them.
	DefaultMaxRows = 50_000
)

// FirstEvents is how many events a summary names.
const FirstEvents = 5

// Mark is a position in the order events became dead letters or were held:
// their settlement's time, then their id.
type Mark struct {
	At time.Time
	ID int64
}

// Before reports whether m comes before o.
func (m Mark) Before(o Mark) bool {
	return m.At.Before(o.At) || m.At.Equal(o.At) && m.ID < o.ID
}

// DeadLetter is one failed or held event as the notifier reads it.
type DeadLetter struct {
	Mark
	EventKey string
	// Status is "failed" or "held".
	Status    string
	LastError string
}

// Claim is one relay's hold on a channel's next notification.
type Claim struct {
	Channel string
	// At is when the claim was taken, as the store recorded it.
	At time.Time
}

// Store is where the notifier reads the dead letters and keeps, per
// channel, how far it has notified. Every method is safe to call from
// several relays at once.
type Store interface {
	// Marks returns the mark of each of channels: every dead letter up to
	// it was notified about, or did not concern the channel. A channel
	// without a mark gets one at the newest settlement every reader sees:
	// a channel is told of the dead letters settled from its first pass
	// on. A channel whose mark another relay is creating at the same
	// moment may be missing from the result.
	Marks(ctx context.Context, channels []string) (map[string]Mark, error)
	// Read calls each with the dead letters after from, in mark order, at
	// most limit of them, and returns how many it read. It reads only
	// rows that no later Read can find before them: none settled by a
	// transaction still open, so a mark moved past a row never skips one
	// that commits later.
	Read(ctx context.Context, from Mark, limit int, each func(DeadLetter)) (int, error)
	// Claim takes channel's next notification for this relay if the
	// channel's mark is still from and no relay attempted a notification
	// of it in the last every; ok is false otherwise. Of relays claiming
	// at once, at most one gets it.
	Claim(ctx context.Context, channel string, from Mark, every time.Duration) (c Claim, ok bool, err error)
	// Record moves the claimed channel's mark to to, once its
	// notification was accepted. It returns false when the claim is no
	// longer this relay's.
	Record(ctx context.Context, c Claim, to Mark) (bool, error)
	// Pass moves the marks of channels that are before to up to to: no
	// dead letter up to it concerned them.
	Pass(ctx context.Context, channels []string, to Mark) error
}

// Sender delivers a summary to the person's channel (a webhook).
type Sender interface {
	// Send delivers s once: nil when the receiver accepted it (a 2xx),
	// an error when it refused it, did not answer, or could not be
	// reached. Send never sends s a second time by itself; the notifier
	// sends it again, with what accumulated meanwhile, at the next
	// interval.
	Send(ctx context.Context, s Summary) error
}

// Config configures a Notifier. Zero fields take the defaults in brackets.
type Config struct {
	Store  Store
	Sender Sender
	// Sinks are the configured sinks' names: what a last_error can name.
	Sinks []string
	// Channels are the sinks notified about, and AnySink for the dead
	// letters that name none [every sink and AnySink].
	Channels []string
	// Interval is the time between passes, and the least time between two
	// notifications of one channel [DefaultInterval].
	Interval time.Duration
	// ConsoleURL, when set, is the console's address, linked from every
	// summary.
	ConsoleURL string
	// MaxRows bounds the rows one pass reads [DefaultMaxRows]; a summary
	// of a pass that read that many says more follow.
	MaxRows int
	Logger  zerolog.Logger
}

// Notifier sends the dead-letter summaries. Run it on every relay: the
// store's claims decide which relay sends each.
type Notifier struct {
	store      Store
	sender     Sender
	sinks      []string
	channels   []string
	interval   time.Duration
	consoleURL string
	maxRows    int
	log        zerolog.Logger
	// failing holds the channels whose last notification failed: a
	// failure is logged when it starts and when it ends, not at every
	// interval. Only Run's goroutine uses it.
	failing map[string]bool
}

// New validates cfg and returns a Notifier. It reads nothing.
func New(cfg Config) (*Notifier, error) {
	if cfg.Store == nil || cfg.Sender == nil {
		return nil, errors.New("notify: a store and a sender are required")
	}
	channels := cfg.Channels
	if len(channels) == 0 {
		channels = append(slices.Clone(cfg.Sinks), AnySink)
	}
	for i, ch := range channels {
		switch {
		case ch != AnySink && !slices.Contains(cfg.Sinks, ch):
			return nil, fmt.Errorf("notify: %q is not a configured sink (nor %q, the dead letters that name none)", ch, AnySink)
		case slices.Contains(channels[:i], ch):
			return nil, fmt.Errorf("notify: %q is listed twice", ch)
		}
	}
	if cfg.Interval < 0 || cfg.MaxRows < 0 {
		return nil, errors.New("notify: interval and max rows must not be negative")
	}
	n := &Notifier{
		store: cfg.Store, sender: cfg.Sender,
		sinks: slices.Clone(cfg.Sinks), channels: slices.Clone(channels),
		interval: cfg.Interval, consoleURL: cfg.ConsoleURL, maxRows: cfg.MaxRows,
		log:     cfg.Logger.With().Str("component", "notify").Logger(),
		failing: map[string]bool{},
	}
	if n.interval == 0 {
		n.interval = DefaultInterval
	}
	if n.maxRows == 0 {
		n.maxRows = DefaultMaxRows
	}
	for _, ch := range n.channels {
		for _, r := range []string{resultSent, resultFailed} {
			notificationsTotal.WithLabelValues(ch, r)
		}
	}
	return n, nil
}

// Run makes a pass at once and then one interval after each pass has
// ended, until ctx ends; it returns nil then. A pass that fails (the
// database) is logged and made again at the next interval.
func (n *Notifier) Run(ctx context.Context) error {
	n.log.Info().Strs("sinks", n.channels).Dur("interval", n.interval).
		Msg("notify: sending a summary of new dead letters and held events per sink, at most once per interval")
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
		if err := n.pass(ctx); err != nil && ctx.Err() == nil {
			n.log.Warn().Err(err).Dur("retry_in", n.interval).Msg("notify: pass failed; the next interval tries again")
		}
		timer.Reset(n.interval)
	}
}

// pass reads the dead letters after the earliest channel's mark and sends
// each channel with new ones its summary. The claim's interval spacing is
// measured by the store between claims; a pass starts an interval after
// the previous one ended, so its claims come at least an interval after
// the previous pass's.
func (n *Notifier) pass(ctx context.Context) error {
	marks, err := n.store.Marks(ctx, n.channels)
	if err != nil {
		return fmt.Errorf("read the marks: %w", err)
	}
	channels := slices.DeleteFunc(slices.Clone(n.channels), func(ch string) bool { _, ok := marks[ch]; return !ok })
	if len(channels) == 0 {
		return nil
	}
	from := marks[channels[0]]
	for _, ch := range channels[1:] {
		if marks[ch].Before(from) {
			from = marks[ch]
		}
	}
	window := newWindow(channels, marks)
	read, err := n.store.Read(ctx, from, n.maxRows, func(d DeadLetter) {
		window.add(d, n.channelsOf(d))
	})
	if err != nil {
		return fmt.Errorf("read the dead letters: %w", err)
	}
	if read == 0 {
		return nil
	}
	end, more := window.last, read >= n.maxRows
	var quiet []string
	var errs []error
	for _, ch := range channels {
		s := window.summaries[ch]
		if s.Count == 0 {
			if marks[ch].Before(end) {
				quiet = append(quiet, ch)
			}
			continue
		}
		s.From, s.To, s.More, s.ConsoleURL = marks[ch], end, more, n.consoleURL
		if err := n.notify(ctx, *s); err != nil {
			errs = append(errs, err)
		}
	}
	if len(quiet) > 0 {
		if err := n.store.Pass(ctx, quiet, end); err != nil {
			errs = append(errs, fmt.Errorf("move the marks of %q: %w", quiet, err))
		}
	}
	return errors.Join(errs...)
}

// channelsOf returns the channels a dead letter concerns: the sinks its
// last_error names, or AnySink.
func (n *Notifier) channelsOf(d DeadLetter) []string {
	if sinks := relay.ReasonSinks(d.LastError, n.sinks); len(sinks) > 0 {
		return sinks
	}
	return []string{AnySink}
}

// notify claims s's channel, sends s and records it. It returns only the
// store's errors: a summary the receiver did not accept waits for the next
// interval.
func (n *Notifier) notify(ctx context.Context, s Summary) error {
	log := n.log.With().Str("sink", s.Sink).Logger()
	claim, ok, err := n.store.Claim(ctx, s.Sink, s.From, n.interval)
	if err != nil {
		return fmt.Errorf("claim the notification of %s: %w", s.Sink, err)
	}
	if !ok {
		// Another relay sends this window, or one was attempted less
		// than an interval ago.
		log.Debug().Int("dead_letters", s.Count).Msg("notify: not this relay's turn, or an interval has not passed since the last attempt")
		return nil
	}
	if err := n.sender.Send(ctx, s); err != nil {
		if ctx.Err() != nil {
			return nil // stopping: the next start sends it
		}
		notificationsTotal.WithLabelValues(s.Sink, resultFailed).Inc()
		ev := log.Debug()
		if !n.failing[s.Sink] {
			ev = log.Warn()
		}
		n.failing[s.Sink] = true
		ev.Err(err).Int("dead_letters", s.Count).Dur("retry_in", n.interval).
			Msg("notify: the notification was not accepted; the next interval sends it again with what accumulated; delivery goes on")
		return nil
	}
	notificationsTotal.WithLabelValues(s.Sink, resultSent).Inc()
	recorded, err := n.store.Record(ctx, claim, s.To)
	if err != nil || !recorded {
		// Sent, not recorded: the next notification repeats it.
		if err == nil {
			err = errors.New("another relay took the claim over")
		}
		return fmt.Errorf("record the notification of %s (sent; it may be sent again): %w", s.Sink, err)
	}
	if n.failing[s.Sink] {
		delete(n.failing, s.Sink)
		log.Info().Msg("notify: the notification target accepts notifications again")
	}
	log.Info().Int("dead_letters", s.Failed).Int("held", s.Held).Bool("more", s.More).Str("list", s.ListCommand()).
		Msg("notify: " + s.Headline())
	return nil
}
