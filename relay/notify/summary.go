package notify

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Summary is one notification: the dead letters and held events of one
// channel settled after its mark.
type Summary struct {
	// Sink is the sink's name, or AnySink.
	Sink string
	// Count is how many events, Failed of them dead letters and Held held.
	Count, Failed, Held int
	// More is set when the pass stopped reading at its limit: Count is a
	// lower bound and the next notification goes on from To.
	More bool
	// Events are the first FirstEvents events, oldest first.
	Events []Event
	// LastError is the last_error of the newest event.
	LastError string
	// Since and Until are the settlement times of the oldest and newest
	// events.
	Since, Until time.Time
	// From and To bound the window: the events settled after From, up to
	// To. They identify the notification: a repeat of it carries the same
	// ID.
	From, To Mark
	// ConsoleURL is the console's address, or empty.
	ConsoleURL string
}

// Event is one event a summary names.
type Event struct {
	ID       int64  `json:"id"`
	EventKey string `json:"event_key"`
	Status   string `json:"status"`
}

// ID identifies the notification, the same each time it is sent: the
// channel and the window's bounds.
func (s Summary) ID() string {
	return fmt.Sprintf("%s:%d.%d-%d.%d", s.Sink, s.From.At.UnixMicro(), s.From.ID, s.To.At.UnixMicro(), s.To.ID)
}

// Headline says in one line what happened, and where.
func (s Summary) Headline() string {
	var what []string
	if s.Failed > 0 {
		what = append(what, plural(s.Failed, "event", "events")+" dead-lettered")
	}
	if s.Held > 0 {
		what = append(what, plural(s.Held, "event", "events")+" held for a decision")
	}
	where := "at sink " + s.Sink
	if s.Sink == AnySink {
		where = "naming no sink"
	}
	line := fmt.Sprintf("outbox-relay: %s %s", strings.Join(what, " and "), where)
	if s.More {
		line += " (and more: the next notification goes on)"
	}
	return line
}

// ListCommand is the command that lists the summary's events, and the
// rest of the sink's dead letters.
func (s Summary) ListCommand() string {
	if s.Sink == AnySink {
		return "outbox-relay dlq list"
	}
	return "outbox-relay dlq list --sink " + shellQuote(s.Sink)
}

// RetryCommand is the command that delivers the sink's dead letters and
// held events again; for AnySink, the events the summary names.
func (s Summary) RetryCommand() string {
	if s.Sink != AnySink {
		return "outbox-relay dlq retry --sink " + shellQuote(s.Sink)
	}
	ids := make([]string, len(s.Events))
	for i, e := range s.Events {
		ids[i] = strconv.FormatInt(e.ID, 10)
	}
	return "outbox-relay dlq retry --ids " + strings.Join(ids, ",")
}

// window gathers one pass's summaries: counters and the first events per
// channel, never the rows.
type window struct {
	marks     map[string]Mark
	summaries map[string]*Summary
	last      Mark // the newest dead letter read
}

func newWindow(channels []string, marks map[string]Mark) *window {
	w := &window{marks: marks, summaries: make(map[string]*Summary, len(channels))}
	for _, ch := range channels {
		w.summaries[ch] = &Summary{Sink: ch}
	}
	return w
}

// add counts d for each of channels it concerns whose mark it is after.
func (w *window) add(d DeadLetter, channels []string) {
	w.last = d.Mark
	for _, ch := range channels {
		s, ok := w.summaries[ch]
		if !ok || !w.marks[ch].Before(d.Mark) {
			continue
		}
		if s.Count == 0 {
			s.Since = d.At
		}
		s.Count++
		if d.Status == "held" {
			s.Held++
		} else {
			s.Failed++
		}
		if len(s.Events) < FirstEvents {
			s.Events = append(s.Events, Event{ID: d.ID, EventKey: d.EventKey, Status: d.Status})
		}
		s.LastError, s.Until = d.LastError, d.At
	}
}

func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.Itoa(n) + " " + many
}

// shellQuote quotes s for a POSIX shell when it holds more than letters,
// digits and ._-.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
